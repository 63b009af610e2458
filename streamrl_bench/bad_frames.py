"""Network cases of the bad-input corpus: hostile or broken peers of the cross-process channels.

Each case starts a real `SampleServer` (or a weight `ShardReceiver`)
on loopback in this process, drives a peer (an outsider without the run key,
or a buggy process holding it), and reports the named error it got. The
runner then closes everything and checks that nothing leaked: the thread
count and the open file descriptors are back where they started, and no
file was written by a payload that would have run on unpickling.

Used by `tools/bench_bad_inputs.py` (kind "network") and by
`tests/distributed_transport_test.py` and `tests/shard_sync_test.py` (the peers, the
proxy, the payload that proves nothing was unpickled).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import pickle
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

KEY = b"bad-frames-run-key-0123456789"


class Evil:
    """Unpickling this creates `path`: proof, when the file is absent, that nothing ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def raw_peer(address, *, key=KEY, name="rogue", kind="samples"):
    """A hand-driven ZeroMQ peer holding the run key (a buggy or hostile authenticated
    process): says hello, then sends whatever the caller wants."""
    import zmq

    from streamrl_jax.distributed import keys, sockets

    k = keys.run_key(key)
    sock = sockets.context().socket(zmq.DEALER)
    sock.curve_serverkey = k.server_public
    sock.curve_publickey, sock.curve_secretkey = k.client_public, k.client_secret
    sock.linger = 0
    sock.connect(f"tcp://{address[0]}:{address[1]}")
    sock.send_multipart([b"H", json.dumps({"channel": kind, "name": name}).encode()])
    if not sock.poll(10_000):
        sock.close()
        raise TimeoutError("no hello back")
    reply = sock.recv_multipart()
    if reply[0] != b"H":
        sock.close()
        raise ConnectionRefusedError(reply[-1].decode(errors="replace"))
    return sock


class TamperingProxy:
    """Relays one TCP connection and flips one byte of the client's stream at `offset`."""

    def __init__(self, target, offset: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.target, self.offset, self.flipped = target, offset, False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
            self._pump(client, server, True)

    def _pump(self, src, dst, tamper):
        seen = 0
        try:
            while data := src.recv(65536):
                if tamper and not self.flipped and seen + len(data) > self.offset:
                    data = bytearray(data)
                    data[self.offset - seen] ^= 0x40
                    self.flipped = True
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self):
        for sock in [self.listener, *self._socks]:
            with contextlib.suppress(OSError):
                sock.close()


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def note(text: str):
    from streamrl_jax.distributed.messages import SpanReport

    return SpanReport(track="test", name=text, t0=0.0, t1=0.0, args={})


def sample(**changes):
    from streamrl_jax.generation.types import RequestTag, Sample, Timings

    fields = dict(
        request_id="train/0/0/0",
        prompt=np.arange(1, 9, dtype=np.int32),
        response=np.arange(1, 5, dtype=np.int32),
        logprobs=np.zeros(4, np.float32),
        sampling_logprobs=np.zeros(4, np.float32),
        finish_reason="stop",
        policy_version=0,
        last_policy_version=0,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
        tag=RequestTag(batch=0, prompt_id="task/1/0"),
    )
    return Sample(**{**fields, **changes})


# ---------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class NetCase:
    name: str
    expect: str  # text the named error must contain
    drive: Callable[[str], str]  # (scratch dir) -> the error text it got


def _server(**kw):
    from streamrl_jax.distributed.transport import SampleServer

    errors: list[BaseException] = []
    kw = {"capacity": 2, "timeout_s": 10.0, **kw}
    server = SampleServer("127.0.0.1:0", authkey=KEY, on_error=errors.append, **kw)
    return server, errors


def _authenticated(frames: list[list[bytes]]) -> Callable[[str], str]:
    """An authenticated peer sends `frames` (each a message); the channel's failure."""

    def drive(root: str) -> str:
        server, errors = _server()
        try:
            rogue = raw_peer(server.address)
            try:
                for message in frames:
                    rogue.send_multipart(message)
                wait_for(lambda: errors)
            finally:
                rogue.close()
            return f"{type(errors[0]).__name__}: {errors[0]}" if errors else "no error"
        finally:
            server.close(1.0)

    return drive


# An outsider is another process with its own ZeroMQ context: it learnt the server's
# address (and, for "curve", its public key) but holds no client key of the run. Run in
# a child so that the outsider's own libzmq (whose handshake fails under it mid-send)
# shares nothing with the server under test.
_OUTSIDER = """
import sys, zmq
host, port, how, server_public = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
payload = sys.stdin.buffer.read()
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.linger = 0
sock.sndtimeo = 1000
if how == "curve":
    sock.curve_serverkey = bytes.fromhex(server_public)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
sock.connect(f"tcp://{host}:{port}")
try:
    sock.send_multipart([b"H", b'{"channel": "samples", "name": "x"}'])
    sock.send_multipart([b"D", payload])
except zmq.Again:
    pass
print("answered" if sock.poll(float(sys.argv[5]) * 1000) else "silent", flush=True)
sock.close()
ctx.term()
"""


def outsider(address, how: str, payload: bytes, listen_s: float = 3.0) -> str:
    """A ZeroMQ outsider process ("null": no CURVE; "curve": CURVE with the server's
    public key and a key pair of its own) says hello and sends `payload` as data, then
    listens `listen_s` for any answer: "answered", "silent", or how the process ended."""
    from streamrl_jax.distributed import keys

    host, port = address
    argv = [host, str(port), how, keys.run_key(KEY).server_public.hex(), str(listen_s)]
    try:
        run = subprocess.run(
            [sys.executable, "-c", _OUTSIDER, *argv],
            input=payload,
            capture_output=True,
            timeout=30 + listen_s,
        )
    except subprocess.TimeoutExpired:
        return "the outsider's process did not end within 30 s"
    said = run.stdout.decode(errors="replace").strip()
    if run.returncode != 0 or said not in ("answered", "silent"):
        tail = run.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return f"the outsider's process ended with status {run.returncode}: {tail}"
    return said


def _outsider(how: str) -> Callable[[str], str]:
    """A local process without the run key tries to deliver a pickle that writes a file."""

    def drive(root: str) -> str:
        payload = pickle.dumps(Evil(os.path.join(root, "pwned")))
        server, _ = _server(timeout_s=3.0)
        try:
            host, port = server.address
            if how == "tcp":  # the old framing; not a ZeroMQ greeting: dropped unanswered
                with socket.create_connection((host, port), timeout=5.0) as raw:
                    raw.sendall(struct.pack("!i", len(payload)) + payload)
                    try:
                        reply = b""
                        while chunk := raw.recv(4096):
                            reply += chunk
                    except ConnectionResetError:
                        return "the server closed the connection (reset), unanswered"
                    except OSError as e:
                        return f"no close: {e!r}"
                return f"the server closed the connection after {len(reply)} bytes of greeting"
            said = outsider(server.address, how, payload, listen_s=0.5)
            if said != "silent":
                return f"the outsider: {said}"
            wait_for(lambda: server.rejected, 5.0)
            return "; ".join(server.rejected) or "not rejected"
        finally:
            server.close(1.0)

    return drive


def _client(secret: bytes) -> Callable[[str], str]:
    def drive(root: str) -> str:
        from streamrl_jax.distributed.transport import SampleClient

        server, _ = _server(timeout_s=3.0)
        try:
            SampleClient(server.address, authkey=secret, timeout_s=3.0).close(1.0)
            return "connected"
        except Exception as e:  # noqa: BLE001 - the named error is the outcome
            return f"{type(e).__name__}: {e}"
        finally:
            server.close(1.0)

    return drive


def _tampered(root: str) -> str:
    from streamrl_jax.distributed.channel import TransportError
    from streamrl_jax.distributed.transport import SampleClient

    server, _ = _server(timeout_s=2.0, heartbeat_s=0.25, capacity=16)
    proxy = TamperingProxy(server.address, offset=3000)  # past the CURVE handshake
    client = SampleClient(proxy.address, authkey=KEY, timeout_s=2.0, heartbeat_s=0.25)
    try:
        with contextlib.suppress(TransportError):
            for i in range(12):
                client.send(sample(request_id=i), timeout=3.0)
        try:
            while True:
                got = server.get(timeout=8.0)
                if got.request_id not in range(12):
                    return "an altered sample was delivered"
        except TransportError as e:
            return f"{type(e).__name__}: {e}"
    finally:
        client.close(1.0)
        server.close(1.0)
        proxy.close()


def _weights(header: Callable[[], bytes]):
    """A weight sender holding the key sends `header()` to a `ShardReceiver` that needs a
    float32[4, 2]; the receiver's named refusal."""

    def drive(root: str) -> str:
        import jax

        from streamrl_jax.distributed import reshard, shard_receiver, shard_wire

        hub_server = _weights_server()
        try:
            leaf = reshard.LeafLayout("['embed']", (4, 2), "float32", 4)
            need = shard_wire.Need(0, (leaf,), ((((0, 4), (0, 2)),),))
            receiver = shard_receiver.ShardReceiver(
                [hub_server.address], need, authkey=KEY, timeout_s=5.0
            )
            try:
                channel = hub_server.channels[0]
                channel.send(header(), timeout=5.0)
                device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                try:
                    receiver.receive({"embed": device}, timeout=8.0)
                    return "placed"
                except Exception as e:  # noqa: BLE001 - the named error is the outcome
                    return f"{type(e).__name__}: {e}"
            finally:
                receiver.close(1.0)
        finally:
            hub_server.close(1.0)

    return drive


def _weights_server():
    """A training side that takes the receiver's need and sends what a case says."""
    from streamrl_jax.distributed.peers import Endpoint, Hub

    return Hub(
        Endpoint("weights", "trainer", "127.0.0.1:0", KEY, 5.0),
        max_peers=1,
        on_data=lambda channel, payload: None,
        grant=1,  # room for the need
    )


def _huge_piece() -> bytes:
    from streamrl_jax.distributed import shard_wire

    piece = shard_wire.PieceSpec(0, 0, ((0, 2**17), (0, 2**17)), None)  # 64 GiB of float32
    return shard_wire.ENCODER.encode(shard_wire.ShardsHeader(1, 0, (piece,)))


def _key_file(root: str) -> str:
    from streamrl_jax.distributed import keys

    path = os.path.join(root, "run.key")
    with open(path, "w") as f:
        f.write("k" * 64)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        keys.secret_from_env({keys.ENV_AUTHKEY_FILE: path})
        return "accepted"
    except Exception as e:  # noqa: BLE001 - the named error is the outcome
        return f"{type(e).__name__}: {e}"


def _problem(**changes) -> Callable[[str], str]:
    """The training process's check of a wire sample against its own problems."""

    def drive(root: str) -> str:
        import types

        from streamrl_jax.pipeline.processes.training import ProblemTable
        from streamrl_jax.rewards.tasks import Problem

        problem = Problem(
            prompt_id="task/1/0", task="t", question="q", answer="a", metadata={"task": "t"}
        )
        components = types.SimpleNamespace(
            prompts=types.SimpleNamespace(dataset=[problem]),
            eval_prompts=[],
            model_cfg=types.SimpleNamespace(vocab_size=100),
        )
        cfg = types.SimpleNamespace(
            generation=types.SimpleNamespace(max_prompt_len=16, max_new_tokens=8),
            environment=types.SimpleNamespace(name=""),  # single-turn samples
        )
        try:
            ProblemTable(components, cfg).attach(sample(**changes), "generation-0 (127.0.0.1)")
            return "accepted"
        except Exception as e:  # noqa: BLE001 - the named error is the outcome
            return f"{type(e).__name__}: {e}"

    return drive


def _sample_bytes(**changes) -> bytes:
    from streamrl_jax.distributed import wire

    return wire.encode(sample(**changes))


def _edited(**fields) -> bytes:
    """A wire sample with raw msgpack fields replaced (what the encoder would refuse)."""
    import msgspec

    from streamrl_jax.distributed import wire

    obj = msgspec.msgpack.decode(wire.encode(sample()))
    return msgspec.msgpack.encode({**obj, **fields})


def cases() -> list[NetCase]:
    """The network cases (built when called: they import the package)."""
    from streamrl_jax.distributed.channel import MAX_FRAME_BYTES

    credit = struct.pack("!iq", -5, -1)
    return [
        NetCase("net: raw TCP pickle", "closed the connection", _outsider("tcp")),
        NetCase("net: ZeroMQ without CURVE", "does not hold this run's key", _outsider("null")),
        NetCase("net: CURVE, not the client key", "does not hold this run's key",
                _outsider("curve")),
        NetCase("net: another run's key", "AuthenticationFailed",
                _client(b"another-run-key-0123456789")),
        NetCase("net: no key", "RunKeyError: .*no run key", _client(None)),
        NetCase("net: short key", "at least 16 are needed", _client(b"short")),
        NetCase("net: key file others can read", "accessible to other users", _key_file),
        NetCase("net: pickle from a key holder", "WireError: malformed message from rogue",
                _authenticated([[b"D", pickle.dumps(Evil("/tmp/pwned-by-bad-frames"))]])),
        NetCase("net: negative credits", "malformed credit frame",
                _authenticated([[b"C", credit]])),
        NetCase("net: short credit frame", "malformed credit frame",
                _authenticated([[b"C", b"\x01"]])),
        NetCase("net: unknown kind", "bad message kind", _authenticated([[b"Q", b"x"]])),
        NetCase("net: extra frames", "malformed message from rogue",
                _authenticated([[b"D", b"a", b"b"]])),
        NetCase("net: raw bytes unasked", "bulk bytes nobody asked for",
                _authenticated([[b"R", b"xx"]])),
        NetCase("net: frame over 16 MiB", "PeerLost: .*connection closed",
                _authenticated([[b"D", b"x" * (MAX_FRAME_BYTES + 1)]])),
        NetCase("net: data without credit", "sent data without credit",
                _authenticated([[b"D", _sample_bytes()]] * 3)),
        NetCase("net: array bytes not whole", "WireError: .*response",
                _authenticated([[b"D", _edited(response=b"\x01" * 15)]])),
        NetCase("net: request id a list", "WireError: .*request_id",
                _authenticated([[b"D", _edited(request_id=[1, 2, 3])]])),
        NetCase("net: tampered frame", "a frame failed authentication", _tampered),
        NetCase("net: weight piece of 64 GiB outside the need", "outside box",
                _weights(_huge_piece)),
        NetCase("net: weight header not the schema", "malformed weight shards",
                _weights(lambda: b"\x92\x01\x02")),
        NetCase("net: sample of an unknown prompt", "which is in neither dataset",
                _problem(tag=sample().tag.__class__(batch=0, prompt_id="other/9/9"))),
        NetCase("net: token id outside the vocabulary", r"token ids outside \[0, 100\)",
                _problem(response=np.array([1, 2, 300], np.int32),
                         logprobs=np.zeros(3, np.float32),
                         sampling_logprobs=np.zeros(3, np.float32))),
        NetCase("net: prompt over max_prompt_len", r"17-token prompt \(max 16\)",
                _problem(prompt=np.ones(17, np.int32))),
        NetCase("net: an episode in a run without an environment",
                "is an episode, but this run has no environment",
                _problem(metadata={"episode": {"return": 1.0}})),
    ]  # fmt: skip


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _warm() -> None:
    """What lives for the whole process (ZeroMQ's context and ZAP handler, JAX's
    backend) is started before a case counts threads and descriptors."""
    import jax

    from streamrl_jax.distributed import sockets

    sockets.context()
    jax.devices()


def run(case: NetCase) -> tuple[str, str]:
    """(outcome, detail): "clear" when the named error came and nothing leaked."""
    import re

    _warm()
    threads, fds = threading.active_count(), _open_fds()
    root = tempfile.mkdtemp(prefix="bad-frame-")
    got = case.drive(root)
    leaked = []
    if os.path.exists(os.path.join(root, "pwned")) or os.path.exists("/tmp/pwned-by-bad-frames"):
        leaked.append("a pickle ran")
    # Closed threads and sockets go within a moment (ZeroMQ closes sockets on its I/O thread).
    if not wait_for(lambda: threading.active_count() <= threads, 5.0):
        leaked.append(f"threads {threads} -> {threading.active_count()}")
    if not wait_for(lambda: _open_fds() <= fds, 5.0):
        leaked.append(f"file descriptors {fds} -> {_open_fds()}")
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            os.remove(os.path.join(root, name))
        os.rmdir(root)
    if leaked:
        return "wrong", f"{got} (leaked: {', '.join(leaked)})"
    return ("clear" if re.search(case.expect, got) else "wrong"), got
