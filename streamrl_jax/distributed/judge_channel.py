"""The judge's channel: training processes ask the scoring processes for verdicts.

A program with scoring processes (`STREAMRL_SCORING_PROCESSES`, `roles.py`) holds the
run's judge there (`pipeline/processes/scoring.py`), on devices of their own, instead of
in every training process. Each scoring process serves a `JudgeServer`, a `peers.Hub`
of channel kind "judge" with the training processes as its peers, and publishes its
address under `judge/<k>` (k: its index among the scoring processes) as `host:port
nonce`, a fresh nonce each start, so a restarted process is told from the one it
replaces. A training process's `RemoteJudge` is the judge its scoring stage calls
(`pipeline/scoring.py`: `batch`, `__call__(items) -> verdicts`), so the stage keeps
its queue, order, back-pressure and masks whichever process computes the verdicts.

Messages are msgspec `Struct`s, their own schema (`messages.WireStruct`: unknown
fields refused, every string and list bounded): `Forward(id, items)` asks for the
verdicts of up to `MAX_ITEMS` samples (question, response, reference answer), and
`Verdicts(id, verdicts)` answers with one verdict per item, in order. A reply whose id
was not asked for, or whose count differs, fails the channel, naming the peer.

Back-pressure: the server grants each peer `IN_FLIGHT` forwards and one more per reply;
the client grants the server as many replies. The server judges forwards one at a
time in arrival order (its judge's devices are one mesh); a judge that raises answers
every item with a failure naming the error (the stage masks them, counted), never a
missing reply.

Failure: a call returns the verdicts or raises within `timeout_s` (the stage then masks
the forward's samples). A scoring process lost mid-call (`PeerLost`: killed, or silent
past the channel's timeout) leaves its forward to another live scoring process, or to
its restarted process once that publishes a new address; the judge is deterministic,
so the forward sent again gets the verdicts the lost one would have sent.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Annotated

import msgspec
from absl import logging

from streamrl_jax.distributed import roles
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.messages import WireStruct
from streamrl_jax.distributed.peers import Endpoint, Hub, dial
from streamrl_jax.rewards.judge import Item, Verdict

KEY = "judge"  # judge/<k>: scoring process k's "host:port nonce"
IN_FLIGHT = 4  # forwards a peer may have unanswered (and replies the server may owe)
MAX_ITEMS = 1024  # samples in one forward
MAX_TEXT = 1 << 20  # characters of a question, response, answer or written verdict

_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Id = Annotated[int, msgspec.Meta(ge=0)]


class _Item(WireStruct, array_like=True):
    question: _Text
    response: _Text
    answer: _Text


class Forward(WireStruct, tag="forward"):
    """A training process asks for the verdicts of `items` (answered under `id`)."""

    id: _Id
    items: Annotated[tuple[_Item, ...], msgspec.Meta(max_length=MAX_ITEMS)]


_Unit = Annotated[float, msgspec.Meta(ge=-1e-6, le=1.0 + 1e-6)]  # a probability (rounded)


class _Verdict(WireStruct, array_like=True):
    score: _Unit | None
    mass: float  # a probability, or NaN (a parsed verdict's: `rewards.judge.Verdict`)
    failure: _Text | None
    text: _Text | None


class Verdicts(WireStruct, tag="verdicts"):
    """The scoring process's answer to forward `id`: one verdict per item, in order."""

    id: _Id
    verdicts: Annotated[tuple[_Verdict, ...], msgspec.Meta(max_length=MAX_ITEMS)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODE_FORWARD = msgspec.msgpack.Decoder(Forward)
_DECODE_VERDICTS = msgspec.msgpack.Decoder(Verdicts)


def _decode(decoder: msgspec.msgpack.Decoder, payload: memoryview, source: str):
    try:
        return decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise TransportError(f"judge channel: a malformed message from {source}: {e}") from e


def publish_address(k: int, address: tuple[str, int], board: roles.Board) -> str:
    """Publishes scoring process k's server address (a fresh nonce: this start's)."""
    value = f"{address[0]}:{address[1]} {secrets.token_hex(8)}"
    board.publish(f"{KEY}/{k}", value, overwrite=True)
    return value


class JudgeServer:
    """A scoring process's side: forwards from up to `peers` training processes, judged
    one at a time in arrival order by `judge` (module docstring)."""

    def __init__(
        self,
        judge: Callable[[Sequence[Item]], list[Verdict]],
        address: str | tuple[str, int],
        *,
        authkey: bytes,
        peers: int,
        timeout_s: float,
        name: str,
        on_lost: Callable[[str, TransportError], None],
    ):
        """`timeout_s`: the silence after which a peer is lost, and the longest a reply
        waits for the peer's credit; `on_lost(peer, error)`: a training process lost."""
        self.judge, self.name, self.timeout_s = judge, name, timeout_s
        self._on_lost_peer = on_lost
        self._work: queue.Queue[tuple[Channel, Forward] | None] = queue.Queue()
        self.forwards = self.items = 0
        self._ended: set[str] = set()
        self._thread = threading.Thread(target=self._serve, name="judge-server", daemon=True)
        self._thread.start()
        self._hub = Hub(
            Endpoint(KEY, name, address, authkey, timeout_s),
            max_peers=peers,
            on_data=self._on_data,
            on_lost=self._on_lost,
            on_end=self._on_end,
            grant=IN_FLIGHT,
        )
        self.address = self._hub.address

    def _on_data(self, channel: Channel, payload: memoryview) -> None:
        """The I/O thread: decode (a malformed forward fails the channel), queue."""
        self._work.put((channel, _decode(_DECODE_FORWARD, payload, channel.peer)))

    def _on_lost(self, channel: Channel, exc: TransportError) -> None:
        self._on_lost_peer(channel.peer.split(" (")[0], exc)

    def _on_end(self, channel: Channel) -> None:
        self._ended.add(channel.peer.split(" (")[0])

    @property
    def connected(self) -> int:
        """Training processes that connected so far (a restarted one counted again)."""
        return len(self._hub.channels)

    @property
    def ended(self) -> set[str]:
        """The peers that closed their channel in order."""
        return set(self._ended)

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            channel, forward = work
            items = [Item(i.question, i.response, i.answer) for i in forward.items]
            try:
                verdicts = self.judge(items)
                if len(verdicts) != len(items):
                    raise ValueError(f"{len(verdicts)} verdicts for {len(items)} samples")
            except Exception as e:  # noqa: BLE001 - each item's failure, masked there
                logging.warning("%s: the judge raised on %d samples: %r", self.name, len(items), e)
                verdicts = [Verdict(None, 0.0, f"error: {self.name}: {e!r}")] * len(items)
            reply = Verdicts(
                forward.id,
                tuple(_Verdict(v.score, v.mass, v.failure, v.text) for v in verdicts),
            )
            self.forwards, self.items = self.forwards + 1, self.items + len(items)
            try:
                channel.send(_ENCODER.encode(reply), timeout=self.timeout_s)
                channel.grant(1)
            except TransportError as e:  # that peer is gone: its on_lost says so
                logging.warning("%s: no reply to %s: %s", self.name, channel.peer, e)

    def close(self, timeout: float) -> None:
        self._work.put(None)
        self._thread.join(timeout)
        self._hub.close(timeout)


class _Link:
    """One scoring process as a training process reaches it: its channel (None while
    none is open), the address it was opened to, and the calls waiting for replies."""

    def __init__(self, k: int):
        self.k = k
        self.channel: Channel | None = None
        self.address: str | None = None  # the published value the channel was opened to
        self.waiting: dict[int, Future[list[Verdict]]] = {}
        self.late: set[int] = set()  # forwards given up on: their replies are dropped
        self.dialing = threading.Lock()


class RemoteJudge:
    """A training process's judge when scoring processes hold it (module docstring), or
    generation processes as their service's tenant (`pipeline/tenant.py`):
    `batch` and `__call__(items) -> verdicts` as `rewards.judge.Judge`; as many calls at
    once as there are scoring processes (`parallel`: the scoring stage's threads), each
    to its own in turn."""

    def __init__(
        self,
        scoring: int,
        batch: int,
        *,
        authkey: bytes,
        name: str,
        timeout_s: float,
        peer_timeout_s: float,
        board: roles.Board = roles.PROGRAM,
        serving: str = "scoring process",
    ):
        """`scoring`: the program's scoring processes; `batch`: samples per forward
        (`judge.batch`); `timeout_s`: the longest one call takes, a lost scoring
        process's restart included (`judge.timeout_s`); `peer_timeout_s`: the silence
        after which a scoring process is lost (`STREAMRL_PEER_TIMEOUT_S`); `serving`:
        what the servers are, in messages ("generation process" where the judge is the
        generation service's tenant: `pipeline/tenant.py`)."""
        self.batch, self.name, self.board, self.serving = batch, name, board, serving
        self.timeout_s, self.peer_timeout_s, self.authkey = timeout_s, peer_timeout_s, authkey
        self._links = [_Link(k) for k in range(scoring)]
        self.parallel = scoring
        self._ids = itertools.count()
        self._next = 0  # round robin over the scoring processes
        self._lock = threading.Lock()  # the links' channels, waiting calls and counters
        self.resent = 0  # forwards sent again after their scoring process was lost

    def connect(self, timeout: float) -> None:
        """Opens a channel to every scoring process (each publishes its address once its
        judge is loaded), waiting up to `timeout`.

        Raises:
          TimeoutError: a scoring process did not publish its address in time (named).
        """
        deadline = time.monotonic() + timeout
        for link in self._links:
            while not self._open(link, deadline):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name}: {self.serving} {link.k} did not serve its judge "
                        f"within {timeout:.0f} s (no {KEY}/{link.k} address)"
                    )

    def _open(self, link: _Link, deadline: float, wait: bool = True) -> bool:
        """Dials scoring process `link.k` if it published an address this side has not
        lost (`wait`: up to a second for one; else only one there already); True once
        the link has a channel."""
        with link.dialing:  # one caller dials a link at a time
            return self._dial(link, deadline, wait)

    def _dial(self, link: _Link, deadline: float, wait: bool) -> bool:
        if _up(link.channel):
            return True
        key = f"{KEY}/{link.k}"
        if wait:
            try:
                value = self.board.lookup(key, min(1.0, max(deadline - time.monotonic(), 0.01)))
            except TimeoutError:
                return False
        elif (value := self.board.try_lookup(key)) is None:
            return False
        if value == link.address:  # the lost process's own address: wait for its restart
            if wait:
                time.sleep(0.1)
            return False
        address = value.split(" ", 1)[0]
        end = Endpoint(
            KEY,
            self.name,
            address,
            self.authkey,
            self.peer_timeout_s,
            dial_timeout_s=max(1.0, min(10.0, deadline - time.monotonic())),
        )
        try:
            channel = dial(
                end,
                on_data=self._on_data,
                on_lost=self._on_lost,
                on_end=self._on_end,
                grant=IN_FLIGHT,
            )
        except TransportError as e:
            logging.warning("%s: %s %d at %s: %s", self.name, self.serving, link.k, address, e)
            link.address = value  # gone already: wait for a newer address
            return False
        with self._lock:
            link.channel, link.address = channel, value
            link.late.clear()
        logging.info("%s: judge of %s %d at %s", self.name, self.serving, link.k, address)
        return True

    # ------------------------------------------------------------------ I/O thread
    def _on_data(self, channel: Channel, payload: memoryview) -> None:
        reply = _decode(_DECODE_VERDICTS, payload, channel.peer)
        with self._lock:
            link = next((x for x in self._links if x.channel is channel), None)
            future = None if link is None else link.waiting.pop(reply.id, None)
            late = link is not None and future is None and reply.id in link.late
            if late:
                link.late.discard(reply.id)
        if late:  # the caller gave up on it (its samples were masked): dropped
            channel.grant(1)
            return
        if future is None:
            raise TransportError(
                f"{self.name}: {channel.peer} answered forward {reply.id}, never asked"
            )
        channel.grant(1)
        future.set_result([Verdict(v.score, v.mass, v.failure, v.text) for v in reply.verdicts])

    def _on_lost(self, channel: Channel, exc: TransportError) -> None:
        logging.warning("%s: lost a %s: %s", self.name, self.serving, exc)
        self._fail_waiting(channel, exc)

    def _on_end(self, channel: Channel) -> None:
        self._fail_waiting(channel, ChannelClosed(f"{self.name}: {channel.peer} closed"))

    def _fail_waiting(self, channel: Channel, exc: TransportError) -> None:
        with self._lock:
            for link in self._links:
                if link.channel is channel:
                    for future in link.waiting.values():
                        future.set_exception(exc)
                    link.waiting.clear()

    # ------------------------------------------------------------------ the judge
    def __call__(self, items: Sequence[Item]) -> list[Verdict]:
        """The verdicts of `items`, in order, from one scoring process (round robin; a
        lost one's forward goes to another or to its restart).

        Raises:
          TimeoutError: no scoring process answered within `timeout_s`.
          TransportError: a malformed reply (the channel fails, naming the peer).
        """
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            fid, start = next(self._ids), self._next
            self._next = (self._next + 1) % len(self._links)
        forward = _ENCODER.encode(
            Forward(fid, tuple(_Item(i.question, i.response, i.answer) for i in items))
        )
        sent = 0
        for attempt in itertools.count():
            link = self._links[(start + attempt) % len(self._links)]
            # The first pass takes a link that is up or has a new address, past a down one
            # at once; after it, each link gets a wait (one starting, or restarting).
            if not self._open(link, deadline, wait=attempt >= len(self._links)):
                if time.monotonic() > deadline:
                    break
                continue
            if sent:
                with self._lock:
                    self.resent += 1
            sent += 1
            try:
                return self._ask(link, fid, forward, deadline)
            except (PeerLost, ChannelClosed) as e:
                logging.warning(
                    "%s: %s %d lost with a forward of %d samples unanswered; sending it again (%s)",
                    self.name,
                    self.serving,
                    link.k,
                    len(items),
                    e,
                )
            except TransportTimeout:
                break
        raise TimeoutError(
            f"{self.name}: no {self.serving} answered a forward of {len(items)} samples "
            f"within judge.timeout_s={self.timeout_s:g} s ({sent} sent)"
        )

    def _ask(self, link: _Link, fid: int, forward: bytes, deadline: float) -> list[Verdict]:
        """Sends `forward` (id `fid`) to `link`'s scoring process; its verdicts."""
        future: Future[list[Verdict]] = Future()
        with self._lock:
            channel = link.channel
            if channel is None or not _up(channel):
                raise PeerLost(f"{self.name}: {self.serving} {link.k} is down")
            link.waiting[fid] = future
        try:
            channel.send(forward, timeout=max(deadline - time.monotonic(), 0.01))
            return future.result(timeout=max(deadline - time.monotonic(), 0.01))
        except TimeoutError as e:
            with self._lock:
                if link.waiting.pop(fid, None) is not None:  # its reply may still come
                    link.late.add(fid)
            raise TransportTimeout(f"{self.name}: {self.serving} {link.k}: no reply") from e
        finally:
            with self._lock:
                link.waiting.pop(fid, None)

    def close(self, timeout: float) -> None:
        """Closes every channel in order (the scoring processes see this side end)."""
        for link in self._links:
            if _up(link.channel):
                link.channel.close(timeout)


def _up(channel: Channel | None) -> bool:
    """Whether `channel` is open: neither failed nor closed."""
    return channel is not None and channel.error is None and not channel.ended
