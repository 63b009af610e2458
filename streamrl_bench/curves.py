"""Accuracy against wall time, shared by the benchmarks that compare runs at equal time
(`tools/bench_vs_trl.py`, `tools/bench_recipes.py`): a config read as the launcher reads
it, the main job run for a wall-clock budget with a checkpoint every few steps, and the
first time a curve reaches a target. The accuracies are the package's greedy held-out
evaluation applied afterwards to every checkpoint (`streamrl_jax.pipeline.evaluation`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl_jax.config import ExperimentConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

POINTS = "points.json"  # a run's [(seconds since launch, checkpoint step)] within its budget


def config_of(spec: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The `ExperimentConfig` of `--config=<spec>` with `--config.<key>=<value>` for each
    `key=value` of `overrides`, parsed by the launcher's own flag machinery
    (ml_collections' config flags), so a run and its evaluation read the same config."""
    from absl import flags
    from ml_collections import config_flags

    from streamrl_jax import config as config_lib

    argv = ["curves", f"--config={spec}", *(f"--config.{o}" for o in overrides)]
    fv = flags.FlagValues()  # its own: the overrides are flags defined from `argv`
    config_flags.DEFINE_config_file("config", None, "config", flag_values=fv, sys_argv=argv)
    fv(argv)
    return config_lib.from_config_dict(fv.config)


def parse_run(text: str) -> tuple[str, list[str]]:
    """`name:key=value;key=value` -> (name, ["key=value", ...])."""
    name, sep, rest = text.partition(":")
    if not sep or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--run={text!r}: expected name:key=value;key=value (name: [A-Za-z0-9_-])")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"--run={text!r}: override {o!r} is not key=value")
    return name, overrides


def run_project(
    spec: str,
    overrides: Sequence[str],
    workdir: str,
    budget_s: float,
    every: int,
) -> list[tuple[float, int]]:
    """Runs `python -m streamrl_jax.launch --config=<spec>` with `overrides` for `budget_s`
    seconds (then SIGTERM: it saves its last step boundary and stops), a checkpoint every
    `every` steps (all kept) and no in-run evaluation. Returns [(seconds since launch,
    step)] of its checkpoints within the budget (step 0: the start, at 0 s), also written
    to `<workdir>/points.json`. Checkpoint k holds the weights after step k - 1's update:
    it counts at the time of step k - 1's metrics row."""
    cfg = config_of(spec, overrides)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    cmd = [
        sys.executable, "-m", "streamrl_jax.launch", f"--config={spec}",
        *(f"--config.{o}" for o in overrides),
        f"--workdir={workdir}", f"--config.checkpoint.every={every}",
        "--config.checkpoint.keep=100000", "--config.eval.at_start=false",
        f"--config.eval.every={10 * cfg.pipeline.steps}", "--config.log.progress=false",
    ]  # fmt: skip
    t0 = time.time()
    with open(os.path.join(workdir, "bench_console.txt"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None and time.time() - t0 < budget_s:
            time.sleep(1.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # saves the last step boundary, then stops
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeError(f"the run in {workdir} did not stop within 300 s") from None
        elif proc.returncode != 0:
            raise RuntimeError(
                f"the run in {workdir} failed (exit {proc.returncode}): {workdir}/bench_console.txt"
            )
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "reward" in row:
                rows[int(row["step"])] = row["time"] - t0
    ckpt_dir = os.path.join(workdir, "checkpoints")
    steps = []
    if os.path.isdir(ckpt_dir):
        steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    points = [(0.0, 0)] + [(rows[k - 1], k) for k in steps if (k - 1) in rows]
    points = [(t, k) for t, k in points if t <= budget_s]
    with open(os.path.join(workdir, POINTS), "w") as f:
        json.dump(points, f)
    return points


def read_points(workdir: str) -> list[tuple[float, int]]:
    """The points a `run_project` of `workdir` wrote."""
    with open(os.path.join(workdir, POINTS)) as f:
        return [(float(t), int(k)) for t, k in json.load(f)]


def time_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time a curve [(seconds, accuracy)] reaches `target` (None: never)."""
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"
