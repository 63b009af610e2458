"""The main job's compile seconds, cold and warm (JAX's persistent compilation cache).

    python tools/bench_compile.py [--quick] [--config=configs/quickstart.py:short]
        [--workdir=/tmp/bench_compile] [--min_compile_time_secs=S]

Runs `python -m streamrl_jax.launch` on the config twice with one `--compile_cache`
directory: first emptied (cold), then as the first run left it (warm), each in a fresh
workdir. For each run it reports, from metrics.jsonl, the sum over the steps of
`compile_s` (the trainer thread's tracing and compiling inside a step) and
`precompile_s` (`pipeline.precompile`'s, before the first step), the command's wall
time (what a person waits: start-up, model load, every thread's compiling, the steps),
and the cache's entries and bytes after it. `--quick` runs the `:tiny` variant (2
steps) instead of the quickstart's `:short` (20). `--min_compile_time_secs` sets
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` for both runs (default: launch's own
setting). Each run's console is kept in `<workdir>/<cold|warm>/console.txt`. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from streamrl_jax.metrics import read_jsonl  # noqa: E402 - after the repository is on the path


def cache_size(path: str) -> tuple[int, int]:
    """Entries and bytes of a JAX compilation cache directory."""
    entries = [f for f in os.listdir(path) if f.endswith("-cache")] if os.path.isdir(path) else []
    return len(entries), sum(os.path.getsize(os.path.join(path, f)) for f in entries)


def run_once(config: str, workdir: str, cache: str, env: dict[str, str], timeout: float) -> dict:
    """One launch of `config` in a fresh `workdir` with `cache`; its figures."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    command = [
        sys.executable,
        "-m",
        "streamrl_jax.launch",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--compile_cache={cache}",
    ]
    t0 = time.perf_counter()
    with open(os.path.join(workdir, "console.txt"), "w", encoding="utf-8") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_compile: {config} did not finish within {timeout:.0f} s ({workdir})")
    wall = time.perf_counter() - t0
    if code != 0:
        with open(os.path.join(workdir, "console.txt"), encoding="utf-8") as f:
            sys.stderr.write(f.read()[-3000:])
        sys.exit(f"bench_compile: {config} exited with status {code} ({workdir}/console.txt)")
    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step_s" in r]
    entries, size = cache_size(cache)
    return {
        "steps": len(rows),
        "compile_s": round(sum(r.get("compile_s", 0.0) for r in rows), 2),
        "precompile_s": round(sum(r.get("precompile_s", 0.0) for r in rows), 2),
        "step_s": round(sum(r["step_s"] for r in rows), 2),
        "wall_s": round(wall, 2),
        "cache_entries": entries,
        "cache_mb": round(size / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the :tiny variant (2 steps)")
    parser.add_argument("--config", default="", help="default configs/quickstart.py:short")
    parser.add_argument("--workdir", default="/tmp/bench_compile")
    parser.add_argument("--min_compile_time_secs", type=float, default=None)
    parser.add_argument("--timeout_s", type=float, default=3600.0, help="per run")
    args = parser.parse_args()
    config = args.config or f"configs/quickstart.py:{'tiny' if args.quick else 'short'}"
    env = dict(os.environ)
    if args.min_compile_time_secs is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(args.min_compile_time_secs)
    cache = os.path.join(args.workdir, "jax_cache")
    shutil.rmtree(cache, ignore_errors=True)
    out: dict = {"bench": "compile", "config": config, "quick": args.quick}
    out["min_compile_time_secs"] = args.min_compile_time_secs
    for name in ("cold", "warm"):
        out[name] = run_once(config, os.path.join(args.workdir, name), cache, env, args.timeout_s)
        print(f"{name}: {out[name]}", flush=True)
    cold, warm = out["cold"], out["warm"]
    out["compile_saved_s"] = round(
        cold["compile_s"] + cold["precompile_s"] - warm["compile_s"] - warm["precompile_s"], 2
    )
    out["wall_saved_s"] = round(cold["wall_s"] - warm["wall_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
