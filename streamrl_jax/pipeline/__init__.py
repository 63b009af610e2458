"""The orchestration: the four modes of DESIGN.md §3 as schedules over one set of components.

Two seams carry every variation of a run (DESIGN.md §8), each a protocol with its kinds
beside it; the core calls them and never branches on which kind runs:

* `rollouts/`: what a step trains (`Rollout`: which requests a batch gets and refills,
  what becomes of a returned sample, where a scored one goes, which groups a step
  trains, its metrics and checkpoint state). Kinds: `full`, `dynamic_sampling`,
  `partial` (and its trainer half across processes), the `curriculum` wrapper; chosen
  by `pipeline.rollout` through the registry in `rollouts/__init__.py`.
* `generation`: where samples come from (`Generation`): `LocalGeneration` (this
  process's service and driver), or the link to generation processes.

Below the seams: `meshes`, `datasets`, `components` (the role meshes, the problems and
the components of a run, built once); `schedules` (g(b), the version gate, the weight
board); `prompts` (the prompt source, drawn and recorded by batch); `requests`
(prompts into generation requests); `micro_batches` (scored groups: taken from the
stream, packed); `shards` (this process's share of the training); `hooks` (periodic
work, registered once); `supervisor` (the failure latch, watchdog, `PipelineError`);
`step_metrics` (each step's row and the run's result); `precompile`.

The core: `driver` (the generation driver and collector), `ingest` (finished samples
in: decode, reward, to the rollout; evaluations), `scoring` (the scoring stage: a
judge between the reward pool and the rollout), `trainer_loop` (accumulate per
micro-batch, apply, publish W_{b+1}), `resume` (checkpoints at step boundaries and the
exact restart), `parts` (the shared objects of a run), `lifecycle` (its start, train,
finish).

`learners`: several learners (`ExperimentConfig.learners`), each a whole run of the core
above with its own LoRA adapter, sharing one generation service (docs/learners.md).

`evaluation`: the run's held-out evaluation applied outside a run (any policy, a run's
checkpoint, a Hugging Face directory), for the benches and tools.

`processes/`: the same pipeline as a multi-controller program (the per-process
programs, the roster of generation processes, the layout keys); the core never
imports it (`tests/layering_test.py`).
"""

from streamrl_jax.pipeline.lifecycle import FINAL_PARAMS, run, run_components
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.pipeline.supervisor import PipelineError

__all__ = ["FINAL_PARAMS", "PipelineError", "RunResult", "run", "run_components"]
