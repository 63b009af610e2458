"""The PPO critic and its GAE advantages (`algorithm.advantage="gae"`, trainer/critic.py).

A value model of the policy's architecture with its own trainer and optimizer
(`critic.*`). Each micro-batch gets its GAE advantages and returns from the critic's
values under its weights from before its update on this batch (per sample: any split
into micro-batches gives the same targets); the critic's value-loss gradients
accumulate beside the policy's and it steps after the policy at every optimizer step
(its metrics in the row as `critic_*`). Its TrainState is part of every checkpoint
(entry "critic").
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.own_model import OwnModel
from streamrl_jax.learner.protocol import Context, Micro, Target
from streamrl_jax.trainer import critic as critic_lib
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import critic_trainer_config

NAME = "critic"


def wanted(cfg: ExperimentConfig) -> bool:
    return cfg.algorithm.advantage == "gae"


def make(ctx: Context) -> Target:
    mesh = ctx.trainer.mesh
    trainer = critic_lib.make_critic_trainer(
        ctx.model_cfg,
        critic_trainer_config(ctx.cfg, fsdp=mesh.shape["fsdp"]),
        mesh,
        model_seed=ctx.cfg.seed,
    )
    critic = OwnModel(NAME, trainer, trainer.init_state(ctx.cfg.seed))

    def fill(dev: TrainBatch, micro: Micro) -> TrainBatch:
        del micro
        return trainer.fill_gae(critic.state.params, dev)

    return Target(NAME, fill=fill, trains=critic)
