"""The process's ZeroMQ context and the one I/O thread each socket runs (`IOLoop`).

`peers.py` opens the sockets (`dial`, `Hub`) and speaks the channel protocol;
this module is the plumbing beneath it: one ZeroMQ context per process with its
ZAP handler (a server socket's domain admits only its run's client key,
`keys.py`), and `IOLoop`, the only thread that touches a socket: other threads
`post` messages to it through a queue and a wake-up pipe, and it hands what
arrives, the socket monitor's events and a clock tick to its owner.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable

import zmq
from absl import logging
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from streamrl_jax.distributed import keys

RCV_HWM = 16  # messages a socket buffers per peer before TCP back-pressure
MONITORED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


_lock = threading.Lock()
_context: zmq.Context | None = None
_auth: ThreadAuthenticator | None = None
_allowed: dict[str, bytes] = {}  # ZAP domain → the one client public key it admits


class _Admit:
    """The ZAP handler's credentials check: a domain admits its run's client key only."""

    def callback(self, domain: str, key: bytes) -> bool:
        return _allowed.get(domain) == key


def context(run_key: keys.RunKey | None = None) -> zmq.Context:
    """The process's ZeroMQ context (and ZAP handler); registers `run_key`'s domain."""
    global _context, _auth
    with _lock:
        if _context is None or _context.closed:
            _context = zmq.Context()
            _auth = ThreadAuthenticator(_context)
            _auth.start()
        if run_key is not None and domain(run_key) not in _allowed:
            _allowed[domain(run_key)] = run_key.client_public
            _auth.configure_curve_callback(domain(run_key), _Admit())
        return _context


def domain(run_key: keys.RunKey) -> str:
    return f"streamrl-{run_key.fingerprint}"


# ---------------------------------------------------------------------- the I/O thread
class IOLoop:
    """The one thread that touches a socket: sends what is posted, receives, watches.

    `on_message(frames)`, `on_event(event)` (a parsed monitor event) and
    `on_tick(now)` run on it.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        name: str,
        *,
        on_message: Callable[[list], None],
        on_event: Callable[[dict], None],
        on_tick: Callable[[float], None],
        on_unreachable: Callable[[bytes], None] = lambda rid: None,
        tick_s: float,
    ):
        self._sock = sock
        self._monitor = sock.get_monitor_socket(MONITORED)
        self._on_message, self._on_event, self._on_tick = on_message, on_event, on_tick
        self._on_unreachable = on_unreachable
        self._tick_ms = max(10, int(tick_s * 1000))
        self._out: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._pipe_lock = threading.Lock()  # the wake pipe is written until it is closed
        self._pipe_open = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, frames: list | Callable[[], None], copy: bool = True, rid: bytes | None = None):
        """Queues a message (or a callable to run) for the I/O thread."""
        self._out.append((rid, frames, copy))
        with self._pipe_lock:
            if self._pipe_open:
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
                    os.write(self._wake_w, b"\0")

    def try_send(self, rid: bytes, frames: list) -> bool:
        """I/O thread only: sends at once; False if the peer is gone (`ROUTER_MANDATORY`)."""
        try:
            self._sock.send_multipart([rid, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def stop(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the socket (joins unless called on the thread)."""
        self._stopping = True
        self.post(lambda: None)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in (self._sock, self._monitor, self._wake_r):
            poller.register(s, zmq.POLLIN)
        last_tick = 0.0
        try:
            while True:
                ready = dict(poller.poll(self._tick_ms))
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._flush()
                if self._stopping and not self._out:
                    return
                if self._sock in ready:
                    for _ in range(1024):  # then tick and flush again
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                if self._monitor in ready:
                    while self._monitor.poll(0):
                        self._on_event(parse_monitor_message(self._monitor.recv_multipart()))
                now = time.monotonic()
                if now - last_tick >= self._tick_ms / 1000:
                    last_tick = now
                    self._on_tick(now)
        except Exception as e:  # noqa: BLE001 - a bug here must not hang the peers
            logging.exception("%s: I/O thread failed: %r", self._thread.name, e)
        finally:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close()
            with self._pipe_lock:
                self._pipe_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _flush(self) -> None:
        while self._out:
            rid, frames, copy = self._out.popleft()
            if callable(frames):
                frames()
                continue
            try:
                parts = frames if rid is None else [rid, *frames]
                self._sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                self._out.appendleft((rid, frames, copy))  # a full queue: retry on the next tick
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self._on_unreachable(rid)
