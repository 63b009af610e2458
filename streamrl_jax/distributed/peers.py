"""Opening authenticated connections: `dial` (client side) and `Hub` (server side).

Built on the standard library's `multiprocessing.connection`: its HMAC
challenge-response handshake (`deliver_challenge` / `answer_challenge`, the
code behind `Listener(authkey=...)` / `Client(authkey=...)`: each side proves
it holds the key, the key never crosses the wire) and its `Connection`
framing. The sockets are opened here rather than by `Listener` / `Client`
because those have no timeouts: a client that connects and then says nothing
would block `Listener.accept`, and every later client with it, forever. Here
each handshake runs on its own thread under a deadline.

After authentication each side sends a JSON hello (`{"channel": kind,
"name": name}`); a client that reaches a server of another channel kind (a
sample producer on the weight port) is refused with a message naming both.

Security: the handshake authenticates the peer; the stream itself is neither
encrypted nor signed (use a private network or a tunnel across untrusted
ones). The transports unpickle what an authenticated peer sends; without an
authkey any local user could run code in this process, so a non-loopback
endpoint without one is refused (`check_authkey`), and launchers always set
`STREAMRL_AUTHKEY`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import multiprocessing
import multiprocessing.connection as mpc
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from streamrl_jax.distributed.channel import (
    AuthenticationFailed,
    Channel,
    PeerLost,
    TransportError,
    TransportTimeout,
    default_heartbeat,
    refuse_data,
    shutdown_socket,
)

_HELLO = b"H"
_MAX_HELLO = 1 << 16


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One side of a connection, as `dial` and `Hub` take it."""

    kind: str  # the channel kind ("samples", "weights"); both sides must agree
    name: str  # this side, as its errors and the peer's name it
    address: str | tuple[str, int]  # "host:port", "[v6]:port" or (host, port); a Hub may bind 0
    authkey: bytes | None  # HMAC secret; None is refused off loopback (`check_authkey`)
    timeout_s: float  # handshake deadline, and the silence after which the peer is lost
    heartbeat_s: float | None = None  # None: `default_heartbeat(timeout_s)`

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_s or default_heartbeat(self.timeout_s)


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


def check_authkey(host: str, authkey: bytes | None, what: str) -> None:
    """Refuses a non-loopback endpoint without an authkey (DESIGN: pickle needs auth)."""
    if authkey is not None and not isinstance(authkey, bytes):
        raise TypeError(f"{what}: authkey must be bytes, got {type(authkey).__name__}")
    if authkey is None and not is_loopback(host):
        raise ValueError(
            f"{what}: refusing to use non-loopback host {host!r} without an authkey "
            "(set STREAMRL_AUTHKEY): payloads are unpickled, so an unauthenticated "
            "endpoint would run code sent by anyone who can reach it"
        )


@contextlib.contextmanager
def _deadline(sock: socket.socket, timeout: float):
    """Shuts `sock` down if the block runs past `timeout`: a blocked read/write then fails."""
    fired = threading.Event()

    def fire():
        fired.set()
        shutdown_socket(sock)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def handshake(
    conn: mpc.Connection,
    sock: socket.socket,
    *,
    authkey: bytes | None,
    server: bool,
    hello: dict[str, Any],
    timeout: float,
    peer: str,
) -> dict[str, Any]:
    """Mutual HMAC authentication (if `authkey`), then a JSON hello each way.

    Returns the peer's hello. Raises `AuthenticationFailed`, `TransportTimeout`
    or `PeerLost`, each naming `peer`.
    """
    with _deadline(sock, timeout) as fired:
        try:
            if authkey is not None:
                try:
                    if server:
                        mpc.deliver_challenge(conn, authkey)
                        mpc.answer_challenge(conn, authkey)
                    else:
                        mpc.answer_challenge(conn, authkey)
                        mpc.deliver_challenge(conn, authkey)
                except multiprocessing.AuthenticationError as e:
                    raise AuthenticationFailed(
                        f"authentication with {peer} failed ({e}): different authkeys?"
                    ) from e
                except AssertionError as e:  # answer_challenge got a non-challenge frame
                    raise AuthenticationFailed(
                        f"{peer} does not use an authkey but this side does"
                    ) from e
            conn.send_bytes(_HELLO + json.dumps(hello).encode())
            frame = conn.recv_bytes(_MAX_HELLO)
        except (EOFError, OSError) as e:
            if fired.is_set():
                raise TransportTimeout(f"handshake with {peer} took over {timeout:.1f} s") from e
            raise PeerLost(f"{peer} closed the connection during the handshake ({e!r})") from e
    if frame.startswith(b"#CHALLENGE#"):
        raise AuthenticationFailed(f"{peer} requires an authkey (STREAMRL_AUTHKEY) and none is set")
    if frame[:1] != _HELLO:
        raise AuthenticationFailed(f"{peer}: unexpected first frame {frame[:16]!r} (authkey?)")
    try:
        return json.loads(frame[1:])
    except ValueError as e:
        raise TransportError(f"{peer}: malformed hello {frame[:64]!r}") from e


def connect(
    address: str | tuple[str, int], *, timeout: float
) -> tuple[mpc.Connection, socket.socket]:
    """TCP connect, retrying refusals until `timeout` (the server may still be starting)."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(remaining, 0.01))
            break
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError, OSError) as e:
            if time.monotonic() + 0.05 >= deadline:
                raise TransportTimeout(
                    f"could not connect to {host}:{port} within {timeout:.1f} s ({e!r})"
                ) from e
            time.sleep(0.05)
    return _wrap(sock)


def dial(
    end: Endpoint,
    *,
    on_data: Callable[[Channel, memoryview], None] = refuse_data,
    on_lost: Callable[[Channel, TransportError], None] | None = None,
    on_end: Callable[[Channel], None] | None = None,
    grant: int = 0,
) -> Channel:
    """Client side: connects to `end.address` (retrying refusals until `end.timeout_s`),
    authenticates, checks the server serves `end.kind` channels; returns the started
    `Channel` (with `grant` credits given to the server)."""
    host, port = parse_address(end.address)
    check_authkey(host, end.authkey, end.name)
    conn, sock = connect((host, port), timeout=end.timeout_s)
    try:
        channel = _greet(
            conn,
            sock,
            end,
            server=False,
            remote=f"{host}:{port}",
            callbacks=dict(on_data=on_data, on_lost=on_lost, on_end=on_end),
        )
    except BaseException:
        conn.close()
        sock.close()
        raise
    channel.start()
    if grant:
        channel.grant(grant)
    return channel


def _greet(
    conn: mpc.Connection,
    sock: socket.socket,
    end: Endpoint,
    *,
    server: bool,
    remote: str,
    callbacks: dict[str, Any],
) -> Channel:
    """Either side, once connected to `remote` (host:port): authenticates, exchanges
    hellos, checks both sides speak `end.kind`; returns the `Channel`, not yet started."""
    peer = remote if server else f"{end.kind} server {remote}"
    hello = handshake(
        conn,
        sock,
        authkey=end.authkey,
        server=server,
        hello={"channel": end.kind, "name": end.name},
        timeout=end.timeout_s,
        peer=peer,
    )
    if hello.get("channel") != end.kind:
        raise TransportError(
            f"{end.name}: {peer} speaks {hello.get('channel')!r} channels, this side {end.kind!r}"
        )
    return Channel(
        conn,
        sock,
        local=end.name,
        peer=f"{hello.get('name', '?')} ({remote})",
        heartbeat_s=end.heartbeat,
        timeout_s=end.timeout_s,
        **callbacks,
    )


def _wrap(sock: socket.socket) -> tuple[mpc.Connection, socket.socket]:
    """A `Connection` on the socket plus a second handle for raw I/O and shutdown."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # credits and pings are tiny
    ctl = sock.dup()
    return mpc.Connection(sock.detach()), ctl


class Hub:
    """Server side: accepts up to `max_peers` authenticated clients of one channel kind.

    Each accepted client becomes a started `Channel` with the given callbacks
    (and `grant` initial credits); failed handshakes are logged and listed in
    `rejected`, and never stop the server.
    """

    def __init__(
        self,
        end: Endpoint,
        *,
        max_peers: int,
        on_data: Callable[[Channel, memoryview], None] = refuse_data,
        on_lost: Callable[[Channel, TransportError], None] | None = None,
        on_end: Callable[[Channel], None] | None = None,
        grant: int = 0,
    ):
        host, port = parse_address(end.address)
        check_authkey(host, end.authkey, end.name)
        self.name, self.kind, self.max_peers = end.name, end.kind, max_peers
        self._end, self._grant = end, grant
        self._callbacks = dict(on_data=on_data, on_lost=on_lost, on_end=on_end)
        self._cv = threading.Condition()
        self._channels: list[Channel] = []
        self.rejected: list[str] = []
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=64)
        self._sock.settimeout(0.2)  # the accept loop polls `_closed`
        self.address = (host, self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-accept", daemon=True)
        self._thread.start()

    @property
    def channels(self) -> list[Channel]:
        with self._cv:
            return list(self._channels)

    def _loop(self) -> None:
        while not self._closed:
            try:
                sock, remote = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer = f"{remote[0]}:{remote[1]}"
            threading.Thread(
                target=self._admit, args=(sock, peer), name=f"{self.name}-hs", daemon=True
            ).start()

    def _admit(self, sock: socket.socket, remote: str) -> None:
        conn, ctl = _wrap(sock)
        try:
            channel = _greet(
                conn, ctl, self._end, server=True, remote=remote, callbacks=self._callbacks
            )
            with self._cv:
                if self._closed or len(self._channels) >= self.max_peers:
                    raise TransportError(
                        f"refusing {channel.peer}: "
                        + ("closed" if self._closed else f"already {self.max_peers} peers")
                    )
                self._channels.append(channel)
                self._cv.notify_all()
        except Exception as e:  # noqa: BLE001 - a bad client must not stop the server
            logging.warning("%s: rejected connection from %s: %r", self.name, remote, e)
            self.rejected.append(f"{remote}: {e}")
            shutdown_socket(ctl)
            with contextlib.suppress(OSError):
                conn.close()
                ctl.close()
            return
        channel.start()
        if self._grant:
            channel.grant(self._grant)

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
        return ", ".join(c.peer for c in self.channels) or "none connected"

    def close(self, timeout: float) -> None:
        """Stops accepting and closes every channel in order."""
        with self._cv:
            self._closed = True
            channels = list(self._channels)
        self._thread.join(1.0)
        with contextlib.suppress(OSError):
            self._sock.close()
        for channel in channels:
            channel.close(timeout)
