"""One process of a multi-controller run: join the program, run this process's role.

`run_process` is what `launch.py` calls on every process when the environment
names several (`distributed/roles.py`): it checks the settings that cannot run
across processes (on every process, before joining, so all fail alike), joins
with `roles.initialize`, and runs `generation_process.run_generation` or
`training_process.run_training`.
"""

from __future__ import annotations

from streamrl_jax import metrics
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.distributed import roles
from streamrl_jax.pipeline.processes.generation import run_generation
from streamrl_jax.pipeline.processes.plan import check_supported
from streamrl_jax.pipeline.processes.training import run_training
from streamrl_jax.pipeline.step_metrics import RunResult


def run_process(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig
) -> RunResult | None:
    """Joins the program and runs this process's role (the training process returns the
    run's result, a generation process None). The caller then calls
    `jax.distributed.shutdown()`."""
    check_supported(cfg, dcfg.num_processes, dcfg.generation_processes)
    r = roles.initialize(dcfg)
    check_supported(cfg, r.num_processes, len(r.generation_processes))
    metrics.set_writer_process(r.training_processes[0])  # it has the metrics
    if r.role == "generation":
        run_generation(cfg, dcfg, r)
        return None
    return run_training(cfg, workdir, dcfg, r)
