"""Greedy held-out accuracy of any policy, outside a run: the run's own evaluation.

A run evaluates its policy in-flight: the held-out prompts (`datasets`), one greedy
request each (`Requests.held_out`), scored by the task's reward function (`ingest`).
`Evaluator` applies that same evaluation to weights that are not a running policy:
a run's checkpoint (`policy`: LoRA-aware, `checkpoint.policy_params`), the model it
started from, or a Hugging Face directory, on one device with the run's engine config
(`components.engine_config`). The benchmarks that compare runs at equal wall time
(`streamrl_bench.curves`) and `tools/pass_at_k.py` read their accuracies here.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from streamrl_jax.checkpoint.policy import policy_params
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import Prompt, tokenize
from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine import Engine
from streamrl_jax.model import llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.loader import Pretrained, load_pretrained, single_device_mesh
from streamrl_jax.pipeline import components
from streamrl_jax.pipeline import datasets as datasets_lib
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.weight_sync import Params

ENGINE_SLOTS = 32  # the evaluator's engine batch


@dataclasses.dataclass(frozen=True)
class Policy:
    """Weights an engine serves: the model's structure, its params and its config (a
    LoRA policy's with its adapters, which the engine merges as a run's generation side
    merges them)."""

    graphdef: nnx.GraphDef
    params: Params
    model_cfg: ModelConfig


def with_eval_seed(cfg: ExperimentConfig, eval_seed: int, problems: int = 0) -> ExperimentConfig:
    """`cfg` evaluating the held-out set of `eval_seed` (`problems` of them; 0: the
    config's `eval.num_problems`)."""
    data = dataclasses.replace(cfg.data, eval_seed=eval_seed)
    cfg = dataclasses.replace(cfg, data=data)
    if problems:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_problems=problems))
    return cfg


def run_policy(
    run_cfg: ExperimentConfig, base: Pretrained, checkpoint: str | os.PathLike | None
) -> Policy:
    """The policy of a run of `run_cfg` at `checkpoint` (a checkpoint root or one step
    directory; None: as the run started) over `base`, the model it started from as
    loaded (`model.source` or `init_from`'s, on the devices the policy should be on): a
    LoRA run's adapters on it (`checkpoint.policy_params`)."""
    model_cfg = components.describe_model(run_cfg).cfg
    if model_cfg.lora_rank == 0:
        start = base.params
        params = start if checkpoint is None else policy_params(model_cfg, checkpoint, start)
        return Policy(base.graphdef, params, base.cfg)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: llama.create(model_cfg)))
    # New adapters with A = B = 0 are exactly the base: the run's policy at step 0.
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract.filter(nnx.LoRAParam))
    sharding = jax.tree.leaves(base.params)[0].sharding
    start = nnx.merge_state(base.params, jax.device_put(zeros, sharding))
    params = start if checkpoint is None else policy_params(model_cfg, checkpoint, start)
    return Policy(graphdef, params, model_cfg)


class Evaluator:
    """Greedy held-out accuracy of any policy with the run's engine config and scorer.

    `cfg` fixes the task, the held-out problems (its `data.eval_seed`, or `eval_seed`),
    the prompt, the response cap and the engine; the base model (`model.source`) is
    loaded once onto one device. A run's checkpoint is read with that run's own config
    (`policy`).
    """

    def __init__(self, cfg: ExperimentConfig, problems: int, eval_seed: int = -1):
        """Args:
        cfg: the run's config (single-turn tasks: an environment's episodes are
          evaluated inside the run).
        problems: held-out problems evaluated (at most the held-out set's size).
        eval_seed: the held-out set's seed; < 0 keeps `data.eval_seed`.
        """
        if cfg.environment.name:
            raise UserError(
                f"environment.name={cfg.environment.name!r}: the evaluator scores single "
                "responses; an episode's held-out evaluation runs in the run (eval.every)"
            )
        if eval_seed >= 0:
            cfg = with_eval_seed(cfg, eval_seed)
        self.cfg, self.seed = cfg, cfg.data.eval_seed
        self.mesh = single_device_mesh()
        self.base = load_pretrained(components.model_path(cfg), mesh=self.mesh)
        eval_set = datasets_lib.eval_set(cfg)
        self.problems = min(problems, len(eval_set))
        tok, system = self.base.tokenizer, cfg.data.system_prompt
        self.prompts: list[Prompt] = [tokenize(q, tok, system) for q in eval_set][: self.problems]
        self.reward = eval_set.reward_fn(format_bonus=cfg.data.format_reward)
        self._requests = Requests.from_config(cfg)
        self._engines: dict[tuple[int, tuple[str, ...]], Engine] = {}
        self._version = 0

    @property
    def base_policy(self) -> Policy:
        """The model `cfg` starts from (`model.source`), as loaded."""
        return Policy(self.base.graphdef, self.base.params, self.base.cfg)

    def policy(self, run_cfg: ExperimentConfig, checkpoint: str | os.PathLike | None) -> Policy:
        """`run_policy` over the evaluator's base model."""
        return run_policy(run_cfg, self.base, checkpoint)

    def engine(self, policy: Policy) -> Engine:
        """The run's engine config with `ENGINE_SLOTS` slots holding `policy`; one engine
        per adapter shape, its weights replaced for each policy."""
        key = (policy.model_cfg.lora_rank, policy.model_cfg.lora_targets)
        engine = self._engines.get(key)
        if engine is None:
            ecfg = components.engine_config(self.cfg, self.base.tokenizer, ENGINE_SLOTS)
            engine = Engine(policy.graphdef, policy.params, policy.model_cfg, ecfg, self.mesh)
            self._engines[key] = engine
        else:
            engine.update_weights(policy.params, version=engine.version + 1)
        return engine

    def accuracy(self, policy: Policy) -> float:
        """The fraction of the held-out problems `policy` solves greedily (4 decimals):
        the run's held-out requests and scorer."""
        self._version += 1
        requests = self._requests.held_out(self._version, self.prompts)
        correct = 0
        for s in self.engine(policy).run(requests):
            text = self.base.tokenizer.decode(s.response)
            correct += self.reward(text, self.prompts[s.tag.group].problem.metadata).correct
        return round(correct / len(self.prompts), 4)

    def project(self, workdir: str, step: int, run_cfg: ExperimentConfig | None = None) -> float:
        """The accuracy of checkpoint `step` of the run in `workdir` (step 0: the model it
        started from), read with `run_cfg` (None: the evaluator's config)."""
        path = os.path.join(workdir, "checkpoints", str(step)) if step else None
        return self.accuracy(self.policy(self.cfg if run_cfg is None else run_cfg, path))

    def hf(self, path: str) -> float:
        """The accuracy of a Hugging Face directory or GGUF file of the base's structure."""
        pre = load_pretrained(path, mesh=self.mesh)
        return self.accuracy(Policy(self.base.graphdef, pre.params, self.base.cfg))
