"""The chained calculator: a task the model cannot do without using its tool well.

Sums of four or five three-digit numbers (reasoning-gym's `chain_sum`, e.g.
`478 + 718 + 585 - 740`): SmolLM2-135M does not do them in its head, and its one tool,
`calculate(a, op, b)`, takes two numbers a call, so an episode is a chain of calls, each
on the last one's result, then the answer::

    user:      ... 478 + 718 + 585 - 740 =
    assistant: Left: + 718 + 585 - 740
               <tool_call>{"name": "calculate", "arguments": {"a": 478, "op": "+", "b": 718}}
               </tool_call>
    tool:      478 + 718 = 1196
    assistant: (Left: + 585 - 740, 1196 + 585; then Left: - 740, 1781 - 740)
    assistant: Left: none
               <answer>1041</answer>

The `Left:` line (the terms still left after the number in hand) is what the
instructions ask for and the demonstrations write: the next call is then read off a
line the policy has just written. Only the calls and the answer are scored.

The tool is an OpenAI function (`functions`), written in the model's own convention
(`function_calls`: Hermes for SmolLM2), in a run's episodes and through the endpoint
alike: there a scaffold sends the function as `tools` and gets `tool_calls` back. Each
turn:

* calls (at most `function_calls.MAX_CALLS`): each runs in the sandbox, its result a
  `tool` message in order; reward 0 (with `environment.step_credit`: each call that is
  the chain's next step earns its share, each call once the chain is done costs one), the
  episode goes on;
* call markup that cannot be read (or a function not offered): one user message saying
  so; reward 0, the episode goes on;
* no call: the final answer, scored by the task's scorer; its score is the turn's
  reward and the episode ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

from streamrl_jax.config import EnvironmentSection
from streamrl_jax.environments.protocol import (
    Message,
    Services,
    Start,
    State,
    StepResult,
    TurnInfo,
    answered,
)
from streamrl_jax.environments.tools import calculate
from streamrl_jax.model import function_calls
from streamrl_jax.rewards.tasks import chat_messages

INSTRUCTIONS = (
    "Compute the expression with the calculate tool, two numbers a call. Before each call "
    "write the terms left after the number in hand, as in 'Left: - 244 + 216', then call "
    "calculate on the number in hand (the first number, then the last result) and the "
    "first term left. When no term is left, write 'Left: none' and give the last result "
    "as <answer>N</answer>."
)
CALCULATE = function_calls.Tool(
    name="calculate",
    description="Computes a op b.",
    parameters={
        "type": "object",
        "properties": {
            "a": {"type": "number"},
            "op": {"type": "string", "enum": ["+", "-", "*", "/"]},
            "b": {"type": "number"},
        },
        "required": ["a", "op", "b"],
    },
)
_TERM = re.compile(r"\s*([+-])\s*(\d+)")


class ChainedCalculator:
    """Sums with a two-operand calculator (module docstring)."""

    name = "chained_calculator"
    functions = (CALCULATE,)

    def __init__(
        self, convention: function_calls.Convention, services: Services, step_credit: float = 0.0
    ):
        self.convention, self.services = convention, services
        self.step_credit = step_credit
        self.choice = function_calls.ToolChoice("auto")

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        chain = _chain(metadata)
        value = None if chain is None else chain[0]
        return Start(
            chat_messages(question, INSTRUCTIONS), {"calls": 0, "steps": 0, "value": value}
        )

    def step(self, state: State, message: str, metadata: dict[str, Any]) -> StepResult:
        read = function_calls.interpret(self.convention, message, self.functions, self.choice)
        if read.malformed:
            note = "error: the tool call could not be read; write it as the tools say"
            info = TurnInfo(malformed_calls=1)
            return StepResult([{"role": "user", "content": note}], 0.0, False, state, info)
        if not read.calls:
            r = self.services.score(message, metadata)
            return StepResult([], r.score, True, state, answered(r))
        observation, failures = [], 0
        state = {**state, "calls": state["calls"] + len(read.calls)}
        chain, credit = _chain(metadata), 0.0
        for name, arguments in read.calls:
            result = self.services.tools(name, arguments)
            failures += result.failure is not None
            observation.append({"role": "tool", "content": result.text})
            if chain is None:
                continue
            share = self.step_credit / len(chain[1])
            if state["steps"] >= len(chain[1]):
                credit -= share  # the chain is done: a call now is one instead of the answer
            elif result.failure is None and _next_step(state, chain, arguments):
                credit += share
                state["steps"] += 1
                state["value"] = int(result.text.rsplit("=", 1)[1])
        info = TurnInfo(tool_calls=len(read.calls), tool_failures=failures)
        return StepResult(observation, credit, False, state, info)

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """The chain of calls, left to right, each after the terms still left, then the
        answer."""
        chain = _chain(metadata)
        if chain is None:
            return None
        value, steps, turns = chain[0], chain[1], []
        for i, (op, number) in enumerate(steps):
            args = {"a": value, "op": op, "b": number}
            call = function_calls.Call(f"call_{i}", CALCULATE.name, json.dumps(args))
            shown = calculate(args)
            value = int(shown.rsplit("=", 1)[1])
            left = "Left: " + " ".join(f"{o} {n}" for o, n in steps[i:])
            said = function_calls.assistant_text(self.convention, left, [call])
            turns += [{"role": "assistant", "content": said}, {"role": "tool", "content": shown}]
        return [*turns, {"role": "assistant", "content": f"Left: none\n<answer>{value}</answer>"}]

    def end(self, state: State) -> None:
        del state  # pure JSON


def _chain(metadata: dict[str, Any]) -> tuple[int, list[tuple[str, int]]] | None:
    """The task's expression (as reasoning-gym's `chain_sum` records it) as its first
    number and its (operator, number) steps; None when it is not a plain chain."""
    expression = metadata.get("entry", {}).get("metadata", {}).get("expression")
    if not isinstance(expression, str):
        return None
    first = re.match(r"\s*(\d+)", expression)
    if first is None:
        return None
    rest = expression[first.end() :]
    terms = _TERM.findall(rest)
    if not terms or "".join(o + n for o, n in terms) != re.sub(r"\s+", "", rest):
        return None
    return int(first.group(1)), [(o, int(n)) for o, n in terms]


def _next_step(
    state: State, chain: tuple[int, list[tuple[str, int]]], arguments: dict[str, Any]
) -> bool:
    """Whether a call is the chain's next step: the running value, then the next term
    with its operator (`calculate` already checked the arguments are numbers)."""
    steps = chain[1]
    if state["steps"] >= len(steps):
        return False
    op, number = steps[state["steps"]]
    try:
        a, b = float(arguments["a"]), float(arguments["b"])
    except (KeyError, TypeError, ValueError):
        return False
    return a == state["value"] and arguments.get("op") == op and b == number


def make(
    section: EnvironmentSection, convention: function_calls.Convention, services: Services
) -> ChainedCalculator:
    """The registry's entry (`environments/__init__.py`)."""
    return ChainedCalculator(convention, services, section.step_credit)
