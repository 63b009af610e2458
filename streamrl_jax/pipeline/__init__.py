"""The orchestration: the four modes of DESIGN.md §3 as schedules over one set of components.

Data flow, one module a job:

* `meshes`, `datasets`, `components`: the role meshes, the problems and the
  components of a run (trainers, generation instances, W_0), built once.
* `schedules`: the modes as schedules (g(b), streaming or not, in-flight weight
  updates), the version gate (per-token lag) and the weight board.
* `driver`: the generation driver (W_{g(b)}, prompts, requests, dispatch, eval).
* `ingest`: finished samples in: decode, reward, into the grouping stream; evals.
* `rollout`: partial rollout (rounds, paused samples, continuations, round closure).
* `micro_batches`: which complete groups the trainer takes next, packed.
* `trainer_loop`: accumulate per micro-batch, apply, publish W_{b+1}, step hooks.
* `hooks`: periodic actions with an `every` (checkpoint, ranker refresh, eval).
* `supervisor`: the failure latch, watchdog, shutdown, `PipelineError`.
* `step_metrics`: each step's metrics row and the run's result.
* `resume`: checkpoints at step boundaries and the exact restart.
* `parts`, `lifecycle`: the shared objects of a run; its start, train, finish.
* `shards`, `process_plan`, `training_process`, `generation_process`,
  `processes`: the same pipeline as a multi-controller program.
"""

from streamrl_jax.pipeline.lifecycle import FINAL_PARAMS, run, run_components
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.pipeline.supervisor import PipelineError

__all__ = ["FINAL_PARAMS", "PipelineError", "RunResult", "run", "run_components"]
