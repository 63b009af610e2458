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

from typing import Any

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.protocol import Accumulators, Context, Metrics, Micro, Target
from streamrl_jax.trainer import critic as critic_lib
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import critic_trainer_config
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer

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
    critic = Critic(trainer, trainer.init_state(ctx.cfg.seed))
    return Target(NAME, fill=critic.fill, trains=critic)


class Critic:
    """The critic's trainer and state (the state changes only here: `apply`, `restore`)."""

    def __init__(self, trainer: Trainer, state: TrainState):
        self.trainer, self.state = trainer, state

    def fill(self, dev: TrainBatch, micro: Micro) -> TrainBatch:
        del micro
        return self.trainer.fill_gae(self.state.params, dev)

    def init_accumulators(self) -> Accumulators:
        return {NAME: self.trainer.init_accumulator()}

    def accumulate(self, dev: TrainBatch, accs: Accumulators, micro: Micro) -> Accumulators:
        acc, _ = self.trainer.accumulate(self.state, accs[NAME], dev, micro.one)
        return accs | {NAME: acc}

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        self.state, acc, m = self.trainer.apply(self.state, accs[NAME])
        return accs | {NAME: acc}, {f"{NAME}_{k}": v for k, v in m.items()}

    def arrays(self) -> dict[str, Any]:
        return {NAME: self.state}

    def restore(self, arrays: dict[str, Any]) -> None:
        self.state = arrays[NAME]
