"""Multi-controller building blocks across real processes (CPU, localhost).

Children are separate Python processes (`subprocess`), killed with SIGKILL
where a test needs a lost peer; every wait has a deadline so a broken
transport fails the test instead of hanging it.
"""

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import numpy as np
import pytest
from child_env import checkout_env
from jax.sharding import SingleDeviceSharding

from streamrl_bench import bad_frames
from streamrl_bench.bad_frames import Evil, TamperingProxy, raw_peer, wait_for
from streamrl_jax.distributed import channel as channel_lib
from streamrl_jax.distributed import (
    keys,
    reshard,
    roles,
    shard_receiver,
    shard_sync,
    shard_wire,
    wire,
)
from streamrl_jax.distributed.channel import (
    AuthenticationFailed,
    ChannelClosed,
    PeerLost,
    TransportTimeout,
)
from streamrl_jax.distributed.messages import SpanReport
from streamrl_jax.distributed.transport import SampleClient, SampleServer
from streamrl_jax.generation.types import RequestTag, Sample, Timings
from streamrl_jax.stream.sample_stream import SampleStream

REPO = pathlib.Path(__file__).resolve().parents[1]

KEY = b"test-key-0123456789abcdef"
# Children import this module (for make_samples) and the package (on their path).
_CHILD_ENV = checkout_env(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")


def make_samples(n: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [
        Sample(
            request_id=f"req-{i}",
            prompt=rng.integers(0, 49152, 24, dtype=np.int32),
            response=rng.integers(0, 49152, 200, dtype=np.int32),
            logprobs=rng.standard_normal(200).astype(np.float32),
            sampling_logprobs=rng.standard_normal(200).astype(np.float32),
            finish_reason="stop" if i % 2 else "length",
            policy_version=i,
            last_policy_version=i + 1,
            instance_id=i % 3,
            timings=Timings(enqueue=1.5 * i, admit=2.5 * i, finish=3.5 * i),
            tag=RequestTag(batch=0, group=i // 4, member=i % 4, prompt_id=f"p/{i // 4}"),
            token_versions=np.repeat(np.int32([i, i + 1]), 100),  # W_{i+1} mid-sample
        )
        for i in range(n)
    ]


def note(text: str) -> SpanReport:
    """A small wire message carrying `text` (what the tests send besides samples)."""
    return SpanReport(track="test", name=text, t0=0.0, t1=0.0, args={})


def _addr(server) -> str:
    host, port = server.address
    return f"{host}:{port}"


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_CHILD_ENV,
    )


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line; fails (with its stderr) on EOF or timeout."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not out or not out[0]:
        proc.kill()
        pytest.fail(f"child gave no line within {timeout} s; stderr:\n{proc.stderr.read()}")
    return out[0].strip()


def _finish(proc: subprocess.Popen, timeout: float = 30) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{err}"
    return out


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def _same_sample(a: Sample, b: Sample) -> None:
    for field in dataclasses.fields(Sample):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


_PRODUCER = """
import sys
from distributed_transport_test import make_samples
from streamrl_jax.distributed.transport import SampleClient
client = SampleClient(sys.argv[1], authkey=b"test-key-0123456789abcdef", timeout_s=10,
                      name="generation-3")
for s in make_samples(int(sys.argv[2])):
    client.send(s)
client.close()
"""


def test_samples_round_trip_exactly(children):
    with SampleServer("127.0.0.1:0", authkey=KEY, capacity=4, timeout_s=10) as server:
        children.append(_spawn(_PRODUCER, _addr(server), "10"))
        got = [server.get(timeout=30) for _ in range(10)]
        with pytest.raises(ChannelClosed, match="all producers closed"):
            server.get(timeout=10)
        _finish(children[0])
    for a, b in zip(got, make_samples(10), strict=True):
        _same_sample(a, b)
    assert server.received == 10


_BLOCKED_PRODUCER = """
import sys
from distributed_transport_test import note
from streamrl_jax.distributed.transport import SampleClient
from streamrl_jax.distributed.channel import TransportTimeout
client = SampleClient(sys.argv[1], authkey=b"test-key-0123456789abcdef", timeout_s=10,
                      name="generation-0")
for i in range(2):
    client.send(note(str(i)), timeout=5)
print("sent 2", flush=True)
try:
    client.send(note("2"), timeout=0.5)
except TransportTimeout as e:
    print(e, flush=True)
"""


def test_producer_without_credit_times_out_naming_the_consumer(children):
    with SampleServer("127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=10) as server:
        children.append(_spawn(_BLOCKED_PRODUCER, _addr(server)))
        assert _readline(children[0], 30) == "sent 2"
        message = _readline(children[0], 10)
        assert f"no credit from training ({_addr(server)})" in message, message
        got = [server.get(timeout=5).name for _ in range(2)]
        assert got == ["0", "1"]  # nothing was lost


def test_wrong_key_is_rejected_and_server_keeps_serving():
    with SampleServer("127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=5) as server:
        with pytest.raises(AuthenticationFailed, match="samples server 127.0.0.1:.*run key"):
            SampleClient(server.address, authkey=b"another-run-key-0123456789", timeout_s=5)
        with pytest.raises(keys.RunKeyError, match="no run key"):
            SampleClient(server.address, authkey=None, timeout_s=5)
        with SampleClient(server.address, authkey=KEY, timeout_s=5) as client:
            client.send(note("ok"))
            assert server.get(timeout=5).name == "ok"
        assert server.rejected and "run's key" in server.rejected[0]


def test_a_short_dial_deadline_leaves_the_channels_silence_bound_alone():
    # dial_timeout_s bounds only the handshake (a restarted generation process dials in
    # short attempts); the connected channel still tolerates timeout_s of silence (the
    # server pings every 5 s here, so a 0.5 s bound would lose it).
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportTimeout, match=r"no samples server answered .* within 0.5 s"):
        SampleClient(f"127.0.0.1:{port}", authkey=KEY, timeout_s=30, dial_timeout_s=0.5)
    with (
        SampleServer("127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=30) as server,
        SampleClient(server.address, authkey=KEY, timeout_s=30, dial_timeout_s=0.5) as c,
    ):
        time.sleep(2.0)
        assert c.error is None
        c.send(note("ok"))
        assert server.get(timeout=5).name == "ok"


def test_a_weights_receiver_dials_in_short_attempts_too():
    # A restarted generation process dials the weights servers as it dials the sample
    # servers (`GenerationProcess._dial`): the handshake gives up after dial_timeout_s,
    # and a receiver that did connect keeps the 30 s silence bound.
    leaf = reshard.LeafLayout("['w']", (8, 6), "float32", 4)
    need = shard_wire.Need(0, (leaf,), ((((0, 8), (0, 6)),),))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportTimeout, match="within 0.5 s"):  # the dial bound, not 30 s
        shard_receiver.ShardReceiver(
            [f"127.0.0.1:{port}"], need, authkey=KEY, timeout_s=30, dial_timeout_s=0.5
        )
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=1, timeout_s=30, name="w"
    )
    receiver = shard_receiver.ShardReceiver(
        [sender.address], need, authkey=KEY, timeout_s=30, dial_timeout_s=0.5
    )
    try:
        x = np.arange(48, dtype=np.float32).reshape(8, 6)
        source = ((0, 8), (0, 6))
        plan = sender.plan((leaf,), {0: [[source]]}, timeout=10)
        time.sleep(2.0)  # past the dial deadline: the channel must still be up
        sender.send_shards(plan, {(0, source): x}, 1)
        sharding = {"w": SingleDeviceSharding(jax.devices()[0])}
        got, version, _ = receiver.receive(sharding, timeout=10)
        assert version == 1
        np.testing.assert_array_equal(got["w"], x)
    finally:
        receiver.close(1)
        sender.close(1)


def test_on_sample_feeds_a_sample_stream_with_its_back_pressure():
    stream = SampleStream(group_size=2, group_key=lambda s: s.tag.group, capacity=2)
    samples = make_samples(4)
    for i, s in enumerate(samples):
        samples[i] = dataclasses.replace(s, tag=RequestTag(group=i // 2, member=i % 2))
    with (
        SampleServer(
            "127.0.0.1:0",
            authkey=KEY,
            capacity=8,
            timeout_s=5,
            on_sample=lambda s, peer: stream.put(s, timeout=5),
        ) as server,
        SampleClient(server.address, authkey=KEY, timeout_s=5) as client,
    ):
        for s in samples:
            client.send(s)
        first = stream.get_groups(timeout=5)  # frees the room group 1 waits for
        second = stream.get_groups(timeout=5)
    got = [[s.request_id for s in g] for g in first + second]
    assert got == [["req-0", "req-1"], ["req-2", "req-3"]]
    assert len(first) == 1 and stream.metrics.max_ready_depth == 1  # capacity held
    assert server.received == 4


def test_no_key_is_refused_on_loopback_too():
    with pytest.raises(keys.RunKeyError, match="no run key"):
        SampleServer("127.0.0.1:0", authkey=None, capacity=1)
    with pytest.raises(keys.RunKeyError, match="at least 16"):
        SampleServer("127.0.0.1:0", authkey=b"short", capacity=1)


_SLEEPY_PRODUCER = """
import sys
import time
from streamrl_jax.distributed.transport import SampleClient
from distributed_transport_test import note
client = SampleClient(sys.argv[1], authkey=b"test-key-0123456789abcdef",
                      timeout_s=float(sys.argv[2]), heartbeat_s=0.2, name="generation-7")
client.send(note("first"))
print("sent", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_lost_producer_is_reported_by_name(children, how):
    """SIGKILL: the connection closes. SIGSTOP: the process lives but its heartbeats stop."""
    with SampleServer(
        "127.0.0.1:0", authkey=KEY, capacity=4, timeout_s=3.0, heartbeat_s=0.2
    ) as server:
        children.append(_spawn(_SLEEPY_PRODUCER, _addr(server), "3.0"))
        assert _readline(children[0], 30) == "sent"
        assert server.get(timeout=10).name == "first"
        os.kill(children[0].pid, how)
        # a PeerLost within get's own 20 s wait (which would raise a timeout instead)
        with pytest.raises(PeerLost, match=r"lost generation-7 \(127\.0\.0\.1\)") as err:
            server.get(timeout=20)
        if how == signal.SIGSTOP:
            assert "no message or heartbeat" in str(err.value)
        children[0].kill()


_SLEEPY_CONSUMER = """
import time
from streamrl_jax.distributed.transport import SampleServer
server = SampleServer("127.0.0.1:0", authkey=b"test-key-0123456789abcdef", capacity=64,
                      timeout_s=10)
print("%s:%d" % server.address, flush=True)
time.sleep(600)
"""


def test_lost_consumer_is_reported_by_name(children):
    children.append(_spawn(_SLEEPY_CONSUMER))
    address = _readline(children[0], 30)
    client = SampleClient(address, authkey=KEY, timeout_s=10, name="generation-1")
    client.send(note("x"))
    os.kill(children[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match=rf"lost training \({address}\)"):
        while time.monotonic() - t0 < 15:
            client.send(note("x"), timeout=1)
            time.sleep(0.05)
    client.close(timeout=1)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"C", struct.pack("!iq", -5, -1)], "malformed credit frame"),
        ([b"C", b"\x01"], "malformed credit frame"),
        ([b"Q", b"x"], "bad message kind"),
        ([b"D", b"\xc1garbage"], "malformed message from rogue"),
        ([b"R", b"xx"], "bulk bytes nobody asked for"),
        ([b"D", b"x" * (channel_lib.MAX_FRAME_BYTES + 1)], "rogue .*connection closed"),
        ([b"D", wire.encode(note("x"))] * 3, "sent data without credit"),
    ],
    ids=["negative credits", "short credit", "unknown kind", "not the schema", "raw unasked",
         "oversized frame", "no credit"],
)  # fmt: skip
def test_a_malformed_message_from_an_authenticated_peer_fails_its_channel_by_name(frames, message):
    failed = []
    with SampleServer(
        "127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=10, on_error=failed.append
    ) as server:
        rogue = raw_peer(server.address, key=KEY)
        try:
            if len(frames) > 2:  # several messages
                for i in range(0, len(frames), 2):
                    rogue.send_multipart(frames[i : i + 2])
            else:
                rogue.send_multipart(frames)
            assert wait_for(lambda: failed), "the channel did not fail"
            assert re.search(message, str(failed[0])) and "rogue" in str(failed[0])
            assert all(c.credits >= 0 for c in server._hub.channels)
        finally:
            rogue.close()


def test_a_pickle_from_an_authenticated_peer_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    failed = []
    with SampleServer(
        "127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=10, on_error=failed.append
    ) as server:
        rogue = raw_peer(server.address, key=KEY)
        rogue.send_multipart([b"D", pickle.dumps(Evil(marker))])
        assert wait_for(lambda: failed)
        assert "malformed message from rogue" in str(failed[0])
        rogue.close()
    assert not marker.exists()


def test_unauthenticated_local_processes_are_rejected_and_nothing_runs(tmp_path):
    """A plain TCP client, a ZeroMQ client without CURVE and one with CURVE but not the
    run's client key (it learnt the server's public key): none gets a byte to a channel."""
    marker = tmp_path / "ran"
    payload = pickle.dumps(Evil(marker))
    with SampleServer("127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=5) as server:
        host, port = server.address
        with socket.create_connection((host, port)) as raw:
            raw.sendall(struct.pack("!i", len(payload)) + payload)  # the old framing
            time.sleep(0.2)
        # Outsiders are other processes (bad_frames.outsider): no hello comes back.
        assert bad_frames.outsider(server.address, "null", payload, listen_s=0.2) == "silent"
        assert bad_frames.outsider(server.address, "curve", payload, listen_s=0.2) == "silent"
        assert wait_for(lambda: len(server.rejected) >= 2)
        with SampleClient(server.address, authkey=KEY, timeout_s=5) as client:
            client.send(note("legit"))
            assert server.get(timeout=5).name == "legit"  # nothing else was delivered
        assert all("run's key" in r for r in server.rejected)
    assert not marker.exists()


def test_idle_unauthenticated_connections_cost_no_threads():
    with SampleServer("127.0.0.1:0", authkey=KEY, capacity=2, timeout_s=5) as server:
        before = threading.active_count()
        idle = [socket.create_connection(server.address) for _ in range(300)]
        try:
            time.sleep(0.5)
            assert threading.active_count() == before
            with SampleClient(server.address, authkey=KEY, timeout_s=5) as client:
                client.send(note("still serving"))
                assert server.get(timeout=5).name == "still serving"
        finally:
            for sock in idle:
                sock.close()


def test_a_tampered_frame_is_never_delivered_and_loses_its_peer_by_name():
    samples = make_samples(8)
    failed = []
    with SampleServer(
        "127.0.0.1:0",
        authkey=KEY,
        capacity=16,
        timeout_s=3,
        heartbeat_s=0.3,
        on_error=failed.append,
    ) as server:
        proxy = TamperingProxy(server.address, offset=6000)  # past the CURVE handshake
        client = SampleClient(proxy.address, authkey=KEY, timeout_s=3, name="generation-5")
        got = []
        with contextlib.suppress(channel_lib.TransportError):
            for s in samples:
                client.send(s, timeout=5)
        lost = r"lost generation-5 .*no message .*a frame failed authentication"
        with pytest.raises(PeerLost, match=lost):
            while True:
                got.append(server.get(timeout=10))
        assert proxy.flipped and len(got) < len(samples)
        for a, b in zip(got, samples, strict=False):
            _same_sample(a, b)  # everything delivered is exactly what was sent
        client.close(timeout=1)


# ---------------------------------------------------------------------- roles
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"process_id .* \[0, 1\]"),
        (
            dict(coordinator_address="h:1", num_processes=3, process_id=0, generation_processes=3),
            r"generation_processes .* \[1, 2\] \(at least one training process\), got 3",
        ),
        (
            dict(
                coordinator_address="h:1",
                num_processes=3,
                process_id=0,
                generation_processes=2,
                scoring_processes=1,
            ),
            r"\[1, 1\] \(at least one training process\), got 2 with 1 scoring process",
        ),
        (
            dict(coordinator_address="h:1", num_processes=3, process_id=0, scoring_processes=-1),
            r"STREAMRL_SCORING_PROCESSES\) must be >= 0, got -1",
        ),
        (
            dict(coordinator_address="h:1", num_processes=3, process_id=0, generation_processes=0),
            r"got 0",
        ),
        (dict(num_processes=2, process_id=0), "coordinator_address"),
        (dict(coordinator_address="h:1", num_processes=2), "set both"),
        (dict(coordinator_address="h:1", num_processes=1, process_id=0), ">= 2"),
        (dict(coordinator_address="nohostport", num_processes=2, process_id=0), "host:port"),
        (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s"),
        (dict(peer_timeout_s=0.5), "STREAMRL_PEER_TIMEOUT_S"),
    ],
)
def test_distributed_config_rejects_inconsistent_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        roles.DistributedConfig(**kwargs)


def test_distributed_config_from_env_and_slurm():
    cfg = roles.DistributedConfig.from_env(
        {
            "STREAMRL_COORDINATOR": "10.0.0.1:1234",
            "STREAMRL_NUM_PROCESSES": "4",
            "STREAMRL_PROCESS_ID": "3",
            "STREAMRL_GENERATION_PROCESSES": "2",
            "STREAMRL_AUTHKEY": "k" * 16,
            "STREAMRL_CPU_COLLECTIVES": "none",
            "STREAMRL_PEER_TIMEOUT_S": "7.5",
        }
    )
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.1:1234", 4, 3)
    assert cfg.peer_timeout_s == 7.5
    assert cfg.role_of(1) == "generation" and cfg.role_of(2) == "training"
    assert cfg.authkey == b"k" * 16 and cfg.cpu_collectives is None
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "gpu-n[07-09,12]"}
    cfg = roles.DistributedConfig.from_env({**slurm, "SLURM_JOB_ID": "4097"})
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("gpu-n07:61441", 3, 1)
    assert roles.DistributedConfig.from_env({}).num_processes is None  # TPU: JAX detects
    with pytest.raises(ValueError, match="STREAMRL_PROCESS_ID='x' is not an integer"):
        roles.DistributedConfig.from_env({**slurm, "STREAMRL_PROCESS_ID": "x"})
    with pytest.raises(ValueError, match="STREAMRL_PEER_TIMEOUT_S='soon' is not a number"):
        roles.DistributedConfig.from_env({**slurm, "STREAMRL_PEER_TIMEOUT_S": "soon"})
    assert roles.first_host("a1,b2") == "a1" and roles.first_host("n[3,5-6]") == "n3"


def test_assign_roles_groups_devices_by_process():
    Dev = dataclasses.make_dataclass("Dev", ["id", "process_index"])
    devices = [Dev(i, i // 2) for i in range(6)]
    r = roles.assign_roles(2, 3, 1, devices)
    assert r.role == "training" and r.training_processes == (1, 2)
    assert [d.id for d in r.generation_devices] == [0, 1]
    assert [d.id for d in r.training_devices] == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="process 3 has no devices"):
        roles.assign_roles(0, 4, 1, devices)
    # The last S processes score (the judge's own processes); at least one trains.
    r = roles.assign_roles(2, 3, 1, devices, scoring_processes=1)
    assert r.role == "scoring" and r.training_processes == (1,) and r.scoring_processes == (2,)
    assert [d.id for d in r.scoring_devices] == [4, 5]
    assert [d.id for d in r.training_devices] == [2, 3]
    with pytest.raises(ValueError, match=r"\[1, 0\] \(at least one training process\)"):
        roles.assign_roles(0, 3, 1, devices, scoring_processes=2)
    scoring = roles.DistributedConfig.from_env(
        {
            "STREAMRL_COORDINATOR": "10.0.0.1:1234",
            "STREAMRL_NUM_PROCESSES": "4",
            "STREAMRL_PROCESS_ID": "3",
            "STREAMRL_SCORING_PROCESSES": "1",
            "STREAMRL_AUTHKEY": "k" * 16,
        }
    )
    roles_of = [scoring.role_of(i) for i in range(4)]
    assert roles_of == ["generation", "training", "training", "scoring"]


# ---------------------------------------------------------------------- launch
_WORKER = """
import collections
import json
import jax
jax.config.update("jax_num_cpu_devices", 2)
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from streamrl_jax.distributed import roles
from streamrl_jax.distributed.transport import SampleClient, SampleServer

cfg = roles.DistributedConfig.from_env()
r = roles.initialize(cfg)
mesh = Mesh(np.array(jax.devices()), ("x",))
local = np.full((2,), r.process_id + 1, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)  # gloo all-reduce
if r.process_id == 1:  # a program of process 1's alone, for the compile cache
    def training_only(v):
        return v * 3
    jax.block_until_ready(jax.jit(training_only)(jnp.ones(3)))
got = None
if r.role == "training":
    address = "%s:0" % roles.advertised_host(cfg)
    with SampleServer(address, authkey=cfg.authkey, capacity=2, timeout_s=30) as server:
        roles.publish("samples", "%s:%d" % server.address)
        got = [int(server.get(timeout=30).name) for _ in range(3)]
else:
    from streamrl_jax.distributed.messages import SpanReport
    with SampleClient(roles.lookup("samples", 30), authkey=cfg.authkey, timeout_s=30) as c:
        for i in range(3):
            c.send(SpanReport(track="t", name=str(i), t0=0.0, t1=0.0, args={}))
print("RESULT", json.dumps({"pid": r.process_id, "role": r.role, "sum": float(total),
      "gen": len(r.generation_devices), "train": len(r.training_devices), "got": got}))
asked, read = (events["/jax/compilation_cache/" + k]
               for k in ("compile_requests_use_cache", "cache_hits"))
print("CACHE", json.dumps({"pid": r.process_id, "compiled": asked - read, "read": read}))
jax.distributed.shutdown()
"""


def _launch(tmp_path, script: str, *flags: str, env=None) -> subprocess.CompletedProcess:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(script))
    cmd = [sys.executable, str(REPO / "launch" / "local.py"), *flags, "--timeout_s", "120"]
    return subprocess.run(
        [*cmd, "--", sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env or _CHILD_ENV,
    )


def test_launch_local_two_processes_roles_psum_and_samples(tmp_path):
    cache = tmp_path / "jax-cache"
    run = _launch(tmp_path, _WORKER, "-n", "2", env=_cache_env(cache))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = _lines(run, "RESULT")
    assert len(results) == 2, run.stdout[-3000:]
    gen, train = (line.split("RESULT ", 1)[1] for line in results)
    assert gen.startswith('{"pid": 0, "role": "generation", "sum": 6.0, "gen": 2, "train": 2')
    assert train.startswith('{"pid": 1, "role": "training", "sum": 6.0')
    assert train.endswith('"got": [0, 1, 2]}')
    assert results[0].startswith("[p0 gen] RESULT") and results[1].startswith("[p1 train] RESULT")
    # The same program again, with the compile cache the first wrote: process 1 reads its
    # own program (JAX alone writes process 0's only: distributed/compile_cache.py), and
    # the all-reduce, a CPU program spanning both processes, is compiled again by each:
    # read back from the cache it broke gloo's collectives (the module's docstring).
    run = _launch(tmp_path, _WORKER, "-n", "2", env=_cache_env(cache))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    counts = [json.loads(line.split("CACHE ", 1)[1]) for line in _lines(run, "CACHE")]
    assert [(c["pid"], c["compiled"]) for c in counts] == [(0, 1), (1, 1)], run.stdout[-3000:]
    assert counts[1]["read"] > 0, counts


def _lines(run, tag: str) -> list[str]:
    return sorted(line for line in run.stdout.splitlines() if f"] {tag} " in line)


def _cache_env(cache) -> dict[str, str]:
    """The children's environment with a compile cache of their own, bounded (which is
    what turns on JAX's file lock), keeping every program."""
    return dict(
        _CHILD_ENV,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_COMPILATION_CACHE_MAX_SIZE=str(1 << 28),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )


def test_launch_local_stops_everyone_when_one_fails(tmp_path):
    script = """
    import os, time
    if os.environ["STREAMRL_PROCESS_ID"] == "2":
        raise SystemExit(3)
    time.sleep(100)
    print("woke", flush=True)
    """
    run = _launch(tmp_path, script, "-n", "3", "-g", "2", "--grace_s", "1")
    assert run.returncode == 3, run.stdout
    assert "process 2 failed (rc 3)" in run.stdout
    assert "woke" not in run.stdout  # the others were stopped, not waited for (120 s bound)


def test_launch_local_restarts_a_failed_generation_process(tmp_path):
    # --restart_generation: generation process 1 fails the first time and is started
    # again with the same id (it rejoins); the training process, still running, waits
    # for the restarted one; the run ends 0.
    script = f"""
    import os, pathlib, time
    me, mark = os.environ["STREAMRL_PROCESS_ID"], pathlib.Path({str(tmp_path)!r})
    if me == "1":
        if not (mark / "failed").exists():
            (mark / "failed").write_text("")
            raise SystemExit(5)
        (mark / "back").write_text(os.environ["STREAMRL_PROCESS_ID"])
    if me == "2":
        deadline = time.monotonic() + 60
        while not (mark / "back").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    """
    flags = ["-n", "3", "-g", "2", "--restart_generation", "1", "--restart_delay_s", "0"]
    run = _launch(tmp_path, script, *flags)
    assert run.returncode == 0, run.stdout
    assert "generation process 1 failed (rc 5); restarting it" in run.stdout
    assert (tmp_path / "back").read_text() == "1"


def _dialer(rejoined: bool, peer_timeout_s: float, outcome):
    """`GenerationProcess._dial` of a stand-in process whose board answers the run's
    outcome with `outcome(key)`."""
    from streamrl_jax.pipeline.processes import generation as generation_process

    me = types.SimpleNamespace(
        r=types.SimpleNamespace(rejoined=rejoined),
        dcfg=types.SimpleNamespace(peer_timeout_s=peer_timeout_s),
        pid=1,
        board=types.SimpleNamespace(try_lookup=outcome),
    )
    return functools.partial(generation_process.GenerationProcess._dial, me)


def test_a_restarted_generation_process_that_finds_the_run_ended_while_dialing_stops(
    monkeypatch,
):
    # The run may end while a restarted generation process starts (its trainer's sample
    # server then closes): the process dials in short attempts and, between them, reads
    # the run's outcome; finding one ends it cleanly (`_RunEnded`), not with a timeout.
    from streamrl_jax.pipeline.processes import generation as generation_process

    outcomes = iter([None, None, "ok"])
    monkeypatch.setattr(generation_process, "REJOIN_DIAL_S", 0.5)
    timeouts = []

    def make(timeout_s):
        timeouts.append(timeout_s)
        raise TransportTimeout("no samples server answered")

    with pytest.raises(generation_process._RunEnded) as ended:
        _dialer(True, 30.0, lambda key: next(outcomes))(make, "sample")
    assert ended.value.outcome == "ok"
    assert timeouts == [0.5, 0.5, 0.5]


def test_a_restarted_generation_process_not_admitted_names_the_whole_wait(monkeypatch):
    from streamrl_jax.pipeline.processes import generation as generation_process

    monkeypatch.setattr(generation_process, "REJOIN_DIAL_S", 0.2)
    calls = []

    def make(timeout_s):
        calls.append(timeout_s)
        time.sleep(timeout_s)
        raise TransportTimeout("no samples server answered")

    with pytest.raises(TransportTimeout, match="no weights server admitted .* within 1.0 s"):
        _dialer(True, 1.0, lambda key: None)(make, "weights")  # the run goes on
    assert 3 <= len(calls) <= 7 and all(t <= 0.2 for t in calls)


def test_a_first_start_dials_once_with_the_peer_timeout():
    calls = []

    def make(timeout_s):
        calls.append(timeout_s)
        raise TransportTimeout("no samples server answered")

    with pytest.raises(TransportTimeout, match="no samples server answered"):
        _dialer(False, 30.0, lambda key: pytest.fail("looked up the outcome"))(make, "sample")
    assert calls == [30.0]


def test_launch_local_writes_the_childrens_pids(tmp_path):
    # --pids_file (tools/fault_drill.py --processes kills one child by it): each
    # process id maps to that child's pid and role.
    script = """
    import os
    print("PID", os.environ["STREAMRL_PROCESS_ID"], os.getpid())
    """
    pids_file = tmp_path / "pids.json"
    run = _launch(tmp_path, script, "-n", "3", "-g", "2", "--pids_file", str(pids_file))
    assert run.returncode == 0, run.stdout
    printed = dict(line.split()[-2:] for line in run.stdout.splitlines() if " PID " in line)
    pids = json.loads(pids_file.read_text())
    role_of = {"0": "gen", "1": "gen", "2": "train"}
    assert pids == {i: [int(printed[i]), role] for i, role in role_of.items()}


def test_the_launchers_and_the_sample_channel_import_no_jax():
    # launch/local.py and launch/ray_cluster.py supervise the program's processes from
    # host code (streamrl_jax.distributed's docstring); importing JAX there would add its
    # start-up (seconds) to every launch, and a GPU or TPU runtime's to a machine's login
    # node. The names of streamrl_jax.generation load on first use for this.
    code = (
        "import sys; import streamrl_jax.distributed.local_program, "
        "streamrl_jax.distributed.transport, streamrl_jax.generation.types; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
    from streamrl_jax import generation

    assert generation.Engine.__name__ == "Engine" and "Engine" in dir(generation)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = generation.Nope
