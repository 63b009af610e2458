"""Host-side rewards: the `RewardFn` seam, reasoning-gym tasks, JSONL problems, a scoring pool."""

from streamrl_jax.rewards.answers import extract_answer
from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.jsonl import JsonlDataset
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
    "JsonlDataset",
    "Problem",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "TaskDataset",
    "TaskReward",
    "chat_messages",
    "extract_answer",
]
