"""Answer-with-retry: a wrong answer is told so and may try again, up to N attempts.

Each policy message is an attempt, scored by the task's scorer (`Services.score`). A
correct attempt ends the episode with reward `discount ** (attempt - 1)` times its
score (a first-try answer is worth most); a wrong one gets the feedback message
"That is not correct. Try again." and reward 0, until `max_attempts` attempts, after
which the episode ends with the last attempt's score times the same discount (0 for a
wrong answer without partial credit). No tools.
"""

from __future__ import annotations

from typing import Any

from streamrl_jax.config import EnvironmentSection
from streamrl_jax.environments.protocol import (
    Message,
    Services,
    Start,
    State,
    StepResult,
    answered,
)
from streamrl_jax.environments.tool_calls import ToolFormat
from streamrl_jax.rewards.tasks import SYSTEM_PROMPT, chat_messages

FEEDBACK = "That is not correct. Try again."


class RetryEnvironment:
    """Up to `max_attempts` answers per episode (module docstring)."""

    name = "retry"

    def __init__(self, services: Services, *, max_attempts: int, discount: float = 0.5):
        if max_attempts < 1 or not 0.0 < discount <= 1.0:
            raise ValueError(f"retry: max_attempts={max_attempts} >= 1, discount in (0, 1]")
        self.services, self.max_attempts, self.discount = services, max_attempts, discount
        self.system_prompt = SYSTEM_PROMPT

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        del metadata
        return Start(chat_messages(question, self.system_prompt), {"attempts": 0})

    def step(self, state: State, message: str, metadata: dict[str, Any]) -> StepResult:
        attempt = state["attempts"] + 1
        r = self.services.score(message, metadata)
        info = answered(r)
        if r.correct or attempt >= self.max_attempts:
            reward = r.score * self.discount ** (attempt - 1)
            return StepResult([], reward, True, {"attempts": attempt}, info)
        feedback = [{"role": "user", "content": FEEDBACK}]
        return StepResult(feedback, 0.0, False, {"attempts": attempt}, info)

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """The task's answer at the first attempt."""
        entry = metadata.get("entry", {})
        if "answer" not in entry:
            return None
        return [{"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]

    def end(self, state: State) -> None:
        del state  # the state is pure JSON: nothing to release


def make(section: EnvironmentSection, fmt: ToolFormat, services: Services) -> RetryEnvironment:
    """The registry's entry (`environments/__init__.py`)."""
    del fmt  # no tools: the answers are scored as they are
    return RetryEnvironment(
        services, max_attempts=section.max_attempts, discount=section.attempt_discount
    )
