"""Accuracy against wall time, shared by the benchmarks that compare runs at equal time
(`bench_vs_trl.py`, `bench_recipes.py`): a config read as the launcher reads it, the main
job run for a wall-clock budget with a checkpoint every few steps, and one greedy
held-out evaluator applied afterwards to every checkpoint (and to HF directories).

Not a benchmark itself: imported by the tools beside it (`python tools/<bench>.py` puts
this directory on `sys.path`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

POINTS = "points.json"  # a run's [(seconds since launch, checkpoint step)] within its budget


def config_of(spec: str, overrides: Sequence[str] = ()) -> Any:
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


class Evaluator:
    """Greedy held-out accuracy of a set of weights with the project's engine (the run's
    engine config, 32 slots) and scorer, on one device: the held-out evaluation of a run
    (`Requests.held_out`) and of `tools/pass_at_k.py`, applied to any weights.

    `cfg` fixes the task, the held-out problems (its `data.eval_seed`, or `eval_seed`),
    the prompt and the engine; a run's checkpoint is read with that run's own config
    (its LoRA adapters are merged by the engine, as a run's generation side merges them).
    """

    def __init__(self, cfg: Any, problems: int, eval_seed: int = -1):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        from streamrl_jax.data import tokenize
        from streamrl_jax.model.loader import load_pretrained
        from streamrl_jax.pipeline import components
        from streamrl_jax.pipeline import datasets as datasets_lib

        if eval_seed >= 0:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_seed=eval_seed))
        self.cfg, self.seed = cfg, cfg.data.eval_seed
        self.mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",))
        self.base = load_pretrained(components.model_path(cfg), mesh=self.mesh)
        eval_set, _ = datasets_lib.datasets(cfg)
        self.problems = min(problems, len(eval_set))
        tok = self.base.tokenizer
        self.prompts = [tokenize(q, tok, cfg.data.system_prompt) for q in eval_set][: self.problems]
        self.reward = eval_set.reward_fn(format_bonus=cfg.data.format_reward)
        self._engines: dict[Any, Any] = {}

    def _engine(self, graphdef: Any, params: Any, model_cfg: Any) -> Any:
        from streamrl_jax.generation.engine import Engine
        from streamrl_jax.pipeline.components import engine_config

        key = (model_cfg.lora_rank, model_cfg.lora_targets)
        if key not in self._engines:
            ecfg = engine_config(self.cfg, self.base.tokenizer, 32)
            self._engines[key] = Engine(graphdef, params, model_cfg, ecfg, self.mesh)
        return self._engines[key]

    def accuracy(self, params: Any, graphdef: Any = None, model_cfg: Any = None) -> float:
        """Greedy accuracy of `params` (the base model's structure unless `graphdef` and
        `model_cfg` say otherwise: a LoRA model's)."""
        from streamrl_jax.generation.types import GenerationRequest, SamplingParams

        graphdef = self.base.graphdef if graphdef is None else graphdef
        model_cfg = self.base.cfg if model_cfg is None else model_cfg
        engine = self._engine(graphdef, params, model_cfg)
        engine.update_weights(params, version=engine.version + 1)
        requests = [
            GenerationRequest(
                request_id=i,
                prompt=p.tokens,
                max_new_tokens=self.cfg.generation.max_new_tokens,
                sampling=SamplingParams.greedy(),
            )
            for i, p in enumerate(self.prompts)
        ]
        correct = 0
        for s in engine.run(requests):
            text = self.base.tokenizer.decode(s.response)
            correct += self.reward(text, self.prompts[s.request_id].problem.metadata).correct
        return round(correct / len(self.prompts), 4)

    def project(self, workdir: str, step: int, run_cfg: Any = None) -> float:
        """The accuracy of checkpoint `step` of the run in `workdir` (step 0: the model it
        started from), read with `run_cfg` (None: the evaluator's config)."""
        import jax
        from flax import nnx

        from streamrl_jax.checkpoint.policy import policy_params
        from streamrl_jax.model import llama
        from streamrl_jax.pipeline import components

        run_cfg = self.cfg if run_cfg is None else run_cfg
        model_cfg = components.describe_model(run_cfg).cfg
        path = os.path.join(workdir, "checkpoints", str(step))
        if model_cfg.lora_rank == 0:
            start = self.base.params
            return self.accuracy(start if step == 0 else policy_params(model_cfg, path, start))
        # LoRA: the checkpoint holds the adapters; the base is the model's source. New
        # adapters (A = B = 0) are exactly the base: the run's policy at step 0.
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: llama.create(model_cfg)))
        zeros = lambda x: jax.numpy.zeros(x.shape, x.dtype)  # noqa: E731
        adapters = jax.device_put(
            jax.tree.map(zeros, abstract.filter(nnx.LoRAParam)), jax.devices()[0]
        )
        start = nnx.merge_state(self.base.params, adapters)
        params = start if step == 0 else policy_params(model_cfg, path, start)
        return self.accuracy(params, graphdef, model_cfg)

    def hf(self, path: str) -> float:
        from streamrl_jax.model.loader import load_pretrained

        return self.accuracy(load_pretrained(path, mesh=self.mesh).params)


def time_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first time a curve [(seconds, accuracy)] reaches `target` (None: never)."""
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "unknown"
