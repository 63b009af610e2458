"""Cross-process sample channel: generation processes → the training process.

The training process runs one `SampleServer`; each generation process opens
one `SampleClient` to it and `send`s every finished `Sample` and its reports
(`messages.py`), encoded by `wire.py` (a fixed msgpack schema plus raw array
bytes; nothing is pickled). Connections are opened by `peers.py` (ZeroMQ
under CURVE with the run key) and run by `channel.Channel` (credits,
heartbeats); see those modules for the wire format and the failure model.

Back-pressure is credit-based and bounds memory: the server holds at most
`capacity` samples. Each of the `num_producers` producers is granted
`capacity // num_producers` credits; credits come back as the consumer
takes that producer's samples (`get`; in batches of a quarter of the share,
fewer round trips), or when `on_sample` returns in callback mode (e.g.
`on_sample=lambda s, peer: stream.put(s, timeout)`, which carries the in-process
`SampleStream`'s back-pressure across the wire; it runs on the server's one
delivery thread, in arrival order). A
producer without credit blocks in `send` and raises `TransportTimeout`
naming the server after `timeout`.

Failure: a lost producer (EOF, reset, silence past `timeout_s`) makes the
next `get` raise `PeerLost` naming it, even if other producers' samples are
queued (fail fast, as `SampleStream` does); `on_error` is told at once. A
lost server makes the producer's `send` raise `PeerLost`. With `on_lost`, the owner
may decide to go on without a lost producer (`on_lost(name, error)` returns True:
the trainer's roster, `pipeline/processes/roster.py`): its loss then counts as its end and
fails nothing. An orderly
`close()` is not a failure: once every producer has closed and the queue is
drained, `get` raises `ChannelClosed`.

Security: only processes holding the run key connect (`keys.py`); what they
send is still decoded against a fixed schema with bounded sizes (`wire.py`),
so even a buggy peer cannot make this process run code or allocate beyond
one frame.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from streamrl_jax.distributed import wire
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.peers import Endpoint, Hub, dial
from streamrl_jax.mailbox import Mailbox

Address = str | tuple[str, int]


class SampleServer:
    """Training side: accepts `num_producers` producers, delivers their samples in arrival order."""

    def __init__(
        self,
        address: Address,
        *,
        authkey: bytes,
        capacity: int,
        timeout_s: float = 60.0,
        num_producers: int = 1,
        heartbeat_s: float | None = None,
        on_sample: Callable[[Any, str], None] | None = None,
        on_error: Callable[[TransportError], None] | None = None,
        on_lost: Callable[[str, TransportError], bool] | None = None,
        name: str = "training",
    ):
        """Args:
        address: `host:port` to bind (port 0: any free port; see `address`).
        authkey: the run secret (`keys.py`).
        capacity: most samples held here (queued, or in flight under credit).
        timeout_s: handshake deadline and the silence after which a producer is lost.
        num_producers: producers expected; each gets `capacity // num_producers` credits.
        on_sample: if set, called on the server's delivery thread with each
          message and its sender's name (the producer's hello name, e.g.
          "generation-0") instead of queueing it; its return gives the credit back.
        on_error: called once per lost producer with the `PeerLost` error.
        on_lost: called first with a lost producer's name and its `PeerLost`; True:
          the run goes on without it (no `on_error`, and it counts as closed).
        """
        if num_producers < 1 or capacity < num_producers:
            raise ValueError(
                f"{name}: need num_producers >= 1 and capacity >= num_producers, "
                f"got capacity={capacity}, num_producers={num_producers}"
            )
        self.name, self.capacity, self.num_producers = name, capacity, num_producers
        self.timeout_s = timeout_s
        self._share = capacity // num_producers
        self._grant_batch = max(1, self._share // 4)
        self._queued: dict[Channel, int] = {}  # samples in `_queue`, per producer
        self._owed: dict[Channel, int] = {}  # credits taken but not yet returned
        self._on_sample, self._on_error, self._on_lost_peer = on_sample, on_error, on_lost
        # Received samples with their producer; unbounded here because the
        # credits bound it. The counters above and below are guarded by its lock.
        self._queue: Mailbox[tuple[Any, Channel]] = Mailbox(
            name, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._ended: set[Channel] = set()  # closed in order, or lost and let go
        self.received = 0
        # Callback mode: decoded messages wait here for the delivery thread (bounded
        # by the credits, like the queue above).
        self._deliveries: Mailbox[tuple[Any, Channel]] = Mailbox(
            f"{name} deliveries", failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._delivery = None
        if on_sample is not None:
            self._delivery = threading.Thread(
                target=self._deliver, name=f"{name}-deliver", daemon=True
            )
            self._delivery.start()
        self._hub = Hub(
            Endpoint("samples", name, address, authkey, timeout_s, heartbeat_s),
            max_peers=num_producers,
            on_data=self._on_data,
            on_lost=self._on_lost,
            on_end=self._on_end,
            grant=self._share,
        )

    @property
    def address(self) -> tuple[str, int]:
        """The bound `(host, port)` (the real port when bound to port 0)."""
        return self._hub.address

    @property
    def rejected(self) -> list[str]:
        """Connections refused at the handshake (wrong authkey, ...), as `remote: reason`."""
        return self._hub.rejected

    def _on_data(self, channel: Channel, payload: memoryview) -> None:
        """The I/O thread: decode (a malformed message fails the channel), hand on."""
        sample = wire.decode(payload, source=channel.peer)
        if self._on_sample is not None:
            self._deliveries.offer((sample, channel), timeout=0.0)
            return
        with self._queue.locked():
            self.received += 1
            # Refused only once closed or failed, when nobody will take it.
            if self._queue.offer((sample, channel), timeout=0.0):
                self._queued[channel] = self._queued.get(channel, 0) + 1

    def _deliver(self) -> None:
        """The delivery thread (callback mode): `on_sample`, then the credit back."""
        while True:
            try:
                sample, channel = self._deliveries.get(timeout=3600.0, what="samples")
            except TransportTimeout:
                continue
            except TransportError:
                return  # the server was closed
            try:
                self._on_sample(sample, channel.peer.split(" (")[0])
            except Exception as e:  # noqa: BLE001 - reported as that producer's failure
                err = TransportError(f"{self.name}: handling data from {channel.peer}: {e!r}")
                err.__cause__ = e
                channel.fail(err)
                continue
            with self._queue.locked():
                self.received += 1
            channel.grant(1)

    def _on_lost(self, channel: Channel, exc: TransportError) -> None:
        name = channel.peer.split(" (")[0]
        if (
            isinstance(exc, PeerLost)
            and self._on_lost_peer is not None
            and self._on_lost_peer(name, exc)
        ):
            self._on_end(channel)  # the run goes on without it
            return
        self._queue.fail(exc)  # the first lost producer is what `get` raises
        if self._on_error is not None:
            self._on_error(exc)

    def _on_end(self, channel: Channel) -> None:
        with self._queue.locked():
            self._ended.add(channel)
            channels = self._hub.channels
            # Every producer that connected (a restarted one included) has ended.
            if len(channels) >= self.num_producers and all(c in self._ended for c in channels):
                self._queue.close(f"all producers closed ({self._hub.names()})")

    # ------------------------------------------------------------------ consumer
    def get(self, timeout: float) -> Any:
        """Next sample in arrival order.

        Raises:
          PeerLost: a producer was lost (named), even if samples are queued.
          ChannelClosed: every producer closed in order and the queue is empty.
          TransportTimeout: nothing arrived within `timeout` seconds.
        """
        with self._queue.locked():
            sample, channel = self._queue.get(
                timeout=timeout,
                what=lambda: (
                    f"a sample from {len(self._hub.channels)}/{self.num_producers} "
                    f"producers ({self._hub.names()})"
                ),
            )
            give = self._owe(channel)
        if give:
            channel.grant(give)
        return sample

    def _owe(self, channel: Channel) -> int:
        """Credits to return now for one taken sample (under the lock).

        Credits go back in batches of `share // 4` (fewer round trips), and at
        once when the queue holds nothing more of this producer's: a producer
        out of credit then always has something queued for the consumer to
        take, so batching cannot deadlock it.
        """
        self._queued[channel] -= 1
        owed = self._owed.get(channel, 0) + 1
        if owed >= self._grant_batch or self._queued[channel] == 0:
            self._owed[channel] = 0
            return owed
        self._owed[channel] = owed
        return 0

    def close(self, timeout: float = 5.0) -> None:
        """Stops accepting and closes every producer connection in order."""
        self._queue.close("the server was closed")
        self._hub.close(timeout)
        self._deliveries.close("the server was closed")
        if self._delivery is not None:
            self._delivery.join(timeout)

    def __enter__(self) -> SampleServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SampleClient:
    """Generation side: one connection to the `SampleServer`, `send` with credit back-pressure."""

    def __init__(
        self,
        address: Address,
        *,
        authkey: bytes,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        name: str = "generation",
        dial_timeout_s: float | None = None,
    ):
        """Connects (retrying until `dial_timeout_s`, default `timeout_s`, while the
        server starts) and authenticates; `timeout_s` is also the silence after which
        the server is lost."""
        self.name, self.timeout_s = name, timeout_s
        end = Endpoint("samples", name, address, authkey, timeout_s, heartbeat_s, dial_timeout_s)
        self._channel = dial(end)

    @property
    def credits(self) -> int:
        return self._channel.credits

    @property
    def error(self) -> TransportError | None:
        return self._channel.error

    def send(self, sample: Any, timeout: float | None = None) -> None:
        """Sends one message (`wire.encode`: a `Sample` or a report); blocks (up to
        `timeout`, default `timeout_s`) for credit.

        Raises:
          TransportTimeout: the server granted no credit in time (names it).
          PeerLost / ChannelClosed: the server is gone or the channel closed.
        """
        payload = wire.encode(sample)
        self._channel.send(payload, timeout=self.timeout_s if timeout is None else timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Orderly close: the server sees this producer finish, not fail."""
        self._channel.close(timeout)

    def __enter__(self) -> SampleClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
