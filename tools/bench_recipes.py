"""Recipes of the main job at equal wall time: held-out accuracy against seconds for
several runs of one config, each with its own overrides, one after the other on the same
machine for the same budget.

    python tools/bench_recipes.py --quick      # two 100 s runs, 16 problems: a smoke
    python tools/bench_recipes.py --budget_s=1500 \
        --run='full:' \
        --run='lora:trainer.lora.rank=8;trainer.lora.alpha=16;optimizer.learning_rate=2e-4' \
        --eval_seeds=2,4

Each `--run=name:key=value;key=value` is `python -m streamrl_jax.launch --config=<config>`
with those `--config.key=value` overrides (an empty list: the config as it is), run by
`curves.run_project`: a checkpoint every `--project_every` steps (all kept), no in-run
evaluation, SIGTERM at the budget; wall time runs from the launch (model loading and
compiles count). Afterwards one greedy evaluator (`pipeline.evaluation.Evaluator`: the
project's engine and scorer, 32 slots, one device) scores every checkpoint of every run on the
config's held-out problems of each `--eval_seeds` seed (`--eval_problems` of them); a
LoRA run's adapters are merged by the engine as its generation side merged them.
`--reuse=name=<workdir>` takes a finished run's checkpoints (its `points.json`, e.g. the
project's run of `bench_vs_trl.py`) instead of running it again: it must have run the
same config with the same overrides and budget. The checkpoints of the runs made here
are removed once evaluated (the quickstart's ~1.9 GB each: two 780 s runs left 25 GB),
unless `--keep_checkpoints` (a later `--reuse` needs them).

Reports each run's curve per eval seed, its best and final accuracy, and the time each
run needs to reach the first run's best; the last line is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

# The repository (streamrl_bench, streamrl_jax) from a checkout that is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from streamrl_bench import curves  # noqa: E402

_CONFIG = flags.DEFINE_string(
    "config", os.path.join(curves.ROOT, "configs", "quickstart.py"), "Config file[:variant]."
)
_RUNS = flags.DEFINE_multi_string(
    "run", [], "name:key=value;key=value (config overrides; none: the config as it is)."
)
_REUSE = flags.DEFINE_list("reuse", [], "name=workdir: a run already made (its points.json).")
_BUDGET = flags.DEFINE_float("budget_s", 1500.0, "Wall-clock budget of each run (seconds).")
_PROJECT_EVERY = flags.DEFINE_integer("project_every", 20, "Steps between checkpoints.")
_EVAL_PROBLEMS = flags.DEFINE_integer("eval_problems", 64, "Held-out problems per evaluation.")
_EVAL_SEEDS = flags.DEFINE_list("eval_seeds", [], "Held-out seeds (empty: the config's).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_recipes", "Where the runs write.")
_QUICK = flags.DEFINE_bool("quick", False, "100 s runs, 16 problems, 2-step checkpoints.")
_KEEP = flags.DEFINE_bool(
    "keep_checkpoints",
    False,
    "Keep the runs' checkpoints after their evaluation (a later --reuse needs them; the "
    "quickstart's are ~1.9 GB each, a 780 s run's ~12 GB).",
)

_QUICK_RUNS = ["base:", "lr4e-5:optimizer.learning_rate=4e-5"]


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from streamrl_jax.pipeline import evaluation

    runs = [curves.parse_run(r) for r in (_RUNS.value or (_QUICK_RUNS if _QUICK.value else []))]
    if not runs:
        raise app.UsageError("name at least one --run=name:overrides")
    names = [n for n, _ in runs]
    if len(set(names)) != len(names):
        raise app.UsageError(f"--run names repeat: {names}")
    reuse = dict(r.split("=", 1) for r in _REUSE.value)
    if set(reuse) - set(names):
        raise app.UsageError(f"--reuse names no --run: {sorted(set(reuse) - set(names))}")
    budget = 100.0 if _QUICK.value else _BUDGET.value
    every = 2 if _QUICK.value else _PROJECT_EVERY.value
    problems = 16 if _QUICK.value else _EVAL_PROBLEMS.value
    cfgs = {n: curves.config_of(_CONFIG.value, o) for n, o in runs}  # bad overrides: now
    points, dirs = {}, {}
    for name, overrides in runs:
        dirs[name] = reuse.get(name) or os.path.join(_WORKDIR.value, name)
        if name in reuse:
            points[name] = curves.read_points(dirs[name])
            print(f"{name}: {len(points[name])} checkpoints reused from {dirs[name]}", flush=True)
            continue
        t0 = time.time()
        points[name] = curves.run_project(_CONFIG.value, overrides, dirs[name], budget, every)
        print(f"{name}: {len(points[name])} checkpoints in {time.time() - t0:.0f} s", flush=True)
    seeds = [int(s) for s in _EVAL_SEEDS.value] or [cfgs[names[0]].data.eval_seed]
    results = {n: {"overrides": o, "curves": {}} for n, o in runs}
    for seed in seeds:
        ev = evaluation.Evaluator(cfgs[names[0]], problems, eval_seed=seed)
        for name in names:
            curve = []
            for seconds, step in points[name]:
                acc = ev.project(dirs[name], step, cfgs[name])
                curve.append((round(seconds, 1), acc))
                print(f"seed {seed} {name:>12} step {step:4d} at {seconds:7.1f} s: {acc:.3f}")
            results[name]["curves"][str(seed)] = curve
    for name in names:  # the runs made here: their checkpoints are evaluated
        if name not in reuse and not _KEEP.value:
            freed = _remove_checkpoints(dirs[name])
            gib = freed / 2**30
            print(f"{name}: removed its checkpoints ({gib:.1f} GiB; --keep_checkpoints keeps them)")
    first = names[0]
    for seed in map(str, seeds):
        target = max(acc for _, acc in results[first]["curves"][seed])
        for name in names:
            curve = results[name]["curves"][seed]
            r = results[name]
            r.setdefault("best", {})[seed] = max(acc for _, acc in curve)
            r.setdefault("final", {})[seed] = curve[-1][1]
            r.setdefault(f"time_to_{first}_best_s", {})[seed] = curves.time_to(curve, target)
    out = {
        "bench": "bench_recipes",
        "config": os.path.relpath(_CONFIG.value, curves.ROOT),
        "budget_s": budget,
        "eval_seeds": seeds,
        "eval_problems": problems,
        "runs": results,
        "cpu": curves.cpu_model(),
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


def _remove_checkpoints(workdir: str) -> int:
    """Deletes `workdir/checkpoints`; the bytes it held."""
    import shutil

    path = os.path.join(workdir, "checkpoints")
    size = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )
    shutil.rmtree(path, ignore_errors=True)
    return size


if __name__ == "__main__":
    app.run(main)
