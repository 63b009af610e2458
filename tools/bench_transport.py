"""Cross-process transport vs in-process baselines (two processes on localhost).

    python tools/bench_transport.py --quick [--pin] [--xla_transfer]

Measures, with random arrays of the SmolLM2-135M shapes (30 layers, width
576, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings;
134.5 M parameters) in float32 and bfloat16:

* one `shard_sync.ShardSender` (this process, holding the whole tree on one
  CPU device, as one training process does) to a `ShardReceiver` in a child
  (placing into one CPU device): sender end-to-end time (device_get + wire +
  device_put on the receiver + acknowledgement; no crc32: CURVE authenticates
  every byte) and the receiver's split (wire / place);
* the in-process baseline: `jax.device_put` of the same tree from CPU device
  0 to CPU device 1 (what `weight_sync.WeightSync` does inside one process);
* with `--xla_transfer`: a `jax.experimental.transfer` pull of the same tree
  (receiver-side time; bit-exactness checked against the checksummed copy);
* sample throughput (samples of a 64-token prompt and 200-token response):
  `transport.SampleClient` → `SampleServer` across the processes vs the
  in-process `SampleStream` (producer thread → consumer);
* shard-to-shard sync (`distributed.shard_sync`, bfloat16, the generation
  dtype): 2 training processes, each holding half of every matrix as the
  training rules' FSDP splits it (the `embed` dimension; norms replicated),
  send to 2 generation processes that each place a full copy on one CPU
  device (generation tensor parallelism 1: their sharding forces the full
  copy). One sync = from both senders starting to cut their shards to both
  receivers' acknowledgement (the slower sender's `wait_ack` time); compared
  with a memcpy (`np.copyto`) of one receiver's bytes in this process, same
  run, and with the path it replaces (training process 0 sends a gathered
  copy to each receiver; the other sends nothing), alternated `--rounds`
  times (the best round of each is reported); with `--xla_transfer` also the
  device-to-device path (`pipeline.weight_transport="xla"`). `--shards_only`
  runs just this part.

`--pin` pins this process to the first allowed CPU and the child to the
second (DESIGN.md §5). Times are medians over `--reps` after one warm-up.
The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamrl_jax.distributed import (  # noqa: E402
    reshard,
    shard_receiver,
    shard_sync,
    shard_wire,
    wire,
    xla_pull,
)
from streamrl_jax.distributed.messages import SpanReport  # noqa: E402
from streamrl_jax.distributed.transport import SampleClient, SampleServer  # noqa: E402
from streamrl_jax.generation.types import RequestTag, Sample, Timings  # noqa: E402
from streamrl_jax.stream.sample_stream import SampleStream  # noqa: E402

DTYPES = ("float32", "bfloat16")
TIMEOUT_S = 300.0


def smollm2_params(dtype: str, seed: int = 0, abstract: bool = False) -> dict:
    """Random params with SmolLM2-135M's shapes (tied embeddings: no separate LM head);
    `abstract`: their shapes and dtype only (what a receiver declares it needs)."""
    vocab, width, layers, heads, kv_heads, head_dim, mlp = 49152, 576, 30, 9, 3, 64, 1536
    rng = np.random.default_rng(seed)

    def w(*shape):
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    layer = lambda: {  # noqa: E731
        "attn_norm": w(width),
        "q": w(width, heads * head_dim),
        "k": w(width, kv_heads * head_dim),
        "v": w(width, kv_heads * head_dim),
        "o": w(heads * head_dim, width),
        "mlp_norm": w(width),
        "gate": w(width, mlp),
        "up": w(width, mlp),
        "down": w(mlp, width),
    }
    return {"embed": w(vocab, width), "layers": [layer() for _ in range(layers)], "norm": w(width)}


# Leaves the training rules shard over "fsdp" on their `embed` dimension (0 or 1);
# the norms are replicated (sharding.TRAIN_RULES).
_FSDP_DIM = {"embed": 1, "q": 0, "k": 0, "v": 0, "gate": 0, "up": 0, "o": 1, "down": 1}


def fsdp_sources(params: dict, processes: int, gathered: bool = False) -> tuple[tuple, dict, list]:
    """(leaf layouts, {process: per leaf [box]}, per process {(leaf, box): its shard}) of
    `params` split over `processes` training processes as FSDP splits them; `gathered`:
    process 0 holds everything and the others nothing (the path before shard-to-shard
    sync: the first training process sent a gathered copy)."""
    leaves = shard_wire.layouts(params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    sources: dict[int, list] = {p: [] for p in range(processes)}
    shards: list[dict] = [{} for _ in range(processes)]
    for i, (path, x) in enumerate(flat):
        dim = _FSDP_DIM.get(getattr(path[-1], "key", None))
        for p in range(processes):
            box = [(0, n) for n in x.shape]
            if gathered:
                sources[p].append([tuple(box)] if p == 0 else [])
                if p == 0:
                    shards[p][(i, tuple(box))] = x
                continue
            if dim is not None:
                size = x.shape[dim] // processes
                box[dim] = (p * size, (p + 1) * size)
            box = tuple(box)
            sources[p].append([box])
            # Its own contiguous array, as a device shard is (not a view of the whole).
            whole = tuple((0, n) for n in x.shape)
            shards[p][(i, box)] = np.ascontiguousarray(x[reshard.relative(box, whole)])
    return leaves, sources, shards


def smollm2_shardings(sharding) -> dict:
    """`sharding` for every leaf of `smollm2_params`' tree (weights arrive without one)."""
    keys = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")
    return {
        "embed": sharding,
        "layers": [dict.fromkeys(keys, sharding) for _ in range(30)],
        "norm": sharding,
    }


def make_samples(n: int, prompt_len: int = 64, response_len: int = 200) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [
        Sample(
            request_id=i,
            prompt=rng.integers(0, 49152, prompt_len, dtype=np.int32),
            response=rng.integers(0, 49152, response_len, dtype=np.int32),
            logprobs=rng.standard_normal(response_len).astype(np.float32),
            sampling_logprobs=rng.standard_normal(response_len).astype(np.float32),
            finish_reason="stop",
            policy_version=1,
            last_policy_version=1,
            instance_id=0,
            timings=Timings(enqueue=0.0, admit=1.0, finish=2.0),
            tag=RequestTag(batch=0, group=i // 8, member=i % 8, prompt_id=f"bench/{i // 8}"),
        )
        for i in range(n)
    ]


def _report(kind: str, **figures: float) -> SpanReport:
    """A child's figures for the parent, as a wire message (nothing crosses pickled)."""
    return SpanReport(track="bench", name=kind, t0=0.0, t1=0.0, args=figures)


# ---------------------------------------------------------------------- child (receiver)
def child(args: argparse.Namespace) -> None:
    key = os.environ["STREAMRL_AUTHKEY"].encode()
    report = SampleClient(args.samples, authkey=key, timeout_s=TIMEOUT_S, name="bench-gen")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = smollm2_shardings(sharding)
    xla = None
    if args.xla:
        from jax.experimental import transfer

        xla_server = transfer.start_transfer_server(
            jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
        )
        xla = xla_server.connect(args.xla)
    for d, (dtype, address) in enumerate(zip(DTYPES, args.weights.split(","), strict=True)):
        need = shard_wire.need_of(shardings, smollm2_params(dtype, abstract=True), 0)
        receiver = shard_receiver.ShardReceiver(
            [address], need, authkey=key, timeout_s=TIMEOUT_S, name=f"bench-gen-{dtype}"
        )
        for _ in range(args.reps + 1):
            params, version, stats = receiver.receive(shardings, TIMEOUT_S)
            report.send(_report("weights", **stats.report()))
        if xla is not None:
            specs = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params
            )
            leaves, treedef = jax.tree.flatten(specs)
            for rep in range(args.reps + 1):
                t0 = time.perf_counter()
                pulled = jax.block_until_ready(xla.pull(100 * d + rep, leaves))
                seconds = time.perf_counter() - t0
                exact = (
                    all(
                        np.asarray(a).tobytes() == np.asarray(b).tobytes()
                        for a, b in zip(pulled, jax.tree.leaves(params), strict=True)
                    )
                    if rep == args.reps
                    else None
                )
                del pulled
                report.send(_report("xla", seconds=seconds, exact=float(bool(exact))))
        del params
        receiver.close(TIMEOUT_S)
    samples = make_samples(args.num_samples)
    report.send(_report("samples_start"))
    for s in samples:
        report.send(s)
    report.close(TIMEOUT_S)


def shard_child(args: argparse.Namespace) -> None:
    """One process of the shard-to-shard part: training `--index` or a generation process."""
    key = os.environ["STREAMRL_AUTHKEY"].encode()
    name = f"bench-{args.shard_role}-{args.index}"  # one live peer per name (rejoin rule)
    report = SampleClient(args.samples, authkey=key, timeout_s=TIMEOUT_S, name=name)
    params = smollm2_params("bfloat16")
    reps = args.reps + 1
    pull = xla_pull.PullServer("127.0.0.1", jax.devices()[0]) if args.xla_shards else None
    if args.shard_role == "training":
        sender = shard_sync.ShardSender(
            "127.0.0.1:0", authkey=key, process=args.index, num_receivers=2,
            timeout_s=TIMEOUT_S, name=f"training-{args.index}", xla=pull,
        )  # fmt: skip
        report.send(_report("address", index=args.index, port=sender.address[1]))
        leaves, sources, shards = fsdp_sources(params, 2, args.gathered)
        del params
        plan = sender.plan(leaves, sources, TIMEOUT_S)
        mine = shards[args.index]
        if pull is not None:  # device arrays, offered device to device
            mine = jax.block_until_ready(jax.device_put(mine, jax.devices()[0]))
        for version in range(reps):
            send = sender.send_shards if pull is None else sender.send_device_shards
            stats = send(plan, mine, version, wait_ack=True)
            report.send(_report("shard_send", index=args.index, version=version, **{
                "seconds": stats.seconds, "pack_s": stats.pack_s, "bytes": stats.total_bytes,
            }))  # fmt: skip
        sender.close(TIMEOUT_S)
    else:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = smollm2_shardings(sharding)
        need = shard_wire.need_of(shardings, params, args.index)
        receiver = shard_receiver.ShardReceiver(
            args.senders.split(","), need, authkey=key, timeout_s=TIMEOUT_S,
            name=f"generation-{args.index}", xla=pull,
        )  # fmt: skip
        for version in range(reps):
            got, _, stats = receiver.receive(shardings, TIMEOUT_S)
            exact = version < reps - 1 or all(
                np.asarray(a).tobytes() == np.asarray(b).tobytes()
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True)
            )
            del got
            report.send(_report("shard_receive", index=args.index, version=version, **{
                "seconds": stats.seconds, "wire_s": stats.wire_s, "place_s": stats.place_s,
                "bytes": stats.total_bytes, "exact": float(exact),
                **{k: float(v) for k, v in stats.bytes.items()},
            }))  # fmt: skip
        receiver.close(TIMEOUT_S)
    report.close(TIMEOUT_S)


def run_shards(
    args: argparse.Namespace, key: str, gathered: bool = False, xla: bool = False
) -> dict:
    """2 training -> 2 generation processes, shard to shard (module docstring); `gathered`:
    training process 0 sends everything (the old path, for comparison); `xla`: the pieces
    pulled device to device (`jax.experimental.transfer`)."""
    server = SampleServer(
        "127.0.0.1:0", authkey=key.encode(), capacity=256, timeout_s=TIMEOUT_S,
        num_producers=4, name="bench-parent",
    )  # fmt: skip
    env = dict(os.environ, STREAMRL_AUTHKEY=key, TF_CPP_MIN_LOG_LEVEL="3")
    base = [
        sys.executable, os.path.abspath(__file__), "--child", "--reps", str(args.reps),
        "--samples", f"127.0.0.1:{server.address[1]}",
        *(["--gathered"] if gathered else []), *(["--xla_shards"] if xla else []),
    ]  # fmt: skip
    procs = []
    try:
        for t in range(2):
            cmd = [*base, "--shard_role", "training", "--index", str(t)]
            procs.append(subprocess.Popen(cmd, env=env))
        ports = {}
        while len(ports) < 2:
            msg = server.get(TIMEOUT_S)
            ports[int(msg.args["index"])] = int(msg.args["port"])
        senders = ",".join(f"127.0.0.1:{ports[t]}" for t in range(2))
        for g in range(2):
            cmd = [*base, "--shard_role", "generation", "--index", str(g), "--senders", senders]
            procs.append(subprocess.Popen(cmd, env=env))
        sends, receives = [], []
        for _ in range(4 * (args.reps + 1)):
            msg = server.get(TIMEOUT_S)
            (sends if msg.name == "shard_send" else receives).append(msg.args)
        for p in procs:
            p.wait(60)
            if p.returncode:
                raise RuntimeError(f"shard bench child {p.args[-1]} failed (rc {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    steady = range(1, args.reps + 1)  # version 0 is the warm-up
    sync = [max(s["seconds"] for s in sends if s["version"] == v) for v in steady]
    per_receiver = receives[0]["bytes"]
    src = np.random.default_rng(0).integers(0, 255, int(per_receiver), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: touch the pages
    memcpy = []
    for _ in range(max(3, args.reps)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t0)
    row = {
        "bytes_per_receiver": int(per_receiver),
        "bytes_per_sender": {
            f"training-{t}": int(median([s["bytes"] for s in sends if s["index"] == t]))
            for t in range(2)
        },
        "sync_s": median(sync),
        "receiver_s": median([r["seconds"] for r in receives if r["version"] > 0]),
        "receiver_place_s": median([r["place_s"] for r in receives if r["version"] > 0]),
        "sender_pack_s": median([s["pack_s"] for s in sends if s["version"] > 0]),
        "exact": all(r["exact"] == 1.0 for r in receives),
        "memcpy_s": median(memcpy),
    }
    row["sync_gbps"] = 2 * per_receiver / row["sync_s"] / 1e9  # both receivers' bytes
    row["memcpy_gbps"] = per_receiver / row["memcpy_s"] / 1e9
    row["sync_over_memcpy"] = row["sync_gbps"] / row["memcpy_gbps"]
    name = "gathered" if gathered else "shards_xla" if xla else "shards"
    print(f"{name}: " + json.dumps(row), flush=True)
    return row


def shard_figures(args: argparse.Namespace, key: str) -> dict:
    """Shard-to-shard sync and the gathered path (one sender), alternated `--rounds` times."""
    rows = {"shards": [], "gathered": [], **({"shards_xla": []} if args.xla_transfer else {})}
    for _ in range(args.rounds):
        rows["shards"].append(run_shards(args, key))
        rows["gathered"].append(run_shards(args, key, gathered=True))
        if args.xla_transfer:
            rows["shards_xla"].append(run_shards(args, key, xla=True))
    out = {name: min(runs, key=lambda r: r["sync_s"]) for name, runs in rows.items()}
    for name, runs in rows.items():
        out[name]["sync_s_per_round"] = [r["sync_s"] for r in runs]
    out["shards_over_gathered_speedup"] = out["gathered"]["sync_s"] / out["shards"]["sync_s"]
    return out


# ---------------------------------------------------------------------- parent (sender)
def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def in_process_samples(samples: list[Sample]) -> float:
    stream = SampleStream(group_size=1, group_key=lambda s: s.request_id, capacity=256)

    def produce():
        for s in samples:
            stream.put(s, timeout=TIMEOUT_S)

    producer = threading.Thread(target=produce)
    t0 = time.perf_counter()
    producer.start()
    for _ in samples:
        stream.get_groups(min_groups=1, max_groups=1, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - t0
    producer.join(TIMEOUT_S)
    return len(samples) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 reps, 2000 samples")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--num_samples", type=int, default=None)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--xla_transfer", action="store_true")
    parser.add_argument("--shards_only", action="store_true", help="only the shard-to-shard part")
    parser.add_argument("--rounds", type=int, default=None, help="alternations (quick: 1, else 3)")
    parser.add_argument("--gathered", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--xla_shards", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--weights", "--samples", "--xla", "--senders", "--shard_role"):  # children's
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.reps = args.reps or (3 if args.quick else 10)
    args.num_samples = args.num_samples or (2000 if args.quick else 10000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.child:
        return shard_child(args) if args.shard_role else child(args)

    key = secrets.token_hex(16)
    machine = f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}, CPU"
    if args.shards_only:
        print(json.dumps({**shard_figures(args, key), "machine": machine, "reps": args.reps}))
        return
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        os.sched_setaffinity(0, {cpus[0]})
    dev0, dev1 = jax.devices()[:2]
    # One sender per dtype: a receiver declares the tree (dtypes included) it needs.
    senders = [
        shard_sync.ShardSender(
            "127.0.0.1:0", authkey=key.encode(), process=0, num_receivers=1,
            timeout_s=TIMEOUT_S, name="bench-train",
        )
        for _ in DTYPES
    ]  # fmt: skip
    server = SampleServer(
        "127.0.0.1:0", authkey=key.encode(), capacity=256, timeout_s=TIMEOUT_S, name="bench-train"
    )
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child",
        "--weights", ",".join(f"127.0.0.1:{s.address[1]}" for s in senders),
        "--samples", f"127.0.0.1:{server.address[1]}",
        "--reps", str(args.reps), "--num_samples", str(args.num_samples),
    ]  # fmt: skip
    xla_server = None
    if args.xla_transfer:
        from jax.experimental import transfer

        xla_server = transfer.start_transfer_server(dev0.client, "127.0.0.1:0", ["127.0.0.1:0"])
        cmd += ["--xla", xla_server.address()]
    if args.pin:
        cmd = ["taskset", "-c", str(cpus[1 % len(cpus)]), *cmd]
    env = dict(os.environ, STREAMRL_AUTHKEY=key, TF_CPP_MIN_LOG_LEVEL="3")
    child_proc = subprocess.Popen(cmd, env=env)
    try:
        result = run_parent(args, senders, server, xla_server, dev0, dev1)
    finally:
        for sender in senders:
            sender.close()
        server.close()
        try:
            child_proc.wait(60)
        except subprocess.TimeoutExpired:
            child_proc.kill()
    result.update(shard_figures(args, key))
    result.update(machine=machine, pinned=args.pin, reps=args.reps)
    print(json.dumps(result))


def run_parent(args, senders, server, xla_server, dev0, dev1) -> dict:
    out: dict = {"weights": {}, "params": None}
    version = 0
    for d, dtype in enumerate(DTYPES):
        params = jax.device_put(smollm2_params(dtype), dev0)
        jax.block_until_ready(params)
        out["params"] = sum(x.size for x in jax.tree.leaves(params))
        if xla_server is not None:
            for rep in range(args.reps + 1):
                xla_server.await_pull(100 * d + rep, jax.tree.leaves(params))
        sends = []
        for _ in range(args.reps + 1):
            sends.append(senders[d].send(params, version, wait_ack=True))
            version += 1
        received = [server.get(TIMEOUT_S) for _ in range(args.reps + 1)]
        xla = [server.get(TIMEOUT_S) for _ in range(args.reps + 1)] if xla_server else []
        local = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            moved = jax.block_until_ready(jax.device_put(params, dev1))
            local.append(time.perf_counter() - t0)
            del moved
        nbytes = sends[0].total_bytes
        row = {
            "bytes": nbytes,
            "cross_process_s": median([s.seconds for s in sends[1:]]),
            "sender_pack_s": median([s.pack_s for s in sends[1:]]),
            "receiver_wire_s": median([r.args["wire_s"] for r in received[1:]]),
            "receiver_place_s": median([r.args["place_s"] for r in received[1:]]),
            "in_process_device_put_s": median(local[1:]),
        }
        row["cross_process_gbps"] = nbytes / row["cross_process_s"] / 1e9
        row["in_process_gbps"] = nbytes / row["in_process_device_put_s"] / 1e9
        if xla:
            row["xla_transfer_s"] = median([x.args["seconds"] for x in xla[1:]])
            row["xla_transfer_gbps"] = nbytes / row["xla_transfer_s"] / 1e9
            row["xla_transfer_exact"] = bool(xla[-1].args["exact"])
        out["weights"][dtype] = row
        print(f"weights {dtype}: " + json.dumps(row), flush=True)
        del params

    start = server.get(TIMEOUT_S)
    assert start.name == "samples_start", start
    t0 = time.perf_counter()
    for _ in range(args.num_samples):
        server.get(TIMEOUT_S)
    cross = args.num_samples / (time.perf_counter() - t0)
    samples = make_samples(args.num_samples)
    out["samples"] = {
        "count": args.num_samples,
        "response_tokens": 200,
        "wire_bytes": len(wire.encode(samples[0])),
        "cross_process_per_s": cross,
        "in_process_per_s": in_process_samples(samples),
    }
    print("samples: " + json.dumps(out["samples"]), flush=True)
    return out


if __name__ == "__main__":
    main()
