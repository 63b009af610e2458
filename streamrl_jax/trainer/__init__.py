"""Trainer: sharded train state, bucketed micro-batches, streamed gradient accumulation.

See `step` for the accumulate/apply contract, `config` for the one mapping from
an experiment (`trainer_config`, `critic_trainer_config`) and `docs/trainer.md`
for usage.
"""

from streamrl_jax.trainer.batch import TrainBatch, make_batch
from streamrl_jax.trainer.config import (
    TrainerConfig,
    critic_trainer_config,
    lr_schedule,
    make_optimizer,
    trainer_config,
)
from streamrl_jax.trainer.critic import make_critic_trainer, whiten_advantages, with_gae
from streamrl_jax.trainer.packing import bucket
from streamrl_jax.trainer.state import GradAccumulator, TrainState
from streamrl_jax.trainer.step import NonFiniteError, Trainer, make_policy_trainer

__all__ = [
    "GradAccumulator",
    "NonFiniteError",
    "TrainBatch",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "bucket",
    "critic_trainer_config",
    "lr_schedule",
    "make_batch",
    "make_critic_trainer",
    "make_optimizer",
    "make_policy_trainer",
    "trainer_config",
    "whiten_advantages",
    "with_gae",
]
