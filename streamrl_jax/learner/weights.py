"""A policy's weights from a model file or from another run's checkpoint.

`init_from` (the run's first weights) and the distillation teacher read the same two
kinds of source; with LoRA either gives the base, and new adapters (B = 0) go on it
(`Policy.complete`).
"""

from __future__ import annotations

import os

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.errors import UserError
from streamrl_jax.learner.protocol import Policy
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.loader import describe, load_weights
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params


def from_run(
    path: str, policy: Policy, trainer: Trainer, like: Params, model_cfg: ModelConfig, seed: int
) -> Params:
    """The params of a run's checkpoint `path` (its root or a step directory) as this
    policy's, in the structure and sharding of `like` (LoRA: the checkpoint gives the
    base; the adapters start new)."""
    params = ckpt_lib.restore_params_only(
        path,
        ckpt_lib.abstract_tree(policy.loadable(like)),
        None,
        fingerprint=ckpt_lib.model_fingerprint(model_cfg),
    )
    return policy.complete(params, trainer, seed)


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
        return from_run(path, policy, trainer, like, model_cfg, cfg.seed)
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
