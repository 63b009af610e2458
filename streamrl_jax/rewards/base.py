"""The reward seam: `RewardFn` protocol and its typed `RewardResult`.

Reward functions are host-side Python: they take the decoded response text of
one sample and the metadata that travelled with its prompt, and return a
`RewardResult`. They run on a thread pool (`rewards.pool`) as samples arrive.

Contract for implementations: malformed or empty output (no extractable
answer, empty string, `None`) scores 0 and never raises; an exception means a
bug or a broken scorer, and `RewardPool` decides whether it propagates
(`on_error="raise"`) or scores 0 and is counted (`on_error="zero"`).
"""

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardResult:
    """The reward of one sample.

    Attributes:
      score: the scalar reward used by the advantage estimator.
      correct: whether the task's scorer gave the answer full credit (>= 1.0).
      extracted_answer: the answer parsed from the text, None if none was found.
      format_ok: whether the answer came in the requested `<answer>` tag.
      task_score: the raw value of the task's own scorer (0 without an answer).
      error: `repr` of the exception when the pool scored a failing call as 0.
      judge: a judge's verdict in [0, 1], already in `score` (times `judge.coef`);
        None without a judge (pipeline/scoring.py).
      masked: why a reward model could not score this sample (a judge's timeout, error
        or unparsable verdict); the trainer leaves a masked sample out of its group's
        statistics and the loss. None: not masked.
    """

    score: float
    correct: bool
    extracted_answer: str | None
    format_ok: bool
    task_score: float = 0.0
    error: str | None = None
    judge: float | None = None
    masked: str | None = None


ZERO_RESULT = RewardResult(score=0.0, correct=False, extracted_answer=None, format_ok=False)


class RewardFn(Protocol):
    """Scores one decoded sample."""

    def __call__(self, sample_text: str, metadata: dict[str, Any]) -> RewardResult:
        """Returns the reward of `sample_text` given its prompt's `metadata`."""
        ...
