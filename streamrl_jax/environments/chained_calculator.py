"""The chained calculator: a task the model cannot do without using its tool well.

Sums of four or five three-digit numbers (reasoning-gym's `chain_sum`, e.g.
`478 + 718 + 585 - 740`): SmolLM2-135M does not do them in its head, and its one tool,
`calculate(a, op, b)`, takes two numbers a call, so an episode is a chain of calls, each
on the last one's result, then the answer::

    user:      ... 478 + 718 + 585 - 740 =
    assistant: <tool_call>{"name": "calculate", "arguments": {"a": 478, "op": "+", "b": 718}}
               </tool_call>
    tool:      1196
    assistant: (1196 + 585, then 1781 - 740)
    assistant: <answer>1041</answer>

The tool is an OpenAI function (`functions`), written in the model's own convention
(`function_calls`: Hermes for SmolLM2), in a run's episodes and through the endpoint
alike: there a scaffold sends the function as `tools` and gets `tool_calls` back. Each
turn:

* calls (at most `function_calls.MAX_CALLS`): each runs in the sandbox, its result a
  `tool` message in order; reward 0, the episode goes on;
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
    "Compute the expression with the calculate tool: it takes two numbers at a time, so call "
    "it on the first two numbers, then on its result and the next number, and so on. When "
    "every number is used, give the last result as <answer>N</answer>."
)
CALCULATE = function_calls.Tool(
    name="calculate",
    description="Computes a op b for two numbers.",
    parameters={
        "type": "object",
        "properties": {
            "a": {"type": "number", "description": "the first number"},
            "op": {"type": "string", "enum": ["+", "-", "*", "/"]},
            "b": {"type": "number", "description": "the second number"},
        },
        "required": ["a", "op", "b"],
    },
)
_TERM = re.compile(r"\s*([+-])\s*(\d+)")


class ChainedCalculator:
    """Sums with a two-operand calculator (module docstring)."""

    name = "chained_calculator"
    functions = (CALCULATE,)

    def __init__(self, convention: function_calls.Convention, services: Services):
        self.convention, self.services = convention, services
        self.choice = function_calls.ToolChoice("auto")

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        del metadata
        return Start(chat_messages(question, INSTRUCTIONS), {"calls": 0})

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
        for name, arguments in read.calls:
            result = self.services.tools(name, arguments)
            failures += result.failure is not None
            observation.append({"role": "tool", "content": result.text})
        info = TurnInfo(tool_calls=len(read.calls), tool_failures=failures)
        return StepResult(
            observation, 0.0, False, {"calls": state["calls"] + len(read.calls)}, info
        )

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """The chain of calls, left to right, then the answer (the task's expression,
        as reasoning-gym's `chain_sum` records it)."""
        expression = metadata.get("entry", {}).get("metadata", {}).get("expression")
        if not isinstance(expression, str):
            return None
        first = re.match(r"\s*(\d+)", expression)
        terms = _TERM.findall(expression[first.end() :]) if first else []
        if (
            not first
            or not terms
            or "".join(o + n for o, n in terms) != re.sub(r"\s+", "", expression[first.end() :])
        ):
            return None
        value = int(first.group(1))
        turns: list[Message] = []
        for i, (op, number) in enumerate(terms):
            args = {"a": value, "op": op, "b": int(number)}
            call = function_calls.Call(f"call_{i}", CALCULATE.name, json.dumps(args))
            value = int(calculate(args))
            turns += [
                {"role": "assistant", "content": self.convention.write([call])},
                {"role": "tool", "content": str(value)},
            ]
        return [*turns, {"role": "assistant", "content": f"<answer>{value}</answer>"}]

    def end(self, state: State) -> None:
        del state  # pure JSON


def make(
    section: EnvironmentSection, convention: function_calls.Convention, services: Services
) -> ChainedCalculator:
    """The registry's entry (`environments/__init__.py`)."""
    del section
    return ChainedCalculator(convention, services)
