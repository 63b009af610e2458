"""The policy as a run starts: its kind, its trainer and its first state.

The weights of `model.source` (or `init_from`: another run's checkpoint), straight
into the training sharding; with LoRA, new adapters on that base, which is what a LoRA
checkpoint's adapters go with. Several learners on one base (pipeline/learners.py) put
their new adapters on the first learner's base (`base`), nothing loaded again.
"""

from __future__ import annotations

import dataclasses

from absl import logging
from jax.sharding import Mesh

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner import targets, weights
from streamrl_jax.learner.policies import Full, Lora
from streamrl_jax.learner.protocol import Policy
from streamrl_jax.model.loader import Description, load_weights
from streamrl_jax.trainer.config import trainer_config
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer, make_policy_trainer
from streamrl_jax.weight_sync import Params

# Policy kinds by name; `policy_kind` picks one from the config.
POLICIES = {"full": lambda cfg: Full(), "lora": lambda cfg: Lora(cfg.trainer.lora)}


def policy_kind(cfg: ExperimentConfig) -> Policy:
    """The run's policy kind: "lora" when `trainer.lora.rank > 0`, else "full"."""
    return POLICIES["lora" if cfg.trainer.lora.rank else "full"](cfg)


def initial_policy(
    cfg: ExperimentConfig, d: Description, train_mesh: Mesh, base: Params | None = None
) -> tuple[Trainer, TrainState]:
    """The policy trainer and its state, the model (`d`, described with the policy's
    kind applied: `Policy.model_config`) straight into the training sharding; with
    `base` (a LoRA run's frozen params on `train_mesh`, another learner's) new adapters on
    that base, nothing loaded."""
    policy = policy_kind(cfg)
    model_cfg = d.cfg
    tcfg = trainer_config(cfg, fsdp=train_mesh.shape["fsdp"])
    tcfg = targets.trainer_config(cfg, model_cfg, tcfg)  # e.g. routing replay's sizes
    trainer = make_policy_trainer(model_cfg, tcfg, train_mesh, model_seed=cfg.seed)
    if base is not None:
        if not policy.adapters_only:
            raise ValueError("a shared base is a LoRA run's (trainer.lora.rank > 0)")
        params = policy.complete(base, trainer, cfg.seed)
        return trainer, trainer.state_from_params(params, cfg.seed)
    if cfg.model.source == "tiny":
        state = trainer.init_state(cfg.seed)
    else:  # described once: only the weights are read here (LoRA: the base's)
        plain = dataclasses.replace(d, cfg=model_cfg.replace(lora_rank=0))
        pre = load_weights(plain, mesh=train_mesh, role="train")
        state = trainer.state_from_params(policy.complete(pre.params, trainer, cfg.seed), cfg.seed)
    if cfg.init_from:
        params = weights.from_run(cfg.init_from, trainer, state.params, model_cfg)
        state = trainer.state_from_params(params, cfg.seed)
        logging.info("initial weights from %s", cfg.init_from)
    return trainer, state
