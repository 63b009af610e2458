"""Agent scaffolds: programs that play a task through the OpenAI API.

A scaffold is `fn(task, client) -> AgentResult`: `task` holds the problem (`question`,
`metadata`), `client` an `openai.OpenAI` whose requests belong to one episode of the
endpoint. Whatever the scaffold does between requests (tools, environments, other
programs) is its own; the endpoint records what the policy sampled, and the scaffold's
`AgentResult.reward` is the episode's return.

`environment_scaffold(env, model, max_turns)`: any `environments.Environment` of this
package (the calculator, answer-with-retry, the chained calculator) driven through the
API as a scaffold would drive it: the environment's first messages, then for each
completion the environment's step on its text, the observation appended as messages,
until done, `max_turns`, or the endpoint refusing a turn past the episode's context
(OpenAI's `context_length_exceeded`: the episode ends truncated, as in-process). An
environment of OpenAI functions (`Environment.functions`) is played with tool calling:
its functions go as `tools`, a reply's `tool_calls` reach its step written in the
model's convention (what the policy wrote), and its `tool` results go back answering
the calls by id, in order.

A `GroupScaffold` plays a prompt's G episodes of a training run together:
`environment_group_scaffold` asks their shared first messages once with `n=G` (each
choice one of the run's episodes: the engine prefills the prompt once and forks it),
then plays each episode on from its choice as `environment_scaffold` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from streamrl_jax.endpoint.turns import CONTEXT_EXCEEDED
from streamrl_jax.environments.protocol import Environment, TurnInfo
from streamrl_jax.model.function_calls import Call


@dataclasses.dataclass(frozen=True)
class AgentTask:
    question: str
    metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AgentResult:
    """How a scaffold's episode went (its return and what the run's metrics count)."""

    reward: float
    correct: bool = False
    format_ok: bool = False
    answer: str | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    malformed_calls: int = 0
    # "done" (the task ended it), "turn_limit" (the scaffold's own turn limit) or
    # "episode_tokens" (the endpoint refused a turn past the episode's context)
    outcome: str = "done"


Scaffold = Callable[[AgentTask, Any], AgentResult]


def environment_scaffold(
    env: Environment, model: str, max_turns: int, max_tokens: int | None = None
) -> Scaffold:
    """The scaffold that plays `env` through the OpenAI chat API (module docstring)."""
    tools = _tools(env)

    def play(task: AgentTask, client: Any) -> AgentResult:
        start = env.start(task.question, task.metadata)
        return _play(env, task, start, _asker(client, model, max_tokens, tools), max_turns)

    return play


@dataclasses.dataclass(frozen=True)
class GroupScaffold:
    """A scaffold that plays a prompt's G episodes together: `play(task, clients)`, the
    i-th client's requests belonging to the group's i-th episode, returns the G
    results in that order. Its first request may ask `n=G` with the first episode's
    client: each choice is then one of the group's episodes (the i-th the i-th's first
    turn), the engine prefilling the shared prompt once."""

    play: Callable[[AgentTask, list[Any]], list[AgentResult]]


def environment_group_scaffold(
    env: Environment, model: str, max_turns: int, max_tokens: int | None = None
) -> GroupScaffold:
    """`environment_scaffold` for a group (`GroupScaffold`): the episodes' shared first
    messages asked once with `n=G`, then each episode played on from its choice, one
    after another."""
    tools = _tools(env)

    def play(task: AgentTask, clients: list[Any]) -> list[AgentResult]:
        starts = [env.start(task.question, task.metadata) for _ in clients]
        if any(s.messages != starts[0].messages for s in starts):
            raise ValueError("the group's episodes start with different messages")
        first = clients[0].chat.completions.create(
            model=model, messages=starts[0].messages, max_tokens=max_tokens, n=len(clients),
            **tools,
        )  # fmt: skip
        results = []
        for client, start, choice in zip(clients, starts, first.choices, strict=True):
            eid = client.default_headers["x-episode-id"]
            if choice.model_extra["episode_id"] != eid:
                raise ValueError(f"choice {choice.index} is episode "
                                 f"{choice.model_extra['episode_id']}, not {eid}")  # fmt: skip
            ask = _asker(client, model, max_tokens, tools, first=choice.message)
            results.append(_play(env, task, start, ask, max_turns))
        return results

    return GroupScaffold(play)


def _tools(env: Environment) -> dict[str, Any]:
    """The request's `tools`: the environment's OpenAI functions (none: no field)."""
    functions = [f.schema() for f in getattr(env, "functions", ())]
    return {"tools": functions} if functions else {}


def _asker(
    client: Any, model: str, max_tokens: int | None, tools: dict[str, Any], first: Any = None
) -> Callable[[list[dict[str, Any]]], Any]:
    """`ask(messages)`: the episode's next reply message (`first` for its first turn,
    when it was asked already)."""
    given = [first] if first is not None else []

    def ask(messages: list[dict[str, Any]]) -> Any:
        if given:
            return given.pop()
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, **tools
        )
        return r.choices[0].message

    return ask


def _play(
    env: Environment,
    task: AgentTask,
    start: Any,
    ask: Callable[[list[dict[str, Any]]], Any],
    max_turns: int,
) -> AgentResult:
    """One episode of `env` from `start`, each reply from `ask`: the environment's step
    on each reply's text, the observation appended as messages, until done,
    `max_turns`, or the endpoint refusing a turn past the episode's context."""
    import openai

    messages, state = list(start.messages), start.state
    total, counts, last = 0.0, TurnInfo(), TurnInfo()
    for turn in range(max_turns):
        try:
            reply = ask(messages)
        except openai.BadRequestError as e:
            if turn == 0 or e.code != CONTEXT_EXCEEDED:
                raise
            env.end(state)
            return outcome_of(total, last, counts, "episode_tokens")
        calls = reply.tool_calls or []
        text = reply.content or ""
        if calls:  # the policy's text again: the step reads what it wrote
            written = env.convention.write(
                [Call(c.id, c.function.name, c.function.arguments) for c in calls]
            )
            text = f"{text}\n{written}" if text else written
        step = env.step(state, text, task.metadata)
        total += step.reward
        state, info = step.state, step.info
        counts = tally(counts, info)
        if info.answered:
            last = info
        if step.done:
            break
        messages += [_assistant(reply), *_answers(step.observation, calls)]
    else:
        env.end(state)
        return outcome_of(total, last, counts, "turn_limit")
    return outcome_of(total, last, counts, "done")


def _assistant(reply: Any) -> dict[str, Any]:
    """A reply as the next request repeats it (its calls as returned)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [c.model_dump(exclude_none=True) for c in reply.tool_calls]
    return message


def _answers(observation: list[dict[str, Any]], calls: list[Any]) -> list[dict[str, Any]]:
    """The observation, its `tool` results answering `calls` by id, in order."""
    ids = iter(c.id for c in calls)
    out = []
    for m in observation:
        if m["role"] == "tool":
            out.append({"role": "tool", "content": m["content"], "tool_call_id": next(ids)})
        else:
            out.append(m)
    return out


def tally(counts: TurnInfo, info: TurnInfo) -> TurnInfo:
    """An episode's tool counts so far, with one more turn's."""
    return TurnInfo(
        tool_calls=counts.tool_calls + info.tool_calls,
        tool_failures=counts.tool_failures + info.tool_failures,
        malformed_calls=counts.malformed_calls + info.malformed_calls,
    )


def outcome_of(total: float, last: TurnInfo, counts: TurnInfo, outcome: str) -> AgentResult:
    """An episode's result: its return, its last answer's score, its tool counts."""
    return AgentResult(
        reward=total,
        correct=last.correct,
        format_ok=last.format_ok,
        answer=last.answer,
        tool_calls=counts.tool_calls,
        tool_failures=counts.tool_failures,
        malformed_calls=counts.malformed_calls,
        outcome=outcome,
    )
