"""Cross-process transport vs in-process baselines (two processes on localhost).

    python tools/bench_transport.py --quick [--pin] [--xla_transfer]

Measures, with random arrays of the SmolLM2-135M shapes (30 layers, width
576, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings;
134.5 M parameters) in float32 and bfloat16:

* `streamrl_jax.distributed.weights` between this process (sender) and a
  child (receiver, placing into one CPU device): sender end-to-end time
  (device_get + crc32 + wire + receiver crc32 + device_put + acknowledgement)
  and the receiver's split (wire / verify / place);
* the in-process baseline: `jax.device_put` of the same tree from CPU device
  0 to CPU device 1 (what `weight_sync.WeightSync` does inside one process);
* with `--xla_transfer`: a `jax.experimental.transfer` pull of the same tree
  (receiver-side time; bit-exactness checked against the checksummed copy);
* sample throughput (samples of a 64-token prompt and 200-token response):
  `transport.SampleClient` → `SampleServer` across the processes vs the
  in-process `SampleStream` (producer thread → consumer).

`--pin` pins this process to the first allowed CPU and the child to the
second (DESIGN.md §5). Times are medians over `--reps` after one warm-up.
The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
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

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamrl_jax.distributed import wire  # noqa: E402
from streamrl_jax.distributed.messages import SpanReport  # noqa: E402
from streamrl_jax.distributed.transport import SampleClient, SampleServer  # noqa: E402
from streamrl_jax.distributed.weights import WeightReceiver, WeightSender  # noqa: E402
from streamrl_jax.generation.types import RequestTag, Sample, Timings  # noqa: E402
from streamrl_jax.stream.sample_stream import SampleStream  # noqa: E402

DTYPES = ("float32", "bfloat16")
TIMEOUT_S = 300.0


def smollm2_params(dtype: str, seed: int = 0) -> dict:
    """Random params with SmolLM2-135M's shapes (tied embeddings: no separate LM head)."""
    vocab, width, layers, heads, kv_heads, head_dim, mlp = 49152, 576, 30, 9, 3, 64, 1536
    rng = np.random.default_rng(seed)

    def w(*shape):
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
    receiver = WeightReceiver(args.weights, authkey=key, timeout_s=TIMEOUT_S, name="bench-gen")
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
    for d, _ in enumerate(DTYPES):
        for _ in range(args.reps + 1):
            params, version, stats = receiver.receive(shardings, TIMEOUT_S)
            report.send(_report("weights", **dataclasses.asdict(stats)))
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
    samples = make_samples(args.num_samples)
    report.send(_report("samples_start"))
    for s in samples:
        report.send(s)
    report.close(TIMEOUT_S)
    receiver.close(TIMEOUT_S)


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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--weights", "--samples", "--xla"):  # the child's peers
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.reps = args.reps or (3 if args.quick else 10)
    args.num_samples = args.num_samples or (2000 if args.quick else 10000)
    if args.child:
        return child(args)

    key = secrets.token_hex(16)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        os.sched_setaffinity(0, {cpus[0]})
    dev0, dev1 = jax.devices()[:2]
    sender = WeightSender(
        "127.0.0.1:0", authkey=key.encode(), timeout_s=TIMEOUT_S, name="bench-train"
    )
    server = SampleServer(
        "127.0.0.1:0", authkey=key.encode(), capacity=256, timeout_s=TIMEOUT_S, name="bench-train"
    )
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child",
        "--weights", f"127.0.0.1:{sender.address[1]}",
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
        result = run_parent(args, sender, server, xla_server, dev0, dev1)
    finally:
        sender.close()
        server.close()
        try:
            child_proc.wait(60)
        except subprocess.TimeoutExpired:
            child_proc.kill()
    result.update(
        machine=f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}, CPU",
        pinned=args.pin,
        reps=args.reps,
    )
    print(json.dumps(result))


def run_parent(args, sender, server, xla_server, dev0, dev1) -> dict:
    sender.wait_for_receivers(TIMEOUT_S)
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
            sends.append(sender.send(params, version, wait_ack=True))
            version += 1
        received = [server.get(TIMEOUT_S) for _ in range(args.reps + 1)]
        xla = [server.get(TIMEOUT_S) for _ in range(args.reps + 1)] if xla_server else []
        local = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            moved = jax.block_until_ready(jax.device_put(params, dev1))
            local.append(time.perf_counter() - t0)
            del moved
        nbytes = sends[0].bytes
        row = {
            "bytes": nbytes,
            "cross_process_s": median([s.seconds for s in sends[1:]]),
            "sender_pack_s": median([s.pack_s for s in sends[1:]]),
            "receiver_wire_s": median([r.args["wire_s"] for r in received[1:]]),
            "receiver_verify_s": median([r.args["verify_s"] for r in received[1:]]),
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
