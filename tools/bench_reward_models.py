"""A generative judge as a stage of the stream against the same judge called blocking in
the reward path, and against no judge: step time, measured side by side in one run.

    python tools/bench_reward_models.py --quick    # ~8 min: 3 launches, half the batch
    python tools/bench_reward_models.py            # 8 steps a launch, 4 launches

Four launches of the main job (`configs/quickstart.py` with `pipeline.rollout=full`: the
quickstart's dynamic sampling would refill fewer groups once a continuous verdict is in
the reward, which changes the work, not its cost), one after the other on the same cores,
as `python -m streamrl_jax.launch` runs it by default (on this 2-core CPU, one process:
the judge on a device of its own beside the generation and training devices, all on the
process's one XLA:CPU thread pool), each with a fresh compile cache (each pays its own
compiles). `--quick` (7.9 minutes here) runs the first three, 4 steps each at half the
batch (`pipeline.prompts_per_step=2`), sharing one compile cache: it checks the bench
end to end, and its ratios are not figures (2026-12-08: stage 0.997x, blocking 0.712x:
at 16 samples a step, which shapes a step compiles and trains outweighs the judge);
the figures come from the full run:

* `none`: no judge;
* `stage`: `judge.model=smollm2` (the embedded SmolLM2-135M-Instruct answering Yes or No
  to the default rubric, `judge.coef` 0.1), `judge.mode=stage`: samples stream through
  the scoring stage, 8 per forward, while generation and training go on
  (pipeline/scoring.py);
* `blocking`: the same judge with `judge.mode=blocking`: each sample's reward call runs the
  judge on that sample before it returns (a reward function that calls a judge model);
* `tenant`: the stage with `judge.placement=generation`: the judge a tenant of the
  generation service, its forwards run on the generation instance's thread between
  decode chunks, no device of its own (pipeline/tenant.py).

Step time is the median over each launch's middle steps (not the first, which starts
everything, nor the last, which has no next batch to generate beside it) of `step_s` less
the trainer thread's compile seconds (`compile_s`: shapes seen first; the sampled
lengths, and so the shapes, differ between launches once their rewards differ). Reports
`stage_over_no_judge`, `blocking_over_no_judge` and `tenant_over_no_judge` (the issue's
goal: the stage within 1.15 where blocking costs more), where each launch's time went
(the step's generation / training / waiting seconds, the process's CPU seconds, the
judge's busy seconds and a sample's seconds in the stage) and ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_QUICK = flags.DEFINE_bool(
    "quick",
    False,
    "none, stage and blocking: 4 steps at half the batch, one compile cache (< 10 min).",
)
_STEPS = flags.DEFINE_integer("steps", 8, "Steps per launch (without --quick).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_reward_models", "Where the runs write.")
_JUDGE = flags.DEFINE_string("judge", "smollm2", "judge.model of the judged launches.")
_CACHE = flags.DEFINE_string(
    "cache", "", "Compile cache of every launch ('' = a fresh one per launch: each compiles)."
)

_JUDGED = ["--config.judge.model={judge}", "--config.judge.coef=0.1"]
_LAUNCHES = {
    "none": [],
    "stage": [*_JUDGED, "--config.judge.mode=stage"],
    "blocking": [*_JUDGED, "--config.judge.mode=blocking"],
    "tenant": [*_JUDGED, "--config.judge.mode=stage", "--config.judge.placement=generation"],
}
_SHOWN = (
    "process_cpu_s",
    "time/generate_s",
    "time/train_s",
    "time/wait_s",
    "gen_busy",
    "train_busy",
    "judge/busy_s",
    "judge/stage_s",
    "judge/judged",
    "judge/masked",
)


def _launch(name: str, steps: int, cache: str, extra: list[str]) -> dict:
    """One launch (`cache`: its compile cache, "" a fresh one; `extra`: more flags); its
    middle steps, summarised."""
    workdir = os.path.join(_WORKDIR.value, name)
    shutil.rmtree(workdir, ignore_errors=True)
    cache = cache or tempfile.mkdtemp(prefix="bench_reward_models_cache_")
    cmd = [
        sys.executable,
        "-m",
        "streamrl_jax.launch",
        f"--config={os.path.join(_ROOT, 'configs', 'quickstart.py')}",
        f"--workdir={workdir}",
        f"--compile_cache={cache}",
        f"--config.pipeline.steps={steps}",
        "--config.eval.num_problems=0",
        "--config.checkpoint.every=0",
        "--config.pipeline.rollout=full",
        *(f.format(judge=_JUDGE.value) for f in _LAUNCHES[name]),
        *extra,
    ]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{name}: exit {run.returncode}\n{(run.stdout + run.stderr)[-4000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step_s" in r]
    # The middle steps: not the first (start-up), nor the last (no next batch to generate
    # beside it); each less the trainer thread's compile seconds (shapes first seen).
    timed = [r for r in rows if 1 <= r["step"] <= steps - 2]
    out = {
        "step_s": statistics.median(r["step_s"] - r["compile_s"] for r in timed),
        "steps_timed": len(timed),
        "wall_s": round(wall, 1),
        "reward": statistics.mean(r["reward"] for r in timed),
    }
    for k in _SHOWN:
        values = [r[k] for r in timed if k in r]
        if values:
            out[k] = round(statistics.mean(values), 3)
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def main(argv: list[str]) -> None:
    del argv
    quick = _QUICK.value
    steps = 4 if quick else _STEPS.value
    if steps < 3:
        raise app.UsageError("--steps must be >= 3 (the first and last steps are not timed)")
    shared = _CACHE.value or (
        tempfile.mkdtemp(prefix="bench_reward_models_cache_") if quick else ""
    )
    extra = ["--config.pipeline.prompts_per_step=2"] if quick else []
    names = ("none", "stage", "blocking") if quick else tuple(_LAUNCHES)
    got = {name: _launch(name, steps, shared, extra) for name in names}
    base = got["none"]["step_s"]
    result = {
        "bench": "reward_models",
        "judge": _JUDGE.value,
        "steps": steps,
        "quick": quick,
        "stage_over_no_judge": round(got["stage"]["step_s"] / base, 3),
        "blocking_over_no_judge": round(got["blocking"]["step_s"] / base, 3),
        "tenant_over_no_judge": round(got["tenant"]["step_s"] / base, 3)
        if "tenant" in got
        else None,
        "step_s": {name: round(r["step_s"], 2) for name, r in got.items()},
        "launches": got,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
