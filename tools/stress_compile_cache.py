"""Stress JAX's persistent compilation cache the way the test suite does, to catch its crash.

Three full suite runs died of a SIGSEGV in `jax._src.compilation_cache.put_executable_and_time`
on a side thread (the ranker refresh's compile, while the test's main thread compiled
too), each time with the xdist workers and the processes the tests launch sharing one cache
directory under JAX's file lock. This script does that on purpose, many times over: each
round starts `--processes` child processes at once on one fresh cache directory; in each,
`--threads` threads (and the main thread) compile `--programs` distinct programs each
(sharded over 8 host devices, a scanned loop, an AdamW step as the ranker's, a decode-like
gather) with every compile written to the cache, then compile them all again, so reads of
entries other processes are writing meet their writes. A child killed by a signal is a
reproduction; its exit status and the tail of its output are reported.

    python tools/stress_compile_cache.py --rounds=20 --processes=2 --threads=4 --programs=12
    python tools/stress_compile_cache.py --fast_compile   # the XLA flags the suite once had

The last line printed is one JSON object: versions, the settings, rounds, children, compiles
and the crashes (each child's signal and last output lines).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

# The suite's cheaper LLVM passes, dropped in 29b79f5 after the first crash (with them)
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _programs(seed: int, count: int):
    """`count` (function, arguments) pairs whose compiled programs differ from every other
    seed's (their shapes carry the seed), so each compile is a cache miss then a hit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    explicit = (jax.sharding.AxisType.Explicit,)
    rows = NamedSharding(jax.make_mesh((len(jax.devices()),), ("d",), axis_types=explicit), P("d"))
    out = []
    for i in range(count):
        n = 8 * (seed * count + i + 1)  # a distinct shape per (seed, i)
        kind = i % 4
        if kind == 0:  # a sharded matmul chain with a reduction across devices

            def f(x, w):
                for _ in range(3):
                    x = jnp.tanh(x @ w)
                return x.sum()

            x = jax.device_put(np.ones((n, 16), np.float32), rows)
            out.append((f, (x, np.eye(16, dtype=np.float32))))
        elif kind == 1:  # a scanned recurrence (a while loop in the program)

            def f(h, xs):
                return jax.lax.scan(lambda c, v: (jnp.sin(c + v), c.sum()), h, xs)

            out.append((f, (np.zeros((n,), np.float32), np.ones((5, n), np.float32))))
        elif kind == 2:  # an AdamW step of a small model, as the ranker's refresh compiles
            tx = optax.adamw(1e-3)

            def f(p, s, x, tx=tx):
                g = jax.grad(lambda p: jnp.mean(jax.nn.gelu(x @ p["w"]) @ p["v"]))(p)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

            p = {"w": np.ones((n, 32), np.float32), "v": np.ones((32,), np.float32)}
            out.append((f, (p, tx.init(p), np.ones((4, n), np.float32))))
        else:  # a gather and an in-place update, as a decode step's cache write

            def f(cache, idx, val):
                return cache.at[idx].set(val)[idx].sum(), jnp.take(cache, idx, axis=0)

            out.append(
                (f, (np.zeros((n, 4), np.float32), np.arange(3), np.ones((3, 4), np.float32)))
            )
    return out


def _child(args: argparse.Namespace) -> None:
    """One process: threads and the main thread compiling distinct programs into the cache."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_compilation_cache_dir", args.cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", 1 << 32)  # the file lock, as the suite
    compiles = [0] * (args.threads + 1)
    errors: list[str] = []
    events = {"/jax/compilation_cache/cache_hits": 0, "/jax/compilation_cache/cache_misses": 0}

    def count(event: str, **_) -> None:  # proof that the cache was written and read
        if event in events:
            events[event] += 1

    jax.monitoring.register_event_listener(count)

    def work(slot: int) -> None:
        try:
            # Seeds: this child's slot; every process of a round shares them (`--overlap`),
            # so one process reads what another is writing, as the suite's workers do
            # (`--same`: every thread of a process too, so one key is written by several
            # threads at once)
            seed = (
                0 if args.same else slot if args.overlap else args.child * (args.threads + 1) + slot
            )
            for _ in range(2):  # the second pass: the cache's read path
                # New function objects: JAX's in-memory caches miss, the disk is read
                for f, a in _programs(seed, args.programs):
                    jax.block_until_ready(jax.jit(f)(*a))
                    compiles[slot] += 1
        except Exception as e:  # noqa: BLE001 - reported below, the child exits 1
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(s,), name=f"w{s}") for s in range(args.threads)]
    for t in threads:
        t.start()
    work(args.threads)
    for t in threads:
        t.join(timeout=600)
    hits, writes = events.values()
    report = {"compiles": sum(compiles), "hits": hits, "writes": writes, "errors": errors}
    print(json.dumps(report), flush=True)
    sys.exit(1 if errors or any(t.is_alive() for t in threads) else 0)


def _round(args: argparse.Namespace, r: int, env: dict[str, str]) -> list[dict]:
    """One round: `--processes` children at once on a fresh cache directory."""
    with tempfile.TemporaryDirectory(prefix="stress_cache_") as cache:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(c),
                    "--cache",
                    cache,
                    "--threads",
                    str(args.threads),
                    "--programs",
                    str(args.programs),
                    *(["--overlap"] if args.overlap else []),
                    *(["--same"] if args.same else []),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for c in range(args.processes)
        ]
        results = []
        for c, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=args.child_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            last = [line for line in out.splitlines() if line.startswith("{")]
            report = json.loads(last[-1]) if last else {}
            results.append({
                "round": r, "child": c, "returncode": p.returncode,
                "compiles": report.get("compiles", 0), "hits": report.get("hits", 0),
                "writes": report.get("writes", 0), "errors": report.get("errors", []),
                "tail": out.splitlines()[-8:] if p.returncode else [],
            })  # fmt: skip
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2, help="children sharing a cache")
    parser.add_argument("--threads", type=int, default=4, help="side threads per child")
    parser.add_argument("--programs", type=int, default=12, help="programs per thread")
    parser.add_argument("--overlap", action="store_true", help="children compile alike")
    parser.add_argument("--same", action="store_true", help="all threads compile alike")
    parser.add_argument("--fast_compile", action="store_true", help=f"XLA_FLAGS+={_FAST_COMPILE}")
    parser.add_argument("--child_timeout", type=float, default=900.0)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
    if args.fast_compile:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
    t0, children = time.monotonic(), []
    for r in range(args.rounds):
        children += _round(args, r, env)
        bad = [c for c in children if c["round"] == r and c["returncode"]]
        print(f"round {r}: {len(bad)} of {args.processes} children failed", file=sys.stderr)
    import jax
    import jaxlib

    crashes = [c for c in children if c["returncode"] and c["returncode"] < 0]
    failures = [c for c in children if c["returncode"] and c["returncode"] > 0]
    print(json.dumps({
        "python": platform.python_version(), "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "xla_flags": env.get("XLA_FLAGS", ""),
        "rounds": args.rounds, "processes": args.processes, "threads": args.threads + 1,
        "programs": args.programs, "overlap": args.overlap, "same": args.same,
        "children": len(children), "compiles": sum(c["compiles"] for c in children),
        "cache_writes": sum(c["writes"] for c in children),
        "cache_hits": sum(c["hits"] for c in children),
        "seconds": round(time.monotonic() - t0, 1),
        "crashes": crashes, "failures": failures,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
