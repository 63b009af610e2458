"""An OpenEnv environment built from offline data: reasoning-gym tasks with a calculator.

Written against `openenv-core`'s API only (it imports nothing from this package), as
an environment from the OpenEnv hub is: an `MCPEnvironment` whose tools are FastMCP
functions, driven by `reset` and `step(CallToolAction)`. The run adapts it
(`environments/openenv.py`) exactly as it would adapt a third-party one.

* `reset(seed, episode_id, question=..., task=...)`: the task is a reasoning-gym entry
  (question, answer, metadata) the trainer's data pipeline drew, so a GRPO group's
  episodes share it; the observation carries the question.
* tools: `calculator(expression)` evaluates +, -, *, /, //, % and parentheses over
  numbers (parsed with `ast`, never evaluated as code; bounded length and magnitude);
  `submit_answer(answer)` scores the answer with reasoning-gym's own scorer for the
  entry's dataset and ends the episode (`reward` = the score, `done`).
"""

from __future__ import annotations

import ast
import operator
from typing import Annotated, Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**18

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression, as text.

    Raises:
      ValueError: anything but numbers, + - * / // % and parentheses; a value past
        MAX_MAGNITUDE; division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression[:40]!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = value(node.operand)
            out = -v if isinstance(node.op, ast.USub) else v
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ValueError("division by zero")
            out = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported: {ast.dump(node)[:40]}")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError(f"a value past {MAX_MAGNITUDE:.0e}")
        return out

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


class ArithmeticToolsEnvironment(MCPEnvironment):
    """reasoning-gym tasks with a calculator tool (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("arithmetic_tools")
        env = self

        @mcp.tool
        def calculator(
            expression: Annotated[
                str,
                Field(description="an arithmetic expression", examples=["12 * (3 + 4)"]),
            ],
        ) -> str:
            """Evaluates an arithmetic expression: numbers, + - * / // % and parentheses."""
            return evaluate(expression)

        @mcp.tool
        def submit_answer(
            answer: Annotated[str, Field(description="the final answer", examples=["42"])],
        ) -> dict:
            """Submits the final answer; returns its score and ends the episode."""
            if env._entry is None:
                return {"error": "no task: call reset() first"}
            if env._done:
                return {"error": "the episode is over: call reset() for a new task"}
            import reasoning_gym

            name = env._entry.get("metadata", {}).get("source_dataset", "basic_arithmetic")
            score = float(reasoning_gym.get_score_answer_fn(name)(answer, env._entry))
            env._done, env._score = True, score
            return {"score": score, "correct_answer": str(env._entry.get("answer"))}

        super().__init__(mcp)
        self._entry: dict[str, Any] | None = None
        self._done, self._score = False, 0.0
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        question: str | None = None,
        task: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Observation:
        """A new episode of `task` (a reasoning-gym entry; `question` defaults to its own)."""
        del seed, kwargs
        if not isinstance(task, dict) or "answer" not in task:
            raise ValueError("reset needs task=<a reasoning-gym entry with an answer>")
        self._entry = task
        self._done, self._score = False, 0.0
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        text = question if question is not None else str(task.get("question", ""))
        return Observation(done=False, reward=0.0, metadata={"question": text})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any):
        return Observation(
            done=self._done,
            reward=0.0,
            metadata={"error": f"unknown action {type(action).__name__}: use CallToolAction"},
        )

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        obs = super().step(action, timeout_s=timeout_s, **kwargs)
        obs.done = self._done
        obs.reward = self._score if self._done else 0.0
        return obs

    @property
    def state(self) -> State:
        return self._state
