"""The environment seam: what an episode's turns are answered with (DESIGN.md §9).

An environment is host Python, chosen from the config by name (`environment.name`,
the registry in `environments/__init__.py`). It never sees tokens, only messages:

* `start(question, metadata) -> Start`: the episode's first messages (the system
  prompt, with the tools it offers, and the task) and its state;
* `step(state, message, metadata) -> StepResult`: the policy's complete message of
  this turn (and the task's metadata, as `start` got it) ->
  the observation (messages appended to the conversation: tool results, feedback), the
  turn's reward, whether the episode is done, and the new state.

The state is JSON (dicts, lists, strings, numbers), so an episode in flight is part of
a checkpoint as it is, and a step is a pure function of (state, message), the task's
metadata and the `Services` the environment was built with: replaying an episode's
messages rebuilds it exactly. Model output is untrusted: an environment parses the
message with bounded effort (`tool_calls.py`) and runs tools only through
`Services.tools` (the sandbox, `tools.py`); answers are scored through
`Services.score` (the run's reward function, sandboxed where the task needs it).

The episode's return is the sum of its turns' rewards; the final reward of an answering
environment is its task score. `StepResult.info` reports what happened (tool calls,
failures, whether the answer was correct) for the run's metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from streamrl_jax.rewards.base import RewardResult

Message = dict[str, str]  # {"role": ..., "content": ...}
State = dict[str, Any]  # JSON


@dataclasses.dataclass(frozen=True)
class Start:
    """An episode's beginning."""

    messages: list[Message]  # the conversation so far: system prompt, task
    state: State


@dataclasses.dataclass(frozen=True)
class TurnInfo:
    """What one step saw, for the run's metrics (summed over an episode)."""

    tool_calls: int = 0  # well-formed calls executed
    tool_failures: int = 0  # calls that timed out, raised, died or flooded their output
    malformed_calls: int = 0  # call markup the parser could not read
    answered: bool = False  # the message was taken as the final answer
    correct: bool = False  # ... and the task's scorer gave it full credit
    format_ok: bool = False  # ... in the requested answer format
    answer: str | None = None  # ... the answer extracted


def answered(result: RewardResult) -> TurnInfo:
    """What a turn taken as the final answer saw: the task's score of it."""
    return TurnInfo(
        answered=True,
        correct=result.correct,
        format_ok=result.format_ok,
        answer=result.extracted_answer,
    )


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one policy message."""

    observation: list[Message]  # appended to the conversation (empty when done)
    reward: float  # this turn's reward (the return is their sum)
    done: bool
    state: State
    info: TurnInfo = TurnInfo()


@dataclasses.dataclass(frozen=True)
class Turn:
    """A multi-agent environment's answer to one agent's message (`MultiAgentEnvironment`).

    Attributes:
      to: the role that acts next; None: the episode is done.
      messages: what `to` reads before its turn: its first messages (its system prompt
        and task, as it sees them) when it has not acted yet, else the messages
        appended to its conversation (the other agents' words as user turns).
      rewards: this turn's reward of each role (a role left out: 0); a role's return is
        the sum of its rewards over the episode.
      state: the new state (JSON).
      info: what the acting role's turn saw (its answer and whether it was right).
    """

    to: str | None
    messages: list[Message]
    rewards: dict[str, float]
    state: State
    info: TurnInfo = TurnInfo()


@dataclasses.dataclass(frozen=True)
class Services:
    """What an environment may call: both are bounded, counted and never raise for bad
    model output.

    Attributes:
      tools: `tools(name, arguments) -> ToolResult`, run in the sandbox with a deadline
        and an output limit (`tools.ToolRunner`).
      score: `score(text, metadata) -> RewardResult`, the run's task reward of an answer.
    """

    tools: Callable[[str, dict[str, Any]], Any]
    score: Callable[[str, dict[str, Any]], RewardResult]


class Environment(Protocol):
    """A multi-turn task (module docstring)."""

    name: str

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        """The first messages and state of an episode of this task."""

    def step(self, state: State, message: str, metadata: dict[str, Any]) -> StepResult:
        """The observation, reward and done flag after the policy's `message`."""

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """A correct episode's turns after the first messages (assistant messages, and
        the environment's answers between them), for a supervised warm-up
        (`pipeline/warmup.py`); None where this task has none."""

    def end(self, state: State) -> None:
        """The episode ended before a step said done (a turn, token or context limit):
        release what its state holds (an OpenEnv session); a no-op for a pure one."""


class MultiAgentEnvironment(Protocol):
    """Several agents (roles) acting in one episode (docs/multi_agent.md).

    Each role has a conversation of its own: `roles[0]` acts first, on `start`'s
    messages; every other role's conversation begins when the environment first hands
    it a turn (`Turn.messages`: its first messages). A step takes the acting role's
    complete message and names the role that acts next, what that role reads, and each
    role's reward. Each role is trained on the tokens it sampled alone, against the
    same role in the other episodes of its group. The state is JSON and a step a pure
    function of (state, role, message, metadata), as for `Environment`.
    """

    name: str
    roles: tuple[str, ...]  # seat order: a group's member m plays roles[m % len(roles)]
    evaluated: str  # the role a held-out evaluation scores

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        """The first role's first messages and the episode's state."""

    def step(self, state: State, role: str, message: str, metadata: dict[str, Any]) -> Turn:
        """The environment's answer to `role`'s `message`."""

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """None: a supervised warm-up has no single conversation to learn from."""

    def end(self, state: State) -> None:
        """The episode ended before a step said done (a limit): release its state."""


def roles_of(env: Any) -> tuple[str, ...]:
    """The roles of a multi-agent environment; () for a single-agent one."""
    roles = getattr(env, "roles", ())
    return tuple(roles) if len(roles) > 1 else ()
