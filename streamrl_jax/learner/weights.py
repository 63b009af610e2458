"""A policy's weights from a model file or from another run's checkpoint.

`init_from` (the run's first weights) and the distillation teacher read the same two
kinds of source: a model file (with LoRA the base, new adapters (B = 0) on it:
`Policy.complete`) or a run's checkpoint (`checkpoint.policy_params`, LoRA-aware).
"""

from __future__ import annotations

import os

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.checkpoint.policy import policy_params
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.errors import UserError
from streamrl_jax.learner.protocol import Policy
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.loader import describe, load_weights
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params


def from_run(path: str, trainer: Trainer, like: Params, model_cfg: ModelConfig) -> Params:
    """The policy of a run's checkpoint `path` (its root or a step directory) in the
    structure and sharding of `like`, the policy as this run starts
    (`checkpoint.policy_params`: LoRA-aware either way, a full run's params as this LoRA
    run's base with `like`'s new adapters, a LoRA run's adapters on `like`'s base)."""
    return policy_params(model_cfg, path, like, trainer.state_shardings.params)


def from_model_or_run(
    field: str,
    path: str,
    cfg: ExperimentConfig,
    policy: Policy,
    trainer: Trainer,
    like: Params,
    model_cfg: ModelConfig,
) -> Params:
    """`path` (the config field `field`) as this policy's params: an HF directory
    (config.json) or a GGUF file is loaded as a model of the policy's architecture; any
    other directory is a run's checkpoint (`from_run`)."""
    if not os.path.exists(path):
        raise UserError(f"{field}: {path} does not exist")
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))):
        return from_run(path, trainer, like, model_cfg)
    m = cfg.model
    other = describe(path, param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
    fingerprint = ckpt_lib.model_fingerprint
    if fingerprint(other.cfg) != fingerprint(model_cfg):
        raise UserError(
            f"{field}: {path} is another architecture than the policy "
            f"({fingerprint(other.cfg)} against {fingerprint(model_cfg)})"
        )
    params = load_weights(other, mesh=trainer.mesh, role="train").params
    return policy.complete(params, trainer, cfg.seed)
