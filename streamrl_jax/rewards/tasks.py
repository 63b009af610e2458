"""Verifiable reasoning tasks from `reasoning-gym`, their prompts and their reward.

`TaskDataset` wraps `reasoning_gym.create_dataset` (one task, or a weighted
mixture through reasoning-gym's `composite` dataset) and yields `Problem`s
with a stable prompt id. `TaskReward` extracts the final answer from a
response (`rewards.answers`) and scores it with the task's own scorer
(`score_answer(answer, entry)`); a scorer value >= 1.0 counts as correct.

Seeds and disjoint splits. reasoning-gym builds item `i` of seed `s` from
`Random(s + i)`, so seeds 1 and 2 share all items but one. `TaskDataset` therefore
passes `seed * SEED_STRIDE` to reasoning-gym (`size <= SEED_STRIDE`), which
makes different seeds draw from disjoint random streams; on top of that, a
train set can be given the eval set's questions as `exclude_questions` (small
template spaces, e.g. GSM-symbolic, repeat a question text now and then).
"""

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import reasoning_gym
from absl import logging
from reasoning_gym.composite import DatasetSpec

from streamrl_jax.rewards.answers import extract_answer
from streamrl_jax.rewards.base import ZERO_RESULT, RewardResult

SEED_STRIDE = 1 << 24
DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic")
SYSTEM_PROMPT = (
    "You are a careful problem solver. Think step by step, then give only the final "
    "answer inside <answer></answer> tags, for example <answer>42</answer>."
)

ScoreFn = Callable[[str | None, dict[str, Any]], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """One prompt of a task.

    Attributes:
      prompt_id: stable id `"{dataset}/{seed}/{index}"`, unique within a dataset.
      task: the reasoning-gym dataset that generated it (a mixture's component).
      question: the task's question text.
      answer: the reference answer (for logs; scoring uses the task's scorer).
      metadata: what `TaskReward` needs: `task`, `prompt_id` and the raw
        reasoning-gym `entry` (question, answer, metadata).
    """

    prompt_id: str
    task: str
    question: str
    answer: str
    metadata: dict[str, Any]


def chat_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat-format prompt asking for the final answer in `<answer>` tags."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


class TaskDataset(Sequence[Problem]):
    """A fixed-size, deterministic set of problems from reasoning-gym.

    Args:
      tasks: a dataset name (`"chain_sum"`), several names (equal weights) or
        `{name: weight}` for a mixture.
      seed: the split's seed; different seeds give disjoint random streams.
      size: number of problems (before exclusions), at most `SEED_STRIDE`.
      task_configs: optional `{name: reasoning-gym config kwargs}`.
      exclude_questions: question texts to skip (e.g. the eval split's); with
        exclusions every problem is generated up front, otherwise lazily.
    """

    def __init__(
        self,
        tasks: str | Sequence[str] | Mapping[str, float],
        *,
        seed: int,
        size: int,
        task_configs: Mapping[str, Mapping[str, Any]] | None = None,
        exclude_questions: Collection[str] = (),
    ):
        if not 0 < size <= SEED_STRIDE:
            raise ValueError(f"size={size} must be in (0, {SEED_STRIDE}]")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        weights = _weights(tasks)
        configs = dict(task_configs or {})
        if unknown := set(configs) - set(weights):
            raise ValueError(f"task_configs names {sorted(unknown)} not in tasks {sorted(weights)}")
        rg_seed = seed * SEED_STRIDE
        if len(weights) == 1:
            (name,) = weights
            self.name = name
            self._rg = reasoning_gym.create_dataset(
                name, seed=rg_seed, size=size, **configs.get(name, {})
            )
        else:
            self.name = "mixture"
            specs = [
                DatasetSpec(name=n, weight=w, config=dict(configs.get(n, {})))
                for n, w in weights.items()
            ]
            self._rg = reasoning_gym.create_dataset(
                "composite", seed=rg_seed, size=size, datasets=specs
            )
        self.seed = seed
        self.size = size
        self._entries: dict[int, dict[str, Any] | None] = {}
        self.generation_errors = 0  # items reasoning-gym failed to generate (skipped)
        self._indices: Sequence[int] = range(size)
        if exclude_questions:
            excluded = set(exclude_questions)
            self._indices = [
                i
                for i in range(size)
                if (e := self._entry(i)) is not None and e["question"] not in excluded
            ]

    def _entry(self, index: int) -> dict[str, Any] | None:
        """reasoning-gym regenerates an item on every access (slow for countdown); memoise.

        Some generators raise for some seeds (basic_arithmetic: ZeroDivisionError
        inside its own expression evaluator); such an item is None, logged and counted.
        """
        if index not in self._entries:
            try:
                self._entries[index] = self._rg[index]
            except Exception as e:  # reasoning-gym's own generator bug, not ours
                logging.warning(
                    "%s seed %d item %d: generation failed: %r", self.name, self.seed, index, e
                )
                self.generation_errors += 1
                self._entries[index] = None
        return self._entries[index]

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> Problem:  # type: ignore[override]
        index = self._indices[i]
        entry = self._entry(index)
        # Lazy mode only (eager mode filtered failures out): take the next item
        # that generates, deterministically, rather than fail the run.
        for step in range(1, self.size):
            if entry is not None:
                break
            index = (self._indices[i] + step) % self.size
            entry = self._entry(index)
        if entry is None:
            raise ValueError(f"{self.name} seed {self.seed}: no item could be generated")
        task = entry["metadata"].get("source_dataset", self.name)
        prompt_id = f"{self.name}/{self.seed}/{index}"
        return Problem(
            prompt_id=prompt_id,
            task=task,
            question=entry["question"],
            answer=str(entry["answer"]),
            metadata={"task": task, "prompt_id": prompt_id, "entry": entry},
        )

    def __iter__(self) -> Iterator[Problem]:
        return (self[i] for i in range(len(self)))

    def questions(self) -> set[str]:
        """All question texts (to exclude them from another split)."""
        return {p.question for p in self}

    def reward_fn(self, *, format_bonus: float = 0.0, partial_credit: bool = False) -> "TaskReward":
        """A `TaskReward` scoring with this dataset's own (configured) scorer."""
        return TaskReward(
            score_answer=self._rg.score_answer,
            format_bonus=format_bonus,
            partial_credit=partial_credit,
        )


def _weights(tasks: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    if isinstance(tasks, str):
        weights = {tasks: 1.0}
    elif isinstance(tasks, Mapping):
        weights = {str(k): float(v) for k, v in tasks.items()}
    else:
        weights = {str(name): 1.0 for name in tasks}
    if not weights or any(w <= 0 for w in weights.values()):
        raise ValueError(f"tasks={tasks!r}: need at least one task, all weights > 0")
    return weights


# Tasks whose reasoning-gym scorer only compares strings or parses numbers: model text
# is never evaluated, so they may score inline (data.reward_sandbox="auto"). Others
# (countdown, puzzle24, polynomial_multiplication, ... `eval` or `sympy.parse_expr` the
# answer) score in confined worker processes (rewards/sandbox.py).
INLINE_SAFE_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic")


@functools.cache
def _default_scorer(task: str) -> ScoreFn:
    return reasoning_gym.get_score_answer_fn(task)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskReward:
    """`RewardFn` for reasoning-gym problems.

    score = 1[correct] (or the raw task score with `partial_credit`)
            + format_bonus * 1[answer in closed <answer> tags],
    correct = task score >= 1.0. No extractable answer scores 0.

    Attributes:
      score_answer: the scorer `(answer, entry) -> float`; None looks up the
        default-config scorer of `metadata["task"]` in reasoning-gym.
      format_bonus: added when the answer came in `<answer>` tags.
      partial_credit: use the task's raw score (e.g. countdown's 0.05 for a
        wrong expression) instead of 1/0.
    """

    score_answer: ScoreFn | None = None
    format_bonus: float = 0.0
    partial_credit: bool = False

    def __call__(self, sample_text: str, metadata: dict[str, Any]) -> RewardResult:
        """Scores `sample_text` against `metadata["entry"]`."""
        answer, format_ok = extract_answer(sample_text)
        if answer is None:
            return ZERO_RESULT
        scorer = self.score_answer or _default_scorer(metadata["task"])
        task_score = float(scorer(answer, metadata["entry"]))
        correct = task_score >= 1.0
        score = task_score if self.partial_credit else float(correct)
        return RewardResult(
            score=score + (self.format_bonus if format_ok else 0.0),
            correct=correct,
            extracted_answer=answer,
            format_ok=format_ok,
            task_score=task_score,
        )
