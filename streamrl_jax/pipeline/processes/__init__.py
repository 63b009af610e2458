"""One process of a multi-controller run: join the program, run this process's role.

`run_process` is what `launch.py` calls on every process when the environment
names several (`distributed/roles.py`): it checks every rule on the settings with
the process counts (`config.check`; on every process, before joining, so all fail
alike and none waits for a coordinator), joins with `roles.initialize`, checks again
with the joined program's counts, and runs `generation.run_generation`,
`training.run_training` or `scoring.run_scoring`.

The sub-package: `plan` (the layout's keys and constants), `training` (a training
process: its link to the generation processes), `generation` (a generation process),
`roster` (who generates what, and what a lost process leaves), `roster_share` (a
generation process's share under the roster), `learners` (several learners: each a run
of its own on the program), `scoring` (a scoring process: the run's judge, served to the
training processes). The core of `pipeline/` never imports
it (`tests/layering_test.py`).
"""

from __future__ import annotations

from streamrl_jax import metrics
from streamrl_jax.config import ExperimentConfig, Processes, check
from streamrl_jax.distributed import roles
from streamrl_jax.pipeline.processes import learners
from streamrl_jax.pipeline.processes.generation import run_generation
from streamrl_jax.pipeline.processes.scoring import run_scoring
from streamrl_jax.pipeline.processes.training import run_training
from streamrl_jax.pipeline.step_metrics import RunResult


def run_process(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig
) -> RunResult | None:
    """Joins the program and runs this process's role (the training process returns the
    run's result, a generation or scoring process None). The caller then calls
    `jax.distributed.shutdown()`."""
    g, s = dcfg.generation_processes, dcfg.scoring_processes
    check(cfg, Processes(total=dcfg.num_processes, generation=g, scoring=s))
    r = roles.initialize(dcfg)
    g, s = len(r.generation_processes), len(r.scoring_processes)
    check(cfg, Processes(total=r.num_processes, generation=g, scoring=s))
    metrics.set_writer_process(r.training_processes[0])  # it has the metrics
    if r.role == "scoring":
        run_scoring(cfg, dcfg, r)
        return None
    if cfg.learners:  # several learners: each a run of its own on the program
        if r.role == "generation":
            learners.run_generation_learners(cfg, workdir, dcfg, r)
            return None
        return learners.run_training_learner(cfg, workdir, dcfg, r)
    if r.role == "generation":
        run_generation(cfg, workdir, dcfg, r)
        return None
    return run_training(cfg, workdir, dcfg, r)
