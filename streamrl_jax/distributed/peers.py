"""Opening authenticated channels on ZeroMQ: `dial` (client side) and `Hub` (server side).

Sockets: a `Hub` binds one ROUTER socket and serves up to `max_peers`
clients of one channel kind; `dial` connects one DEALER socket. Both run
CURVE with the run's keys (`keys.py`): the client must know the server's
public key, and the server admits only clients holding the client secret
(checked by this process's ZAP handler, one thread per process), so nothing
from a process without the run secret ever reaches a channel. Every frame is
encrypted and authenticated by libzmq; a frame over `MAX_FRAME_BYTES` drops
its connection, and one that fails authentication (altered in transit) is
never delivered and stops its connection (libzmq reads nothing more from it:
the peer is then lost by its silence, the error naming the failed frame).
The CURVE handshake runs in libzmq's I/O thread under `HANDSHAKE_IVL` (the endpoint's timeout): an
unauthenticated connection costs a file descriptor for at most that long and
no Python thread.

Each socket has one I/O thread (`sockets.IOLoop`): it alone touches the socket;
other threads `post` messages to it. After CURVE, each side sends a JSON
hello (`{"channel": kind, "name": name}`); a client that reaches a server of
another channel kind, or one already full, gets an `X` refusal naming why.

A peer's connection going away is seen at once: the server maps each peer
to its connection's file descriptor (`zmq.SRCFD`) and probes the peer when
the socket monitor reports that descriptor disconnected (a send to a gone
peer fails: `ROUTER_MANDATORY`); the client fails on its monitor's
disconnect. Silence past the timeout (a stopped process) is the channel's
heartbeat watch (`channel.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from absl import logging

from streamrl_jax.distributed import keys, sockets
from streamrl_jax.distributed.channel import (
    HELLO,
    MAX_FRAME_BYTES,
    PING,
    REFUSE,
    AuthenticationFailed,
    Channel,
    OnData,
    TransportError,
    TransportTimeout,
    default_heartbeat,
    refuse_data,
)

_MAX_HELLO = 1024
_MAX_REFUSED = 1024
_LOST = "connection closed (the process died or closed it, or it dropped a frame that failed "
_LOST += "authentication or was over the size limit)"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One side of a connection, as `dial` and `Hub` take it."""

    kind: str  # the channel kind ("samples", "weights"); both sides must agree
    name: str  # this side, as its errors and the peer's name it
    address: str | tuple[str, int]  # "host:port", "[v6]:port" or (host, port); a Hub may bind 0
    authkey: bytes  # the run secret (`keys.py`); required
    timeout_s: float  # handshake deadline, and the silence after which the peer is lost
    heartbeat_s: float | None = None  # None: `default_heartbeat(timeout_s)`
    dial_timeout_s: float | None = None  # a client's handshake deadline; None: timeout_s

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_s or default_heartbeat(self.timeout_s)

    @property
    def dial_timeout(self) -> float:
        return self.timeout_s if self.dial_timeout_s is None else self.dial_timeout_s

    def run_key(self) -> keys.RunKey:
        if self.authkey is None:
            raise keys.RunKeyError(
                f"{self.name}: no run key: every channel is authenticated; set "
                f"{keys.ENV_AUTHKEY_FILE} or {keys.ENV_AUTHKEY} (the launchers in launch/ "
                "generate one per run)"
            )
        return keys.run_key(self.authkey)


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """`"host:port"`, `"[v6]:port"` or `(host, port)` → `(host, port)`."""
    if isinstance(address, tuple):
        host, port = address
    else:
        host, sep, port_s = address.rpartition(":")
        if not sep or not port_s.isdigit():
            raise ValueError(f"address {address!r} is not host:port")
        host, port = host.strip("[]"), int(port_s)
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r}: port out of range")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` resolves to a loopback address ("" and 0.0.0.0 bind every interface)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host or '*'}:{port}"


def _socket(kind: int, end: Endpoint) -> zmq.Socket:
    sock = sockets.context(end.run_key()).socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)  # the channels' credits bound what is queued
    sock.setsockopt(zmq.RCVHWM, sockets.RCV_HWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(end.timeout_s * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    if ":" in parse_address(end.address)[0]:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def _hello(end: Endpoint) -> list[bytes]:
    return [HELLO, json.dumps({"channel": end.kind, "name": end.name}).encode()]


def _read_hello(frames: list) -> dict[str, str]:
    """The peer's hello, or TransportError: a JSON object of short strings."""
    if len(frames) != 2 or frames[0].bytes != HELLO or len(frames[1].buffer) > _MAX_HELLO:
        raise TransportError("expected a hello")
    try:
        hello = json.loads(frames[1].bytes)
    except ValueError:
        raise TransportError("malformed hello") from None
    if not isinstance(hello, dict) or not all(
        isinstance(hello.get(k), str) and len(hello[k]) <= 256 for k in ("channel", "name")
    ):
        raise TransportError("malformed hello")
    return hello


def _handshake_failure(event: dict) -> str | None:
    ev = event["event"]
    if ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the server refused this process's key (a different run key?)"
    if ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "the CURVE handshake failed (a different run key, or not a streamrl server)"
    return None


# ---------------------------------------------------------------------- client side
def dial(
    end: Endpoint,
    *,
    on_data: OnData = refuse_data,
    on_lost: Callable[[Channel, TransportError], None] | None = None,
    on_end: Callable[[Channel], None] | None = None,
    grant: int = 0,
) -> Channel:
    """Client side: connects to `end.address` (retrying while the server starts, up to
    `end.dial_timeout`), authenticates both ways, checks the server serves `end.kind`
    channels; returns the started `Channel` (with `grant` credits given to the server).

    Raises:
      AuthenticationFailed: the server does not hold this run's key, or refused ours.
      TransportError: the server refused the channel (named reason).
      TransportTimeout: no server answered within `end.dial_timeout`.
    """
    host, port = parse_address(end.address)
    run_key = end.run_key()
    remote = f"{host}:{port}"
    sock = _socket(zmq.DEALER, end)
    sock.curve_serverkey = run_key.server_public
    sock.curve_publickey = run_key.client_public
    sock.curve_secretkey = run_key.client_secret
    result: dict[str, Any] = {}
    ready = threading.Event()

    def on_message(frames: list) -> None:
        channel = result.get("channel")
        if channel is not None:
            channel.deliver(frames)
            return
        if ready.is_set():
            return
        kind = frames[0].bytes
        if kind == REFUSE and len(frames) == 2:
            reason = frames[1].bytes[:_MAX_HELLO].decode(errors="replace")
            result["error"] = TransportError(f"{end.name}: {remote} refused the channel: {reason}")
        else:
            try:
                hello = _read_hello(frames)
            except TransportError as e:
                result["error"] = TransportError(f"{end.name}: {remote}: {e}")
            else:
                if hello["channel"] != end.kind:  # a server of another kind answered
                    result["error"] = TransportError(
                        f"{end.name}: {remote} speaks {hello['channel']!r} channels, "
                        f"this side {end.kind!r}"
                    )
                else:
                    result["channel"] = Channel(
                        local=end.name,
                        peer=f"{hello['name']} ({remote})",
                        heartbeat_s=end.heartbeat,
                        timeout_s=end.timeout_s,
                        post=loop.post,
                        detach=loop.stop,
                        on_data=on_data,
                        on_lost=on_lost,
                        on_end=on_end,
                    )
        ready.set()

    def on_event(event: dict) -> None:
        channel = result.get("channel")
        if event["event"] == zmq.EVENT_DISCONNECTED:
            if channel is not None:
                channel.lost(_LOST)
            return
        failure = _handshake_failure(event)
        if failure and channel is None and not ready.is_set():
            result["error"] = AuthenticationFailed(
                f"{end.name}: {end.kind} server {remote}: {failure}"
            )
            ready.set()

    def on_tick(now: float) -> None:
        if (channel := result.get("channel")) is not None:
            channel.tick(now)

    loop = sockets.IOLoop(
        sock,
        f"{end.name}->{end.kind}",
        on_message=on_message,
        on_event=on_event,
        on_tick=on_tick,
        tick_s=min(end.heartbeat / 2, 0.5),
    )
    sock.connect(_tcp(host, port))
    loop.post(_hello(end))
    loop.start()
    if not ready.wait(end.dial_timeout):
        ready.set()
        loop.stop()
        raise TransportTimeout(
            f"{end.name}: no {end.kind} server answered at {remote} within {end.dial_timeout:.1f} s"
        )
    if "error" in result:
        loop.stop()
        raise result["error"]
    channel: Channel = result["channel"]
    if grant:
        channel.grant(grant)
    return channel


# ---------------------------------------------------------------------- server side
class Hub:
    """Server side: admits up to `max_peers` authenticated clients of one channel kind
    (live ones: a lost peer's place is free for its restarted process).

    Each admitted client becomes a `Channel` with the given callbacks (and
    `grant` initial credits); refused clients are logged and listed in
    `rejected`, and never stop the server.
    """

    def __init__(
        self,
        end: Endpoint,
        *,
        max_peers: int,
        on_data: OnData = refuse_data,
        on_lost: Callable[[Channel, TransportError], None] | None = None,
        on_end: Callable[[Channel], None] | None = None,
        grant: int = 0,
    ):
        host, port = parse_address(end.address)
        run_key = end.run_key()
        self.name, self.kind, self.max_peers = end.name, end.kind, max_peers
        self._end, self._grant = end, grant
        self._callbacks = dict(on_data=on_data, on_lost=on_lost, on_end=on_end)
        self._cv = threading.Condition()
        self._channels: list[Channel] = []
        self._routes: dict[bytes, Channel] = {}
        self._fds: dict[bytes, int] = {}
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.rejected: list[str] = []
        self._closed = False
        self._forged: float | None = None  # when a frame last failed authentication
        sock = _socket(zmq.ROUTER, end)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.curve_server = True
        sock.curve_secretkey = run_key.server_secret
        sock.curve_publickey = run_key.server_public
        sock.zap_domain = sockets.domain(run_key).encode()
        sock.bind(_tcp(host, port or "*"))
        self.address = (host, int(sock.last_endpoint.decode().rsplit(":", 1)[1]))
        self._loop = sockets.IOLoop(
            sock,
            f"{self.name}-{self.kind}",
            on_message=self._on_message,
            on_event=self._on_event,
            on_tick=self._on_tick,
            on_unreachable=self._on_unreachable,
            tick_s=min(end.heartbeat / 2, 0.5),
        )
        self._loop.start()

    @property
    def channels(self) -> list[Channel]:
        with self._cv:
            return list(self._channels)

    # I/O thread ---------------------------------------------------------
    def _on_message(self, frames: list) -> None:
        rid, body = frames[0].bytes, frames[1:]
        channel = self._routes.get(rid)
        if channel is not None:
            channel.deliver(body)
            return
        if not body or rid in self._refused:
            return
        remote = body[0].get("Peer-Address") or "?"
        try:
            hello = _read_hello(body)
            if hello["channel"] != self.kind:
                raise TransportError(
                    f"{self.name} serves {self.kind!r} channels, not {hello['channel']!r}"
                )
            # A lost peer's place is free again: a restarted process rejoins under its
            # name; a second live peer of the same name is refused.
            live = [c for c in self._channels if c.error is None]
            if self._closed or len(live) >= self.max_peers:
                raise TransportError(
                    f"{self.name}: "
                    + ("closed" if self._closed else f"already {self.max_peers} peers")
                )
            if any(c.peer.split(" (")[0] == hello["name"] for c in live):
                raise TransportError(f"{self.name}: {hello['name']} is already connected")
        except TransportError as e:
            self._refuse(rid, f"{remote}", str(e))
            return
        channel = Channel(
            local=self.name,
            peer=f"{hello['name']} ({remote})",
            heartbeat_s=self._end.heartbeat,
            timeout_s=self._end.timeout_s,
            post=lambda frames, copy, rid=rid: self._loop.post(frames, copy, rid),
            detach=lambda: None,
            **self._callbacks,
        )
        self._routes[rid] = channel
        self._fds[rid] = body[0].get(zmq.SRCFD)
        self._loop.post(_hello(self._end), True, rid)
        if self._grant:
            channel.grant(self._grant)
        with self._cv:
            self._channels.append(channel)
            self._cv.notify_all()

    def _refuse(self, rid: bytes, remote: str, reason: str) -> None:
        logging.warning("%s: refused %s: %s", self.name, remote, reason)
        self.rejected.append(f"{remote}: {reason}")
        self._refused[rid] = None
        while len(self._refused) > _MAX_REFUSED:
            self._refused.popitem(last=False)
        self._loop.post([REFUSE, reason.encode()[:_MAX_HELLO]], True, rid)

    def _on_event(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            # Probe the peers on that descriptor: a send to a gone peer fails at once.
            for rid, fd in list(self._fds.items()):
                if fd == event["value"] and not self._loop.try_send(rid, [PING]):
                    self._on_unreachable(rid)
            return
        failure = _handshake_failure(event)
        if failure:
            if self._routes and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                self._forged = time.monotonic()  # maybe a peer's frame, altered in transit
            text = "a connection failed authentication: it does not hold this run's key"
            logging.warning("%s: %s", self.name, text)
            self.rejected.append(text)

    def _on_unreachable(self, rid: bytes) -> None:
        self._fds.pop(rid, None)
        if (channel := self._routes.get(rid)) is not None:
            channel.lost(_LOST)

    def _on_tick(self, now: float) -> None:
        note = ""
        if self._forged is not None:
            note = (
                f" (a frame failed authentication {now - self._forged:.1f} s ago: altered in "
                "transit?)"
            )
        for channel in self._routes.values():
            channel.tick(now, note)

    # any thread ---------------------------------------------------------
    def wait_for_peers(self, timeout: float) -> list[str]:
        """Blocks until `max_peers` clients have connected; returns their names."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._channels) >= self.max_peers, timeout):
                raise TransportTimeout(
                    f"{self.name} at {self.address[0]}:{self.address[1]}: "
                    f"{len(self._channels)}/{self.max_peers} {self.kind} peers connected within "
                    f"{timeout:.1f} s ({self.names()}; rejected: {self.rejected or 'none'})"
                )
            return [c.peer for c in self._channels]

    def names(self) -> str:
        return ", ".join(c.peer for c in self._channels) or "none connected"

    def close(self, timeout: float) -> None:
        """Stops admitting, closes every channel in order, then the socket."""
        with self._cv:
            self._closed = True
            channels = list(self._channels)
        for channel in channels:
            channel.close(timeout)
        self._loop.stop()
