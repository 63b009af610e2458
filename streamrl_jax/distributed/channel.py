"""One authenticated peer over a ZeroMQ socket: credits, heartbeats, bulk bytes, failure, close.

The base of the cross-process transports (`transport.py` for samples,
`shard_sync.py` for parameters). `peers.py` owns the sockets (CURVE-encrypted,
every frame authenticated: see `keys.py`) and their I/O thread; a `Channel`
is one peer on such a socket. Every message is a multipart ZeroMQ message
whose first frame is one kind byte:

* `P` ping (heartbeat, sent when a side has sent nothing for `heartbeat_s`);
* `C` credit grant: count and the version acknowledged, if any (`!iq`);
* `D` data, then one frame of payload (the owner's: a `wire`-encoded sample,
  a weight need or shards header);
* `R` raw, then one chunk (at most `CHUNK_BYTES`) of the bulk bytes that
  follow a `D` (array data: written from the sender's buffer, copied once
  into the receiver's preallocated buffer);
* `E` end (orderly close; answered by an `E`);
* `H` hello and `X` refusal, before the channel exists (`peers.py`).

No frame is larger than `MAX_FRAME_BYTES` (the sockets' `MAXMSGSIZE`: a
larger one drops the connection before it is read in), and nothing is ever
unpickled.

Back-pressure: a `D` frame costs the sender one credit; the receiver grants
credits only for room it has (queue slots, weight buffers), so neither side
ever holds more than it granted; a `D` without credit fails the channel. A
sender with no credit waits, up to its timeout, and then raises
`TransportTimeout` naming the peer. Bulk bytes are accepted only into the
buffers the receiver's `on_data` returned for them (`RawSink`), exactly their
size: a header is checked before anything it declares is allocated.

Loss of a peer: its connection closing or dropping (a killed process, a
frame over the limit), or no message (data or ping) within `timeout_s` (a
stopped process; a connection stopped by a frame that failed authentication),
fails the channel with `PeerLost` naming the peer. Every blocking call
returns or raises within a bounded time.

Threads: `on_data`, `on_lost` and `on_end` run on the socket's I/O thread and
must not block (hand work to another thread); `send`, `grant`, `close` may be
called from any thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import threading
import time
from collections.abc import Callable, Sequence

from absl import logging

from streamrl_jax.mailbox import Mailbox

PING, CREDIT, DATA, RAW, END, HELLO, REFUSE = b"P", b"C", b"D", b"R", b"E", b"H", b"X"
_CREDIT_FMT = "!iq"  # credits granted, version acknowledged (-1: none)
_CREDIT_SIZE = struct.calcsize(_CREDIT_FMT)
# Largest frame a socket reads (a wire-encoded sample, a weight header, a raw chunk);
# a longer one drops the connection before it is allocated.
MAX_FRAME_BYTES = 16 << 20
CHUNK_BYTES = 8 << 20  # bulk bytes travel in chunks of at most this size


class TransportError(RuntimeError):
    """A cross-process channel failed; the message names the peer."""


class PeerLost(TransportError):
    """The peer closed the connection, it dropped, or the peer went silent past the timeout."""


class TransportTimeout(TransportError, TimeoutError):
    """A blocking transport call ran past its timeout."""


class ChannelClosed(TransportError):
    """The channel was closed in an orderly way (by either side)."""


class AuthenticationFailed(TransportError):
    """The handshake failed: the peers do not share the run key."""


def default_heartbeat(timeout_s: float) -> float:
    """Pings often enough that `timeout_s` of silence means the peer is gone."""
    return min(timeout_s / 4, 5.0)


@dataclasses.dataclass
class RawSink:
    """Where the bulk bytes after a `D` frame go: `buffers` in order, each exactly filled.

    `on_buffer(i)` runs (on the I/O thread) as buffer i completes.
    """

    buffers: list[memoryview]
    on_buffer: Callable[[int], None]
    index: int = 0
    offset: int = 0

    def skip_empty(self) -> None:
        while self.index < len(self.buffers) and self.buffers[self.index].nbytes == 0:
            self.on_buffer(self.index)
            self.index += 1

    @property
    def done(self) -> bool:
        return self.index >= len(self.buffers)


OnData = Callable[["Channel", memoryview], "RawSink | None"]
Post = Callable[[list, bool], None]  # (frames, copy): queue a message on the I/O thread


def refuse_data(channel: Channel, payload: memoryview) -> None:
    """`on_data` of a side that only sends data: receiving any is a protocol error."""
    raise TransportError(f"{channel.local}: {channel.peer} sent data to a sending-only side")


class Channel:
    """One authenticated peer: credits, heartbeat and silence watch, bulk bytes, orderly close.

    Created by `peers.py`, which feeds it the peer's messages (`deliver`) and
    clock ticks (`tick`) on the socket's I/O thread and sends what it `post`s.
    `on_data(channel, payload)` runs for each `D` frame and returns a `RawSink`
    when raw bytes follow. `on_lost(channel, exc)` runs once if the channel
    fails (not after an orderly close); `on_end(channel)` when the peer closes
    in order.
    """

    def __init__(
        self,
        *,
        local: str,
        peer: str,
        heartbeat_s: float,
        timeout_s: float,
        post: Post,
        detach: Callable[[], None],
        on_data: OnData,
        on_lost: Callable[[Channel, TransportError], None] | None = None,
        on_end: Callable[[Channel], None] | None = None,
    ):
        if not 0 < heartbeat_s < timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < timeout_s ({timeout_s})")
        self.local, self.peer = local, peer
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self._post, self._detach = post, detach
        self._on_data, self._on_lost, self._on_end = on_data, on_lost, on_end
        # The lock, timed waits and failure latch of the credits and flags below.
        self._state: Mailbox[None] = Mailbox(
            local, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._send_lock = threading.Lock()  # keeps a D frame and its raw chunks together
        self._credits = 0  # sends this side may make
        self._owed = 0  # sends the peer may make (granted, not yet used)
        self.acked_version = -1
        self._closing = False  # this side sent (or is sending) `E`
        self._ended = False  # the peer sent `E`
        self._sink: RawSink | None = None
        self._last_recv = self._last_send = time.monotonic()

    # ------------------------------------------------------------------ sending
    def send(self, payload: bytes, *, raw: Sequence[memoryview] = (), timeout: float) -> None:
        """Sends one `D` frame (+ raw bytes, not copied: keep them unchanged until the peer
        acknowledges), spending one credit; blocks up to `timeout` for the credit.

        Raises:
          TransportTimeout: no credit (the peer is not taking data) within `timeout`.
          PeerLost / ChannelClosed: the channel failed or was closed.
        """
        if len(payload) > MAX_FRAME_BYTES:
            raise TransportError(
                f"{self.local}: a {len(payload)}-byte message to {self.peer} is over "
                f"{MAX_FRAME_BYTES} bytes"
            )
        self._state.wait_until(
            self._take_credit,
            timeout=timeout,
            what=f"credit (no credit from {self.peer}: back-pressure, the peer is not taking data)",
        )
        with self._send_lock:
            self._send([DATA, payload], copy=True)
            for buf in raw:
                view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
                for start in range(0, view.nbytes, CHUNK_BYTES):
                    self._send([RAW, view[start : start + CHUNK_BYTES]], copy=False)

    def _send(self, frames: list, copy: bool) -> None:
        self._raise_if_down()
        self._post(frames, copy)
        self._last_send = time.monotonic()

    def _take_credit(self) -> bool:
        """`send`'s wait predicate (under the lock): spends a credit if there is one."""
        self._raise_if_down()
        if self._credits == 0:
            return False
        self._credits -= 1
        return True

    def grant(self, credits: int, version: int = -1) -> None:
        """Gives the peer `credits` more sends (and acknowledges `version`, if >= 0)."""
        with self._state.locked():
            self._owed += credits
        # A channel that is down reports its failure where it happened.
        with contextlib.suppress(TransportError):
            self._send([CREDIT, struct.pack(_CREDIT_FMT, credits, version)], copy=True)

    @property
    def credits(self) -> int:
        return self._credits

    def wait_acked(self, version: int, timeout: float) -> None:
        """Waits until the peer acknowledged `version` (with a credit grant)."""

        def acked() -> bool:
            if self.acked_version >= version:
                return True
            self._raise_if_down()
            return False

        self._state.wait_until(
            acked,
            timeout=timeout,
            what=lambda: (
                f"{self.peer} to acknowledge version {version} "
                f"(last acknowledged {self.acked_version})"
            ),
        )

    # ------------------------------------------------------------------ receiving (I/O thread)
    def deliver(self, frames: list) -> None:
        """One message from the peer (a list of `zmq.Frame`), on the I/O thread."""
        self._last_recv = time.monotonic()
        if self.error is not None:
            return
        try:
            self._handle(frames)
        except TransportError as e:
            self.fail(e)
        except Exception as e:  # noqa: BLE001 - reported as this channel's failure
            err = TransportError(f"{self.local}: handling data from {self.peer}: {e!r}")
            err.__cause__ = e
            self.fail(err)

    def _handle(self, frames: list) -> None:
        kind = frames[0].bytes
        body = frames[1].buffer if len(frames) == 2 else None
        if len(frames) > 2 or (body is None) != (kind in (PING, END)):
            raise TransportError(
                f"{self.local}: malformed message from {self.peer} (kind {kind[:8]!r}, "
                f"{len(frames)} frames)"
            )
        if kind == RAW:
            self._raw(body)
            return
        if self._sink is not None and kind == DATA:
            raise TransportError(
                f"{self.local}: {self.peer} sent a new message before the bulk bytes of the last"
            )
        if kind == DATA:
            with self._state.locked():
                if self._owed < 1:
                    raise TransportError(f"{self.local}: {self.peer} sent data without credit")
                self._owed -= 1
            sink = self._on_data(self, body)
            if sink is not None:
                sink.skip_empty()
                self._sink = None if sink.done else sink
        elif kind == CREDIT:
            credits, version = (
                struct.unpack(_CREDIT_FMT, body) if len(body) == _CREDIT_SIZE else (0, 0)
            )
            if credits < 1 or version < -1:
                raise TransportError(
                    f"{self.local}: malformed credit frame {bytes(body[:16])!r} from {self.peer}"
                )
            with self._state.locked():
                self._credits += credits
                self.acked_version = max(self.acked_version, version)
        elif kind == END:
            with self._state.locked():
                self._ended = True
            if not self._closing:  # answer, so the peer's close() returns at once
                self._closing = True
                self._post([END], True)
            if self._on_end is not None:
                self._on_end(self)
        elif kind != PING:
            raise TransportError(f"{self.local}: bad message kind {kind[:16]!r} from {self.peer}")

    def _raw(self, chunk: memoryview) -> None:
        sink = self._sink
        if sink is None:
            raise TransportError(f"{self.local}: {self.peer} sent bulk bytes nobody asked for")
        dest = sink.buffers[sink.index]
        end = sink.offset + chunk.nbytes
        if end > dest.nbytes:
            raise TransportError(
                f"{self.local}: {self.peer} sent more bulk bytes than buffer {sink.index} holds "
                f"({dest.nbytes})"
            )
        dest[sink.offset : end] = chunk
        sink.offset = end
        if end == dest.nbytes:
            sink.on_buffer(sink.index)
            sink.index, sink.offset = sink.index + 1, 0
            sink.skip_empty()
            if sink.done:
                self._sink = None

    def tick(self, now: float, note: str = "") -> None:
        """The I/O thread's clock: a ping when quiet, `PeerLost` after `timeout_s` of silence
        (`note`: what the socket saw that may explain it)."""
        if self._closing or self._ended or self.error is not None:
            return
        silent = now - self._last_recv
        if silent > self.timeout_s:
            self.fail(
                PeerLost(
                    f"{self.local}: lost {self.peer}: no message or heartbeat for "
                    f"{silent:.1f} s (timeout {self.timeout_s:.1f} s){note}"
                )
            )
        elif now - self._last_send >= self.heartbeat_s:
            self._last_send = now
            self._post([PING], True)

    # ------------------------------------------------------------------ state
    @property
    def error(self) -> TransportError | None:
        return self._state.error

    @property
    def ended(self) -> bool:
        """The peer closed in order (sent `E`) or the connection is gone."""
        return self._ended

    def _raise_if_down(self) -> None:
        if self.error is not None:
            raise self.error
        if self._closing or self._ended:
            raise ChannelClosed(f"{self.local}: channel to {self.peer} is closed")

    def fail(self, exc: TransportError) -> None:
        """Fails the channel (first failure wins); the peer is detached from the socket."""
        if (self._closing and self._ended) or not self._state.fail(exc):
            return  # closed in order already, or not the first failure
        with self._state.locked():
            self._ended = True
        logging.warning("%s", exc)
        self._detach()
        if self._on_lost is not None:
            self._on_lost(self, exc)

    def lost(self, why: str) -> None:
        """The socket saw the peer's connection go (I/O thread)."""
        if self._closing:  # going anyway: the connection closing under our own close
            with self._state.locked():
                self._ended = True
            return
        self.fail(PeerLost(f"{self.local}: lost {self.peer}: {why}"))

    def close(self, timeout: float) -> None:
        """Orderly close: send `E`, wait (up to `timeout`) for the peer's `E`, detach."""
        if not self._closing and self.error is None:
            self._closing = True
            self._post([END], True)
        self._closing = True
        with contextlib.suppress(TransportError):  # failed or timed out: close anyway
            self._state.wait_until(
                lambda: self._ended, timeout=timeout, what=f"{self.peer} to close in turn"
            )
        self._detach()
