"""One connected, authenticated peer: framing, heartbeats, credits, failure, orderly close.

The base of the cross-process transports (`transport.py` for samples,
`weights.py` for parameters); `peers.py` opens and authenticates the
connection, this module runs it. Messages use the standard library's
`multiprocessing.connection.Connection` framing (length-prefixed
`send_bytes` / `recv_bytes`); each starts with a one-byte kind:

* `P` ping (heartbeat, sent when a side has sent nothing for `heartbeat_s`);
* `C` credit grant (count, and the version acknowledged, if any);
* `D` data (the payload is the owner's: a pickled sample, a weight header),
  optionally followed by raw bytes written straight to the socket (bulk
  arrays: one copy kernel → destination buffer, no framing copies);
* `E` end (orderly close; answered by an `E`, then both sides close).

Back-pressure: a `D` frame costs the sender one credit; the receiver grants
credits only for room it has (queue slots, weight buffers), so neither side
ever holds more than it granted. A sender with no credit waits, up to its
timeout, and then raises `TransportTimeout` naming the peer.

Loss of a peer: EOF or a reset on the socket, or no complete frame (data or
ping) within `timeout_s`, fails the channel with `PeerLost` naming the peer;
the socket is shut down, which wakes every thread blocked on it. So every
blocking call returns or raises within a bounded time.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from absl import logging

from streamrl_jax.mailbox import Mailbox

_PING, _CREDIT, _DATA, _END = b"P", b"C", b"D", b"E"
_CREDIT_FMT = "!iq"  # credits granted, version acknowledged (-1: none)
_CREDIT_SIZE = 1 + struct.calcsize(_CREDIT_FMT)
# Largest frame read (a pickled sample or a weight header; bulk array bytes are read
# separately into preallocated buffers). A longer one fails the channel, never allocated.
MAX_FRAME_BYTES = 16 << 20


class TransportError(RuntimeError):
    """A cross-process channel failed; the message names the peer."""


class PeerLost(TransportError):
    """The peer closed the connection, reset it, or went silent past the timeout."""


class TransportTimeout(TransportError, TimeoutError):
    """A blocking transport call ran past its timeout."""


class ChannelClosed(TransportError):
    """The channel was closed in an orderly way (by either side)."""


class AuthenticationFailed(TransportError):
    """The handshake failed: wrong authkey, or only one side has one."""


def default_heartbeat(timeout_s: float) -> float:
    """Pings often enough that `timeout_s` of silence means the peer is gone."""
    return min(timeout_s / 4, 5.0)


def refuse_data(channel: Channel, payload: memoryview) -> None:
    """`on_data` of a side that only sends data: receiving any is a protocol error."""
    raise TransportError(f"{channel.local}: {channel.peer} sent data to a sending-only side")


def shutdown_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Channel:
    """One connected, authenticated peer: reader thread, heartbeat, credits, orderly close.

    `on_data(channel, payload)` runs on the reader thread for each `D` frame
    (it may call `recv_raw_into` for the raw bytes that follow the frame);
    while it runs the silence timeout is paused (the reader is not reading).
    `on_lost(channel, exc)` runs once if the channel fails (not after an
    orderly close); `on_end(channel)` runs when the peer closes in order.
    """

    def __init__(
        self,
        conn: mpc.Connection,
        sock: socket.socket,
        *,
        local: str,
        peer: str,
        heartbeat_s: float,
        timeout_s: float,
        on_data: Callable[[Channel, memoryview], None],
        on_lost: Callable[[Channel, TransportError], None] | None = None,
        on_end: Callable[[Channel], None] | None = None,
    ):
        if not 0 < heartbeat_s < timeout_s:
            raise ValueError(f"need 0 < heartbeat_s ({heartbeat_s}) < timeout_s ({timeout_s})")
        self.local, self.peer = local, peer
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self._conn, self._sock = conn, sock
        self._on_data, self._on_lost, self._on_end = on_data, on_lost, on_end
        # The lock, timed waits and failure latch of the credits and flags below.
        self._state: Mailbox[None] = Mailbox(
            local, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._send_lock = threading.Lock()
        self._credits = 0
        self.acked_version = -1
        self._closing = False  # this side sent (or is sending) `E`
        self._ended = False  # the peer sent `E`
        self._in_handler = False
        self._last_recv = self._last_send = time.monotonic()
        self.bytes_sent = self.bytes_received = 0
        self._reader = threading.Thread(
            target=self._read_loop, name=f"{local}<-{peer}", daemon=True
        )
        self._monitor = threading.Thread(target=self._watch, name=f"{local}~{peer}", daemon=True)

    def start(self, credits: int = 0) -> None:
        self._credits = credits
        self._reader.start()
        self._monitor.start()

    # ------------------------------------------------------------------ sending
    def send(self, payload: bytes, *, raw: Sequence[memoryview] = (), timeout: float) -> None:
        """Sends one `D` frame (+ raw bytes), spending one credit; blocks up to `timeout`.

        Raises:
          TransportTimeout: no credit (the peer is not taking data) or the
            connection stayed busy for `timeout` seconds.
          PeerLost / ChannelClosed: the channel failed or was closed.
        """
        deadline = time.monotonic() + timeout
        self._state.wait_until(
            self._take_credit,
            timeout=timeout,
            what=f"credit (no credit from {self.peer}: back-pressure, the peer is not taking data)",
        )
        self._write([_DATA + payload], raw, deadline - time.monotonic())

    def _take_credit(self) -> bool:
        """`send`'s wait predicate (under the lock): spends a credit if there is one."""
        self._raise_if_down()
        if self._credits == 0:
            return False
        self._credits -= 1
        return True

    def grant(self, credits: int, version: int = -1) -> None:
        """Gives the peer `credits` more sends (and acknowledges `version`, if >= 0)."""
        with contextlib.suppress(TransportError):
            self._write([_CREDIT + struct.pack(_CREDIT_FMT, credits, version)], (), self.timeout_s)

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

    def _write(
        self,
        frames: Sequence[bytes],
        raw: Sequence[memoryview],
        timeout: float,
        *,
        closing: bool = False,
    ) -> None:
        if not self._send_lock.acquire(timeout=max(timeout, 0.0)):
            self._raise_if_down()
            raise TransportTimeout(
                f"{self.local}: sending to {self.peer} stayed blocked for {timeout:.1f} s"
            )
        try:
            if closing:  # the `E` frame goes out while `_closing` is already set
                if self.error is not None:
                    raise self.error
            else:
                self._raise_if_down()
            for frame in frames:
                self._conn.send_bytes(frame)
                self.bytes_sent += len(frame)
            for buf in raw:
                self._sock.sendall(buf)
                self.bytes_sent += buf.nbytes
            self._last_send = time.monotonic()
        except OSError as e:
            self._fail(PeerLost(f"{self.local}: lost {self.peer} while sending ({e!r})"))
            self._raise_if_down()
        finally:
            self._send_lock.release()

    # ------------------------------------------------------------------ receiving
    def recv_raw_into(self, buf: memoryview) -> None:
        """Fills `buf` with raw bytes that follow the current `D` frame (reader thread only)."""
        self._in_handler = False
        try:
            view, got = buf.cast("B"), 0
            while got < view.nbytes:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise EOFError("connection closed mid-transfer")
                got += n
                self._last_recv = time.monotonic()
            self.bytes_received += got
        except (EOFError, OSError) as e:
            self._fail(PeerLost(f"{self.local}: lost {self.peer} mid-transfer ({e!r})"))
            self._raise_if_down()
        finally:
            self._in_handler = True

    def _read_loop(self) -> None:
        while True:
            try:
                frame = self._conn.recv_bytes(MAX_FRAME_BYTES)
            except (EOFError, OSError) as e:
                if "bad message length" in str(e):  # over MAX_FRAME_BYTES: never read in
                    self._fail(
                        TransportError(
                            f"{self.local}: frame from {self.peer} over {MAX_FRAME_BYTES} bytes"
                        )
                    )
                elif not (self._closing or self._ended):
                    self._fail(
                        PeerLost(f"{self.local}: lost {self.peer}: connection closed ({e!r})")
                    )
                with self._state.locked():
                    self._ended = True
                return
            self._last_recv = time.monotonic()
            self.bytes_received += len(frame)
            kind = frame[:1]
            if kind == _DATA:
                self._in_handler = True
                try:
                    self._on_data(self, memoryview(frame)[1:])
                except TransportError as e:
                    self._fail(e)
                    return
                except Exception as e:  # noqa: BLE001 - reported as this channel's failure
                    err = TransportError(f"{self.local}: handling data from {self.peer}: {e!r}")
                    err.__cause__ = e
                    self._fail(err)
                    return
                finally:
                    self._in_handler = False
                    self._last_recv = time.monotonic()
            elif kind == _CREDIT:
                credits, version = (
                    struct.unpack(_CREDIT_FMT, frame[1:]) if len(frame) == _CREDIT_SIZE else (0, 0)
                )
                if credits < 1 or version < -1:
                    self._fail(
                        TransportError(
                            f"{self.local}: malformed credit frame {frame[:16]!r} from {self.peer}"
                        )
                    )
                    return
                with self._state.locked():
                    self._credits += credits
                    self.acked_version = max(self.acked_version, version)
            elif kind == _END:
                with self._state.locked():
                    self._ended = True
                if not self._closing:  # answer, so the peer's close() returns at once
                    self._closing = True
                    with contextlib.suppress(TransportError):
                        self._write([_END], (), self.heartbeat_s, closing=True)
                if self._on_end is not None:
                    self._on_end(self)
            elif kind != _PING:
                self._fail(
                    TransportError(f"{self.local}: bad frame {frame[:16]!r} from {self.peer}")
                )
                return

    def _watch(self) -> None:
        tick = min(self.heartbeat_s, self.timeout_s / 4)
        while not (self._closing or self._ended or self.error):
            time.sleep(tick)
            now = time.monotonic()
            silent = now - self._last_recv
            if not self._in_handler and silent > self.timeout_s and not self._ended:
                self._fail(
                    PeerLost(
                        f"{self.local}: lost {self.peer}: no message or heartbeat for "
                        f"{silent:.1f} s (timeout {self.timeout_s:.1f} s)"
                    )
                )
                return
            if now - self._last_send >= self.heartbeat_s and self._send_lock.acquire(
                blocking=False
            ):
                try:
                    if not (self._closing or self.error):
                        self._conn.send_bytes(_PING)
                        self._last_send = now
                except OSError as e:
                    self._fail(PeerLost(f"{self.local}: lost {self.peer} ({e!r})"))
                finally:
                    self._send_lock.release()

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

    def _fail(self, exc: TransportError) -> None:
        if (self._closing and isinstance(exc, PeerLost)) or not self._state.fail(exc):
            return  # the socket closing under our own close, or not the first failure
        shutdown_socket(self._sock)
        logging.warning("%s", exc)
        if self._on_lost is not None:
            self._on_lost(self, exc)

    def close(self, timeout: float) -> None:
        """Orderly close: send `E`, wait (up to `timeout`) for the peer's `E`, close the socket."""
        if not self._closing and self.error is None:
            self._closing = True
            with contextlib.suppress(TransportError):
                self._write([_END], (), timeout, closing=True)
        self._closing = True
        with contextlib.suppress(TransportError):  # failed or timed out: close anyway
            self._state.wait_until(
                lambda: self._ended, timeout=timeout, what=f"{self.peer} to close in turn"
            )
        shutdown_socket(self._sock)
        self._reader.join(timeout)
        with contextlib.suppress(OSError):
            self._conn.close()
            self._sock.close()
