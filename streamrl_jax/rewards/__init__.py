"""Host-side rewards: the `RewardFn` seam, reasoning-gym tasks, JSONL problems, a scoring pool.

The names below load on first use (PEP 562), so that a sandboxed scorer's worker, which
imports `streamrl_jax.rewards.sandbox` and its scorer's module, does not import
reasoning-gym (0.9 s) through this package: a worker killed on a timeout is replaced in
the time Python takes to start.
"""

from streamrl_jax.lazy_names import module_attributes

_HOME = {
    "DEFAULT_TASKS": "tasks",
    "JsonlDataset": "jsonl",
    "Problem": "tasks",
    "RewardFn": "base",
    "RewardPool": "pool",
    "RewardResult": "base",
    "TaskDataset": "tasks",
    "TaskReward": "tasks",
    "chat_messages": "tasks",
    "extract_answer": "answers",
}

__all__ = sorted(_HOME)


__getattr__, __dir__ = module_attributes(__name__, _HOME, globals())
