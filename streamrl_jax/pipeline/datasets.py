"""The run's problems: train and held-out sets, the prompt pipeline and the reward.

Read first, before any device memory or thread exists, so a bad file or task
fails at once. reasoning-gym tasks by default, or JSONL files
(docs/datasets.md); the held-out set uses `data.eval_seed` and training
excludes its questions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from streamrl_jax import environments
from streamrl_jax.config import ExperimentConfig, task_configs, task_names
from streamrl_jax.data import Prompt, PromptPipeline, tokenize
from streamrl_jax.errors import UserError
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.rewards.sandbox import Limits
from streamrl_jax.rewards.tasks import INLINE_SAFE_TASKS, Problem, TaskDataset


class ProblemSet(Protocol):
    """A training or held-out set: reasoning-gym tasks (`TaskDataset`) or a JSONL file
    (`JsonlDataset`), both `Sequence[Problem]`."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Problem: ...

    def __iter__(self) -> Iterator[Problem]: ...

    def questions(self) -> set[str]:
        """Every question's text (the training set excludes the held-out ones)."""

    def reward_fn(self, *, format_bonus: float = 0.0) -> RewardFn:
        """The scorer of this set's problems."""


def datasets(cfg: ExperimentConfig) -> tuple[ProblemSet, ProblemSet]:
    """(eval set, train set): reasoning-gym tasks, or JSONL files (docs/datasets.md)."""
    d = cfg.data
    held_out = eval_set(cfg)
    if d.jsonl_path:
        from streamrl_jax.rewards.jsonl import JsonlDataset

        train_set = JsonlDataset(
            d.jsonl_path, on_bad_row=d.bad_rows, exclude_questions=held_out.questions()
        )
        return held_out, train_set
    train_set = TaskDataset(
        task_names(d),
        seed=d.train_seed,
        size=d.train_size,
        task_configs=task_configs(d),
        exclude_questions=held_out.questions(),
    )
    return held_out, train_set


def eval_set(cfg: ExperimentConfig) -> ProblemSet:
    """The held-out set of `datasets(cfg)`, without building the training set (the
    evaluation of weights outside a run, `pipeline/evaluation.py`)."""
    d = cfg.data
    if d.jsonl_path:
        from streamrl_jax.rewards.jsonl import JsonlDataset

        return JsonlDataset(d.eval_jsonl_path, on_bad_row=d.bad_rows)
    size = max(cfg.eval.num_problems, 1)
    return TaskDataset(task_names(d), seed=d.eval_seed, size=size, task_configs=task_configs(d))


def prompts(
    cfg: ExperimentConfig, tokenizer: Tokenizer, train_set: ProblemSet, eval_set: ProblemSet
) -> tuple[PromptPipeline, list[Prompt]]:
    """The seeded training prompt pipeline and the held-out eval prompts."""
    d, g = cfg.data, cfg.generation
    # With an environment, an episode starts with its environment's messages.
    messages = environments.first_messages(cfg.environment, tokenizer)
    tools = environments.functions(cfg.environment, tokenizer)
    prompts = PromptPipeline(
        train_set,
        tokenizer,
        max_prompt_len=g.max_prompt_len,
        seed=cfg.seed,
        overlong=cfg.data.overlong_prompts,
        system_prompt=d.system_prompt,
        messages=messages,
        tools=tools,
    )
    return prompts, eval_prompts(cfg, tokenizer, eval_set)


def eval_prompts(cfg: ExperimentConfig, tokenizer: Tokenizer, eval_set: ProblemSet) -> list[Prompt]:
    """The held-out prompts: the first `eval.num_problems` of `eval_set` (0: all), as the
    run tokenises them (an environment's first messages and functions included).

    Raises:
      UserError: a prompt longer than `generation.max_prompt_len`.
    """
    d, g = cfg.data, cfg.generation
    messages = environments.first_messages(cfg.environment, tokenizer)
    tools = environments.functions(cfg.environment, tokenizer)
    held_out = [
        tokenize(p, tokenizer, d.system_prompt, messages, tools)
        for p in list(eval_set)[: cfg.eval.num_problems or len(eval_set)]
    ]
    too_long = [p.problem.prompt_id for p in held_out if len(p.tokens) > g.max_prompt_len]
    if too_long:
        raise UserError(
            f"{len(too_long)} eval prompts exceed generation.max_prompt_len={g.max_prompt_len} "
            f"(e.g. {too_long[0]})"
        )
    return held_out


def reward_fn(cfg: ExperimentConfig, train_set: ProblemSet) -> RewardFn:
    if cfg.data.reward == "vowels":
        from streamrl_jax.rewards.vowels import vowel_reward

        return vowel_reward
    return train_set.reward_fn(format_bonus=cfg.data.format_reward)


def episode_reward(cfg: ExperimentConfig, task: RewardFn) -> RewardFn:
    """The run's reward function: `task`, or with an environment the episodes' outcome
    (and `task` for the answers an environment scores)."""
    return environments.reward_fn(cfg.environment, task)


def reward_sandbox(cfg: ExperimentConfig) -> Limits | None:
    """The worker limits when the task's scorer must run sandboxed, else None (inline):
    `data.reward_sandbox`, with "auto" inline only for scorers known not to evaluate
    model text (`INLINE_SAFE_TASKS`, the JSONL reference scorer, the vowel stand-in)."""
    d = cfg.data
    inline = d.reward_sandbox == "inline" or (
        d.reward_sandbox == "auto"
        and (
            d.reward == "vowels"
            or bool(d.jsonl_path)
            or set(task_names(d)) <= set(INLINE_SAFE_TASKS)
        )
    )
    if inline:
        return None
    return Limits(timeout_s=d.reward_timeout_s, memory_mb=d.reward_memory_mb)
