"""Host-side rewards: the `RewardFn` seam, reasoning-gym tasks, a scoring thread pool."""

from streamrl_jax.rewards.answers import extract_answer
from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.rewards.tasks import (
    DEFAULT_TASKS,
    Problem,
    TaskDataset,
    TaskReward,
    chat_messages,
)

__all__ = [
    "DEFAULT_TASKS",
    "Problem",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "TaskDataset",
    "TaskReward",
    "chat_messages",
    "extract_answer",
]
