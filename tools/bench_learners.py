"""Two learners on one generation service against the same two runs one after the other.

    python tools/bench_learners.py --quick     # 4 steps each, 16 held-out problems (< 5 min)
    python tools/bench_learners.py             # configs/learners.py:short (20 steps each)

Three launches of the main command (`python -m streamrl_jax.launch`), one after the other
on the same cores, from the same compile cache state (`--cache`: a fresh directory per
launch by default, so every launch pays its compiles):

1. `configs/learners.py:<variant>`: both learners (`grpo`, `ppo`) in one process on one
   generation service of twice the quickstart's slots (the same per learner);
2. `configs/learners.py:<variant>/grpo`, then 3. `.../ppo`: each learner alone, the same
   config (`learner_config`: its sections over the top level's), the same steps.

Wall time is each launch's, process start to exit (model loading and compiles count).
Reports both totals, `ratio` = shared / sequential (the issue's goal: <= 0.6), and each
learner's held-out accuracy at its last step in both settings (greedy, the config's
held-out problems), and ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_VARIANT = flags.DEFINE_string("variant", "short", "configs/learners.py variant: short | tiny.")
_QUICK = flags.DEFINE_bool("quick", False, "4 steps each, 16 held-out problems (< 5 min).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_learners", "Where the runs write.")
_CACHE = flags.DEFINE_string(
    "cache", "", "Compile cache for every launch ('' = a fresh one per launch: cold)."
)
_LEARNERS = ("grpo", "ppo")


def _launch(config: str, workdir: str, overrides: list[str]) -> float:
    """Runs the main command; its wall seconds."""
    shutil.rmtree(workdir, ignore_errors=True)
    cache = _CACHE.value or tempfile.mkdtemp(prefix="bench_learners_cache_")
    cmd = [
        sys.executable,
        "-m",
        "streamrl_jax.launch",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--compile_cache={cache}",
        "--processes=one",
        *overrides,
    ]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if not _CACHE.value:
        shutil.rmtree(cache, ignore_errors=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    print(f"{config}: {wall:.1f} s", flush=True)
    return wall


def _final_accuracy(workdir: str) -> float | None:
    """The held-out accuracy of the last evaluation in a run's metrics.jsonl."""
    last = None
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "eval/accuracy" in row:
                last = row["eval/accuracy"]
    return last


def main(argv: list[str]) -> None:
    del argv
    variant = _VARIANT.value
    overrides = []
    if _QUICK.value:
        steps = 4
        overrides = [
            f"--config.pipeline.steps={steps}",
            "--config.eval.num_problems=16",
            "--config.eval.at_start=false",
            f"--config.eval.every={steps}",
            "--config.checkpoint.every=0",
        ]
    root = _WORKDIR.value
    config = f"configs/learners.py:{variant}"
    # A learner's sections are filled in from the top level's: the overrides reach both.
    shared = _launch(config, os.path.join(root, "shared"), overrides)
    alone = {
        name: _launch(f"{config}/{name}", os.path.join(root, name), overrides) for name in _LEARNERS
    }
    sequential = sum(alone.values())
    accuracy = {
        name: {
            "shared": _final_accuracy(os.path.join(root, "shared", name)),
            "alone": _final_accuracy(os.path.join(root, name)),
        }
        for name in _LEARNERS
    }
    out = {
        "bench": "learners",
        "variant": variant,
        "quick": _QUICK.value,
        "shared_s": round(shared, 1),
        "alone_s": {k: round(v, 1) for k, v in alone.items()},
        "sequential_s": round(sequential, 1),
        "ratio": round(shared / sequential, 3),
        "accuracy": accuracy,
        "cores": len(os.sched_getaffinity(0)),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"two learners on one service: {shared:.1f} s; one after the other: {sequential:.1f} s "
        f"({' + '.join(f'{k} {v:.1f}' for k, v in alone.items())}); ratio {out['ratio']}"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
