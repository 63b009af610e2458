"""Trainer: sharded train state, bucketed micro-batches, streamed gradient accumulation.

See `step` for the accumulate/apply contract and `docs/trainer.md` for usage.
"""

from streamrl_jax.trainer.batch import TrainBatch, bucket, make_batch
from streamrl_jax.trainer.config import TrainerConfig, lr_schedule, make_optimizer
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
    "lr_schedule",
    "make_batch",
    "make_optimizer",
    "make_policy_trainer",
]
