"""Shard-to-shard weight sync (distributed/shard_sync.py).

In one process: two senders playing training processes 0 and 1 (each holding
half the rows of every matrix) and two receivers with different layouts, over
real CURVE channels on loopback; a host tree (the online ranker's parameters)
from one sender, with live-only sends to receivers that come, are killed and
restart; hostile needs and headers. Across real processes: `launch/local.py`
with 2 generation + 2 training processes (gloo), the training params
FSDP-sharded over a mesh spanning both training processes.
"""

import contextlib
import json
import pathlib
import pickle
import subprocess
import sys
import textwrap
import time
import tracemalloc
import types
import zlib

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from child_env import checkout_env
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from streamrl_bench.bad_frames import Evil
from streamrl_jax.distributed import reshard, shard_receiver, shard_sync, shard_wire, xla_pull
from streamrl_jax.distributed.channel import (
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.wire import WireError

REPO = pathlib.Path(__file__).resolve().parents[1]

KEY = b"test-key-0123456789abcdef"


def make_params(scale: float = 1.0) -> dict:
    rng = np.random.default_rng(3)
    return {
        "embed": (rng.standard_normal((32, 12)) * scale).astype(jnp.bfloat16),
        "layers": [
            {
                "w": (rng.standard_normal((8, 6)) * scale).astype(np.float32),
                "n": np.ones(6, np.float32),
            },
            {"w": np.full((8, 6), -0.0, np.float32), "n": np.full(6, np.nan, np.float32)},
        ],
        "step": np.int32(7),
    }


def _bitwise(got, want) -> bool:
    return all(
        np.asarray(a).dtype == np.asarray(b).dtype
        and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def _row_halves(params):
    """Training processes 0 and 1 each hold half the rows of every matrix; vectors and
    the scalar are replicated on both: (sources, shards of each process)."""
    sources, shards = {0: [], 1: []}, {0: {}, 1: {}}
    for i, x in enumerate(jax.tree.leaves(params)):
        x = np.asarray(x)
        if x.ndim == 2:
            half = x.shape[0] // 2
            for p in (0, 1):
                box = ((p * half, (p + 1) * half), (0, x.shape[1]))
                sources[p].append([box])
                shards[p][(i, box)] = x[p * half : (p + 1) * half]
        else:
            box = tuple((0, d) for d in x.shape)
            for p in (0, 1):
                sources[p].append([box])
                shards[p][(i, box)] = x
    return sources, shards


@pytest.mark.parametrize("checksum", [False, True])
def test_two_senders_two_receivers_bitwise_each_sending_only_its_rows(checksum):
    params = make_params()
    senders = [
        shard_sync.ShardSender(
            "127.0.0.1:0", authkey=KEY, process=p, num_receivers=2, timeout_s=20,
            name=f"training-{p}", checksum=checksum,
        )
        for p in (0, 1)
    ]  # fmt: skip
    mesh = Mesh(np.array(jax.devices()[2:4]), ("tp",))
    layouts = [
        jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[1]), params),
        {  # generation process 1: tp over two devices where it divides
            "embed": NamedSharding(mesh, P(None, "tp")),
            "layers": [{"w": NamedSharding(mesh, P(None, "tp")), "n": NamedSharding(mesh, P())}]
            * 2,
            "step": NamedSharding(mesh, P()),
        },
    ]
    receivers = [
        shard_receiver.ShardReceiver(
            [s.address for s in senders],
            shard_wire.need_of(layouts[r], params, r),
            authkey=KEY,
            timeout_s=20,
            name=f"generation-{r}",
        )
        for r in (0, 1)
    ]
    try:
        sources, shards = _row_halves(params)
        leaves = shard_wire.layouts(params)
        plans = [s.plan(leaves, sources, timeout=20) for s in senders]
        sent = [
            s.send_shards(plan, shards[p], 5)
            for p, (s, plan) in enumerate(zip(senders, plans, strict=True))
        ]
        for r, receiver in enumerate(receivers):
            got, version, stats = receiver.receive(layouts[r], timeout=20)
            assert version == 5 and _bitwise(got, params)
            assert jax.tree.leaves(got)[0].sharding == jax.tree.leaves(layouts[r])[0]
            assert stats.checksum == checksum
            assert stats.total_bytes == sum(x.nbytes for x in jax.tree.leaves(params))
            for p in (0, 1):  # the report on both sides agrees with the plan
                assert stats.bytes[f"training-{p}"] == plans[p].bytes_sent(p, r)
                assert sent[p].bytes[f"generation-{r}"] == plans[p].bytes_sent(p, r)
        matrices = sum(x.nbytes for x in jax.tree.leaves(params) if np.ndim(x) == 2)
        for p in (0, 1):  # its half of every matrix to each receiver, plus shared vectors
            assert sent[p].total_bytes >= matrices  # = 2 receivers x half
            assert sent[p].total_bytes < 2 * sum(x.nbytes for x in jax.tree.leaves(params))
        # A second version goes through once the first was taken (one credit each).
        params2 = make_params(scale=2.0)
        _, shards2 = _row_halves(params2)
        for p, s in enumerate(senders):
            s.send_shards(plans[p], shards2[p], 6)
        for r, receiver in enumerate(receivers):
            got, version, _ = receiver.receive(layouts[r], timeout=20)
            assert version == 6 and _bitwise(got, params2)
    finally:
        for x in (*receivers, *senders):
            x.close(2)


def test_a_receiver_that_needs_other_weights_is_refused_naming_the_leaf():
    params = make_params()
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=1, timeout_s=10
    )
    other = dict(params, embed=np.zeros((32, 13), jnp.bfloat16))
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), other)
    receiver = shard_receiver.ShardReceiver(
        [sender.address], shard_wire.need_of(shardings, other, 0), authkey=KEY, timeout_s=10
    )
    try:
        sources = {0: [[tuple((0, d) for d in np.shape(x))] for x in jax.tree.leaves(params)]}
        with pytest.raises(
            TransportError,
            match=r"leaf 0: needs \['embed'\] bfloat16\[32, 13\], this process sends .*\[32, 12\]",
        ):
            sender.plan(shard_wire.layouts(params), sources, timeout=10)
    finally:
        receiver.close(1)
        sender.close(1)


@pytest.mark.parametrize(
    "boxes, match",
    [
        ([((0, 8), (0, 6))], "outside box"),  # rows 0-8: this receiver holds rows 0-4
        ([((0, 4), (0, 6)), ((2, 4), (0, 6))], "overlaps another piece"),
        ([((0, 2), (0, 6))], "covered 12 of the 24 elements"),  # a gap
    ],
)
def test_a_header_outside_the_need_fails_naming_the_sender(boxes, match, monkeypatch):
    """A key holder that announces pieces the receiver did not ask for: refused before
    any allocation (outside, overlapping), or when the version would be incomplete; it
    never makes the receiver allocate more than its own need."""
    allocated = []
    real = shard_receiver.empty_aligned
    monkeypatch.setattr(shard_receiver, "empty_aligned", lambda *a: allocated.append(a) or real(*a))
    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    leaf = reshard.LeafLayout("['w']", (8, 6), "float32", 4)
    need = shard_wire.Need(0, (leaf,), ((((0, 4), (0, 6)),),))
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=1, timeout_s=10, name="evil"
    )
    receiver = shard_receiver.ShardReceiver([sender.address], need, authkey=KEY, timeout_s=10)
    try:
        sender.wait_for_receivers(10)
        source = ((0, 8), (0, 6))
        pieces = tuple(
            reshard.Piece(0, 0, 0, source, 0, box, reshard.volume(box) * 4) for box in boxes
        )
        plan = reshard.Plan((leaf,), pieces, {0: ((((0, 4), (0, 6)),),)})
        # The receiver may refuse the header and drop the sender before its pieces are
        # all written: then the sender's own send fails naming the receiver.
        with contextlib.suppress(PeerLost):
            sender.send_shards(plan, {(0, source): x}, 1)
        with pytest.raises(TransportError, match=match):
            receiver.receive(SingleDeviceSharding(jax.devices()[0]), timeout=10)
        need_bytes = 4 * 6 * 4  # rows 0-4 of a float32 [8, 6]
        assert sum(int(np.prod(shape)) * jnp.dtype(dt).itemsize for shape, dt in allocated) <= (
            need_bytes
        )
        if match == "outside box":
            assert not allocated
    finally:
        receiver.close(1)
        sender.close(1)


def test_the_report_is_flat_and_bounded():
    stats = shard_wire.ShardStats(3, 0.5, {"training-0": 10, "training-1": 30}, True, wire_s=0.4)
    report = stats.report()
    assert report["bytes"] == 40 and report["bytes/training-1"] == 30
    assert report["gbps"] == pytest.approx(40 / 0.5 / 1e9) and report["checksum"] == 1.0
    many = shard_wire.ShardStats(3, 1.0, {f"training-{i}": i + 1 for i in range(100)}, False)
    assert len(many.report()) <= 64 and many.report()["bytes_max"] == 100


def _single(device: jax.Device, tree) -> dict:
    return jax.tree.map(lambda _: SingleDeviceSharding(device), tree)


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_host_tree_arrives_bitwise_in_the_receivers_own_layout():
    """Host (numpy) leaves, as the online ranker's parameters are, are whole boxes of the
    sending process; the receiver places them into its own sharding (here: `embed` split
    over a 2x2 mesh, the rest replicated)."""
    params = make_params()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tp"))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    shardings["embed"] = NamedSharding(mesh, P("data", "tp"))
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=3, num_receivers=1, timeout_s=10, name="ranker"
    )
    receiver = shard_receiver.ShardReceiver(
        [sender.address], shard_wire.need_of(shardings, params, 0), authkey=KEY, timeout_s=10
    )
    try:
        sent = sender.send(params, 3)
        got, version, stats = receiver.receive(shardings, timeout=10)
        assert version == 3 and _bitwise(got, params)
        assert got["embed"].sharding == shardings["embed"]
        total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
        assert stats.bytes == {"ranker": total} and sent.bytes == {"generation-0": total}
        sender.send(params, 4)
        with pytest.raises(ValueError, match="not the one the need declared"):
            receiver.receive(dict(shardings, extra=shardings["step"]), timeout=10)
        sender.close(2)
        with pytest.raises(ChannelClosed):
            receiver.receive(shardings, timeout=10)
    finally:
        receiver.close(1)
        sender.close(1)


def test_a_delta_sends_the_changed_leaves_and_keeps_the_rest_bitwise():
    """LoRA's adapter-only sync across processes: after a whole version, a delta sends
    only the changed leaves (their bytes alone); the receiver keeps the others from the
    version before. A receiver that takes whole versions only, or has none yet, refuses
    a delta naming it."""
    params = make_params()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    shardings["layers"][0]["w"] = NamedSharding(mesh, P(None, "tp"))
    device_params = jax.device_put(params, shardings)
    need = shard_wire.need_of(shardings, params, 0)
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=2, timeout_s=10, keep=2
    )
    delta = shard_receiver.ShardReceiver(
        [sender.address], need, authkey=KEY, timeout_s=10, deltas=True, name="generation-0"
    )
    whole = shard_receiver.ShardReceiver(
        [sender.address],
        shard_wire.need_of(shardings, params, 1),
        authkey=KEY,
        timeout_s=10,
        name="generation-1",
    )
    try:
        sender.send(device_params, 0)
        for r in (delta, whole):
            got, version, _ = r.receive(shardings, timeout=10)
            assert version == 0 and _bitwise(got, params)
        # Version 1 changes layers[0]["w"] (and "step"); index 2 and 5 in leaf order.
        new = jax.tree.map(lambda x: x, params)
        new["layers"][0]["w"] = params["layers"][0]["w"] * 3
        new["step"] = np.int32(8)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(new)]
        changed = frozenset(paths.index(k) for k in ("['layers'][0]['w']", "['step']"))
        # live_only: the whole-only receiver closes its connection on the delta's header,
        # possibly while its bytes are still streaming; the sender then drops it instead
        # of raising, and the delta receiver gets its version either way.
        stats = sender.send(jax.device_put(new, shardings), 1, changed=changed, live_only=True)
        got, version, rstats = delta.receive(shardings, timeout=10)
        assert version == 1 and _bitwise(got, new)
        assert (
            got["embed"] is not None
            and got["layers"][0]["w"].sharding == shardings["layers"][0]["w"]
        )
        want = new["layers"][0]["w"].nbytes + new["step"].nbytes
        assert rstats.bytes == {"training": want} and stats.bytes["generation-0"] == want
        with pytest.raises(TransportError, match="as a delta; this receiver takes whole"):
            whole.receive(shardings, timeout=10)
    finally:
        delta.close(1)
        whole.close(1)
        sender.close(1)
    # A delta to a receiver that holds no version yet.
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=1, timeout_s=10
    )
    fresh = shard_receiver.ShardReceiver(
        [sender.address], need, authkey=KEY, timeout_s=10, deltas=True
    )
    try:
        sender.send(device_params, 4, changed=frozenset({0}))
        with pytest.raises(TransportError, match="keep 5 leaves from a previous version, and"):
            fresh.receive(shardings, timeout=10)
        with pytest.raises(ValueError, match=r"changed leaves \[9\] outside \[0, 6\)"):
            sender.send(device_params, 5, changed=frozenset({9}))
    finally:
        fresh.close(1)
        sender.close(1)


def test_a_corrupt_piece_is_refused_naming_it(monkeypatch):
    # The sender's crc32s are off by one bit, as if the bytes changed after they were
    # checksummed: the receiver names the version, the sender and the leaf.
    monkeypatch.setattr(
        shard_sync, "zlib", types.SimpleNamespace(crc32=lambda b: zlib.crc32(b) ^ 1)
    )
    params = make_params()
    shardings = _single(jax.devices()[0], params)
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=1, timeout_s=10, checksum=True
    )
    receiver = shard_receiver.ShardReceiver(
        [sender.address], shard_wire.need_of(shardings, params, 0), authkey=KEY, timeout_s=10
    )
    try:
        sender.send(params, 5)
        corrupt = r"weights v5 from training .*\['embed'\] is corrupt \(crc32"
        with pytest.raises(shard_receiver.ChecksumError, match=corrupt):
            receiver.receive(shardings, timeout=10)
    finally:
        receiver.close(1)
        sender.close(1)


# A generation process's ranker receiver: `python -c _RECEIVER ADDRESS OUT` (this module
# on its path: `child_env.checkout_env`); writes "<version> <bitwise>" to OUT for every
# version it places.
_RECEIVER = """
import pathlib, sys
import jax
from shard_sync_test import KEY, _bitwise, _single, make_params
from streamrl_jax.distributed import shard_receiver, shard_wire

shardings = _single(jax.devices()[0], make_params())
need = shard_wire.need_of(shardings, make_params(), 1)
receiver = shard_receiver.ShardReceiver(
    [sys.argv[1]], need, authkey=KEY, timeout_s=10, name="generation-1-ranker")
while True:
    got, version, _ = receiver.receive(shardings, timeout=120)
    pathlib.Path(sys.argv[2]).write_text(f"{version} {_bitwise(got, make_params(version))}")
"""


def test_live_only_sends_skip_the_lost_and_serve_a_restarted_receiver_again(tmp_path):
    """The online ranker's channel: one sender of a host tree, two receivers. A resumed
    run's restored tree waits for every receiver; a refresh (`live_only`) goes to the
    receivers there now, skips one without room, skips and drops one that was killed,
    and reaches its restarted process again."""
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=2, num_receivers=2, timeout_s=10,
        name="training-ranker",
    )  # fmt: skip
    shardings = _single(jax.devices()[0], make_params())

    def receiver(process: int) -> shard_receiver.ShardReceiver:
        need = shard_wire.need_of(shardings, make_params(), process)
        return shard_receiver.ShardReceiver(
            [sender.address], need, authkey=KEY, timeout_s=10,
            name=f"generation-{process}-ranker",
        )  # fmt: skip

    def takes(r: shard_receiver.ShardReceiver, version: int) -> None:
        got, got_version, _ = r.receive(shardings, timeout=10)
        assert got_version == version and _bitwise(got, make_params(float(version)))

    receivers = [receiver(0)]
    child = None
    try:
        _until(lambda: sender.receivers() == [0])
        with pytest.raises(TransportTimeout, match="1/2 weights peers connected within"):
            sender.send(make_params(1.0), 1, timeout=1)
        stats = sender.send(make_params(1.0), 1, live_only=True)
        assert set(stats.bytes) == {"generation-0"}  # not waiting for the other
        takes(receivers[0], 1)
        # Receiver 0 has not taken v2: v3 skips it after the timeout instead of failing.
        sender.send(make_params(2.0), 2, live_only=True)
        assert sender.send(make_params(3.0), 3, live_only=True, timeout=0.5).bytes == {}
        takes(receivers[0], 2)
        # Generation process 1, a process of its own, joins: the next refresh reaches it.
        env = checkout_env(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
        placed, log = tmp_path / "placed", tmp_path / "receiver.log"
        address = "{}:{}".format(*sender.address)
        with log.open("w") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c", _RECEIVER, address, placed],
                stderr=stderr, env=env,
            )  # fmt: skip
        _until(lambda: sender.receivers() == [0, 1] or child.poll() is not None, 120)
        assert child.poll() is None, log.read_text()
        stats = sender.send(make_params(4.0), 4, live_only=True)
        assert set(stats.bytes) == {"generation-0", "generation-1"}
        takes(receivers[0], 4)
        _until(lambda: placed.exists() and placed.read_text() == "4 True")
        # Killed: the refreshes go on to receiver 0 and drop the lost one.
        child.kill()
        child.wait(10)
        version = 5
        while 1 in sender.receivers():
            assert version < 50, "the killed receiver was never dropped"
            sender.send(make_params(float(version)), version, live_only=True)
            takes(receivers[0], version)
            version += 1
        # Restarted (the same process id): admitted again, served from the next refresh.
        receivers.append(receiver(1))
        _until(lambda: sender.receivers() == [0, 1])
        stats = sender.send(make_params(float(version)), version, live_only=True)
        assert set(stats.bytes) == {"generation-0", "generation-1"}
        for r in receivers:
            takes(r, version)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        for x in (*receivers, sender):
            x.close(2)


def test_the_dtype_names_are_what_jax_calls_them():
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16, jnp.int32, jnp.int8, jnp.uint8):
        assert jnp.dtype(dtype).name in shard_wire.DTYPES


SOURCE = "generation-3"


def _need_with(**leaf) -> bytes:
    leaves = (reshard.LeafLayout("['w']", (8, 6), "float32", 4),) * 2
    frame = msgspec.msgpack.decode(shard_wire.Need(0, leaves, ((((0, 8), (0, 6)),),) * 2).encode())
    frame["leaves"][1].update(leaf)
    return msgspec.msgpack.encode(frame)


@pytest.mark.parametrize(
    "leaf, expect",
    [
        (dict(dtype="object"), "Invalid enum value 'object' - at `$.leaves[1].dtype`"),
        (dict(dtype=7), "at `$.leaves[1].dtype`"),
        (dict(shape=[4, -1]), "Expected `int` >= 0 - at `$.leaves[1].shape[1]`"),
        (dict(shape=[1] * 9), "length <= 8 - at `$.leaves[1].shape`"),
        (dict(shape=[2**41]), "at `$.leaves[1].shape[0]`"),
        (dict(shape=[2.0]), "at `$.leaves[1].shape[0]`"),
        (dict(path="p" * 4097), "at `$.leaves[1].path`"),
        (dict(path=None), "at `$.leaves[1].path`"),
        (dict(boxes=[]), "at `$.leaves[1].boxes`"),
        (dict(boxes=[[[0, 9], [0, 6]]]), "box ((0, 9), (0, 6)) is not inside leaf ['w']"),
        (dict(treedef=b"\x80\x04"), "unknown field `treedef`"),
    ],
)
def test_a_tampered_need_is_refused_naming_the_field(leaf, expect):
    with pytest.raises(WireError, match=f"from {SOURCE}") as info:
        shard_wire.Need.decode(_need_with(**leaf), SOURCE)
    assert expect in str(info.value)


def test_a_tampered_shards_header_is_refused_naming_the_field():
    good = shard_wire.ShardsHeader(1, 0, (shard_wire.PieceSpec(0, 0, ((0, 8), (0, 6)), 7),))
    for field, value, expect in [
        ("crc32", -1, "at `$.pieces[0].crc32`"),
        ("crc32", 2**32, "at `$.pieces[0].crc32`"),
        ("box", [[0, 1]] * 9, "length <= 8 - at `$.pieces[0].box`"),
        ("leaf", -1, "at `$.pieces[0].leaf`"),
    ]:
        frame = msgspec.msgpack.decode(shard_wire.ENCODER.encode(good))
        frame["pieces"][0][field] = value
        with pytest.raises(WireError, match=f"malformed weight shards from {SOURCE}") as info:
            shard_wire.decode_shards(msgspec.msgpack.encode(frame), SOURCE)
        assert expect in str(info.value)


def test_need_decoding_bounds_the_leaf_count_before_allocating():
    leaf = {"path": "", "shape": [], "dtype": "int8", "boxes": [[]]}
    frame = {"type": "need", "process": 0, "leaves": [leaf] * (shard_wire.MAX_LEAVES + 1)}
    with pytest.raises(WireError, match=r"length <= 100000 - at `\$.leaves`"):
        shard_wire.Need.decode(msgspec.msgpack.encode(frame), SOURCE)
    frame["leaves"] = frame["leaves"][:-1]
    need = shard_wire.Need.decode(msgspec.msgpack.encode(frame), SOURCE)
    assert len(need.leaves) == shard_wire.MAX_LEAVES
    # 2**32 - 1 leaves declared (over the bound) or 100,000 (within it), none present.
    head = msgspec.msgpack.encode({"type": "need", "process": 0})[1:]
    declared = b"\x83" + head + b"\xa6leaves\xdd"
    tracemalloc.start()
    try:
        for count, expect in [(2**32 - 1, "length <= 100000"), (100_000, "truncated")]:
            with pytest.raises(WireError, match=expect):
                shard_wire.Need.decode(declared + count.to_bytes(4, "big"), SOURCE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    for protocol in (0, pickle.HIGHEST_PROTOCOL):
        payload = pickle.dumps(Evil(marker), protocol=protocol)
        for decode in (shard_wire.Need.decode, shard_wire.decode_shards):
            with pytest.raises(WireError, match=f"from {SOURCE}"):
                decode(payload, SOURCE)
    assert not marker.exists()
    pickle.loads(payload)  # the guard: this payload is live
    assert marker.exists()


def test_device_to_device_pull_in_one_process_bitwise_with_checksums():
    """`jax.experimental.transfer` behind the same interface: one sender holding the
    params FSDP-sharded over devices 0-3, two receivers with their own layouts."""
    params = make_params()
    fsdp = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(fsdp, P("fsdp") if np.ndim(x) == 2 else P())),
        params,
    )
    sender = shard_sync.ShardSender(
        "127.0.0.1:0", authkey=KEY, process=0, num_receivers=2, timeout_s=20, checksum=True,
        xla=xla_pull.PullServer("127.0.0.1", jax.devices()[0]),
    )  # fmt: skip
    tp = Mesh(np.array(jax.devices()[6:8]), ("tp",))
    layouts = [
        jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[5]), params),
        jax.tree.map(
            lambda x: NamedSharding(tp, P(None, "tp") if np.ndim(x) == 2 else P()), params
        ),
    ]
    receivers = [
        shard_receiver.ShardReceiver(
            [sender.address], shard_wire.need_of(layouts[r], params, r), authkey=KEY,
            timeout_s=20, name=f"generation-{r}",
            xla=xla_pull.PullServer("127.0.0.1", jax.devices()[5 + r]),
        )
        for r in (0, 1)
    ]  # fmt: skip
    try:
        for version in (0, 1):
            sent = sender.send(sharded, version)
            for r, receiver in enumerate(receivers):
                got, got_version, stats = receiver.receive(layouts[r], timeout=30)
                assert got_version == version and _bitwise(got, params) and stats.checksum
                assert jax.tree.leaves(got)[0].sharding == jax.tree.leaves(layouts[r])[0]
                assert stats.bytes["training"] == sent.bytes[f"generation-{r}"]
                assert stats.total_bytes == sum(x.nbytes for x in jax.tree.leaves(params))
    finally:
        for x in (*receivers, sender):
            x.close(2)


def test_a_pull_whose_layout_disagrees_is_refused_before_pulling():
    device = SingleDeviceSharding(jax.devices()[0])
    spec = jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=device)
    whole = (((0, 4), (0, 3)),)
    xla_pull.check_agreement(((4, 3), "float32", whole), spec, "w")  # agrees
    for offered in [
        ((3, 4), "float32", (((0, 3), (0, 4)),)),  # same bytes, another shape: silently wrong
        ((4, 3), "bfloat16", whole),
        ((4, 3), "float32", (((0, 2), (0, 3)), ((2, 4), (0, 3)))),  # split over 2 devices
    ]:
        with pytest.raises(TransportError, match="w: the offered array .* does not match"):
            xla_pull.check_agreement(offered, spec, "w")


# ---------------------------------------------------------------------- processes
# One program for both transports (each 4-process start paid four Pythons' JAX start-up):
# the channel's sync, then jax.experimental.transfer's, each its own sender and receiver.
_WORKER = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shard_sync_test import make_params, _bitwise
from streamrl_jax.distributed import roles, shard_receiver, shard_sync, shard_wire, xla_pull

cfg = roles.DistributedConfig.from_env()
r = roles.initialize(cfg)
host = roles.advertised_host(cfg)
train = Mesh(np.array(r.training_devices), ("fsdp",))
local = Mesh(np.array(jax.local_devices()), ("tp",))

def shard(params, mesh, axis):
    def one(x):
        spec = P(axis) if np.ndim(x) == 2 else P()
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx])
    return jax.tree.map(one, params)

for mode in ("channel", "xla_transfer"):
    xla = xla_pull.PullServer(host, jax.local_devices()[0]) if mode == "xla_transfer" else None
    out = {"pid": r.process_id, "role": r.role, "mode": mode}
    if r.role == "training":
        t = r.training_processes.index(r.process_id)
        sender = shard_sync.ShardSender("%s:0" % host, authkey=cfg.authkey,
            process=r.process_id, num_receivers=len(r.generation_processes), timeout_s=60,
            name="training-%d" % t, checksum=True, xla=xla)
        roles.publish("weights-%s-%d" % (mode, t), "%s:%d" % sender.address)
        stats = [sender.send(shard(make_params(s), train, "fsdp"), v, wait_ack=True).bytes
                 for v, s in enumerate((1.0, 2.0))]
        out["sent"] = stats
        sender.close(10)
    else:
        abstract = make_params()
        shardings = jax.tree.map(lambda x: x.sharding, shard(abstract, local, None))
        shardings["embed"] = NamedSharding(local, P(None, "tp"))  # tp on this side
        addresses = [roles.lookup("weights-%s-%d" % (mode, t), 60)
                     for t in range(len(r.training_processes))]
        receiver = shard_receiver.ShardReceiver(addresses,
            shard_wire.need_of(shardings, abstract, r.process_id), authkey=cfg.authkey,
            timeout_s=60, name="generation-%d" % r.process_id, xla=xla)
        out["exact"], out["received"] = [], []
        for v, s in enumerate((1.0, 2.0)):
            got, version, stats = receiver.receive(shardings, timeout=60)
            out["exact"].append(version == v and _bitwise(got, make_params(s)))
            out["received"].append(stats.bytes)
            assert stats.checksum
        receiver.close(10)
    print("RESULT", json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """{mode: {process id: its RESULT}} of the 2 generation + 2 training process program,
    for both transports."""
    path = tmp_path_factory.mktemp("shards") / "worker.py"
    path.write_text(textwrap.dedent(_WORKER))
    run = subprocess.run(
        [sys.executable, str(REPO / "launch" / "local.py"), "-n", "4", "-g", "2",
         "--timeout_s", "150", "--", sys.executable, str(path)],
        capture_output=True, text=True, timeout=180,
        env=checkout_env(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in run.stdout.splitlines()
        if "RESULT" in line
    ]
    by_mode = {"channel": {}, "xla_transfer": {}}
    for x in results:
        by_mode[x["mode"]][x["pid"]] = x
    return by_mode, run.stdout


@pytest.mark.parametrize("xla", [False, True], ids=["channel", "xla_transfer"])
def test_two_training_processes_send_only_their_shards_to_two_generation_processes(two_by_two, xla):
    by_mode, stdout = two_by_two
    by_role = by_mode["xla_transfer" if xla else "channel"]
    assert sorted(by_role) == [0, 1, 2, 3], stdout[-3000:]
    params = make_params()
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    matrices = sum(x.nbytes for x in jax.tree.leaves(params) if np.ndim(x) == 2)
    for g in (0, 1):
        assert by_role[g]["exact"] == [True, True]  # every generation process, bitwise
        for received in by_role[g]["received"]:
            assert sum(received.values()) == total  # each element once
    for t, pid in enumerate((2, 3)):
        for v, sent in enumerate(by_role[pid]["sent"]):
            for g in (0, 1):
                # Exactly what the receiver saw from it; its half of every matrix, and
                # never the whole model.
                assert sent[f"generation-{g}"] == by_role[g]["received"][v][f"training-{t}"]
                assert matrices // 2 <= sent[f"generation-{g}"] < total
