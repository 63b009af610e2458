"""The calculator environment: the quickstart's arithmetic with a calculator tool.

The system prompt offers one tool, `calculator` (`tools.calculator`), in the run's tool
format (`tool_calls.py`), and asks for the final answer in `<answer>` tags. Each turn:

* a message with tool-call markup: every well-formed call (at most
  `tool_calls.MAX_CALLS`) runs in the sandbox and its result comes back as a tool
  message; malformed markup gets one error message that restates the format. Reward 0,
  the episode goes on (the model may call the tool any number of times, up to the
  episode's turn limit);
* a message without: the final answer, scored by the task's own scorer
  (`Services.score`); its score is the turn's reward and the episode ends.
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
    TurnInfo,
    answered,
)
from streamrl_jax.environments.tool_calls import ToolCall, ToolFormat
from streamrl_jax.environments.tools import CALCULATOR, calculator
from streamrl_jax.rewards.tasks import chat_messages

INSTRUCTIONS = "Solve it. Use the calculator for arithmetic. End with <answer>N</answer>."


class CalculatorEnvironment:
    """Arithmetic with a calculator (module docstring)."""

    name = "calculator"

    def __init__(self, fmt: ToolFormat, services: Services):
        self.fmt, self.services = fmt, services
        self.specs = {CALCULATOR.name: CALCULATOR}
        self.system_prompt = INSTRUCTIONS + "\n" + fmt.describe([CALCULATOR])

    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        del metadata
        return Start(chat_messages(question, self.system_prompt), {"tool_turns": 0})

    def step(self, state: State, message: str, metadata: dict[str, Any]) -> StepResult:
        parsed = self.fmt.parse(message, self.specs)
        if not parsed.any:
            r = self.services.score(message, metadata)
            return StepResult([], r.score, True, state, answered(r))
        observation, failures = [], 0
        for call in parsed.calls:
            result = self.services.tools(call.name, call.arguments)
            failures += result.failure is not None
            observation.append(self.fmt.result(call, result.text))
        if parsed.malformed:
            example = f"{CALCULATOR.name}: {CALCULATOR.example}"
            observation.append(
                self.fmt.result(
                    None,
                    f"error: {parsed.malformed} tool call(s) could not be read; write "
                    f"<tool_call>{example}</tool_call>"
                    if self.fmt.name == "simple"
                    else f"error: {parsed.malformed} tool call(s) could not be read",
                )
            )
        info = TurnInfo(
            tool_calls=len(parsed.calls), tool_failures=failures, malformed_calls=parsed.malformed
        )
        return StepResult(observation, 0.0, False, {"tool_turns": state["tool_turns"] + 1}, info)

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        """Call the calculator on the task's expression, then answer with the task's own
        answer (reasoning-gym's arithmetic tasks record the expression)."""
        entry = metadata.get("entry", {})
        expression = entry.get("metadata", {}).get("expression")
        if not isinstance(expression, str) or "answer" not in entry:
            return None
        try:
            result = calculator({"expression": expression})
        except ValueError:
            return None
        call = ToolCall(CALCULATOR.name, {CALCULATOR.param: expression})
        return [
            {"role": "assistant", "content": self.fmt.render(call)},
            self.fmt.result(call, result),
            {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"},
        ]

    def end(self, state: State) -> None:
        del state  # the state is pure JSON: nothing to release


def make(section: EnvironmentSection, fmt: ToolFormat, services: Services) -> CalculatorEnvironment:
    """The registry's entry (`environments/__init__.py`)."""
    del section  # nothing to set: the tool format and the tools are the run's
    return CalculatorEnvironment(fmt, services)
