"""Tools an episode may call, and the runner that executes them in the sandbox.

A tool is a module-level function `fn(arguments) -> str` with a `ToolSpec` (what the
model is told). Its arguments come from model output, so it runs like a scorer that
evaluates model text (DESIGN.md §7): `ToolRunner` calls it in the reward sandbox's
confined worker processes (`rewards/sandbox.py`: read-only filesystem, no network, no
process creation, address-space limit) with a deadline per call, and cuts its output
to `max_output_chars` inside the worker, so a flood never crosses back. Every call
ends in a `ToolResult`: the text for the model, or a failure of one kind:

* `timeout`: no result within the deadline (the worker is killed and replaced);
* `died`: the worker died (memory limit, crash);
* `raised`: the tool raised (its error text is the result, cut to 200 characters);
* `flooded`: the output passed `max_output_chars` (the model gets the cut text and a
  note; the call still counts as a failure).

A failure is bounded (one deadline) and counted (`ToolRunner.failures`), and the
episode goes on: the environment shows the model the error.

`calculator` (the quickstart's arithmetic): + - * / // % **, parentheses and unary
signs over integers and decimals, evaluated from the parsed syntax tree (never `eval`),
with bounded input length, exponents and magnitudes.
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import dataclasses
import math
import operator
import threading
from collections.abc import Callable, Mapping
from typing import Any

from streamrl_jax.environments.tool_calls import ToolSpec
from streamrl_jax.rewards.sandbox import Limits, RewardTimeout, RewardWorkerDied, SandboxPool

FAILURES = ("timeout", "died", "raised", "flooded")

# ---------------------------------------------------------------------- calculator
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e30
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def format_number(value: int | float) -> str:
    """An integer as itself; a float with at most 12 significant digits ("7", "0.5")."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result out of range")
        if value.is_integer():
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculator(arguments: dict[str, Any]) -> str:
    """Evaluates `arguments["expression"]` (module docstring).

    Raises:
      ValueError: naming what is wrong with the expression.
    """
    expr = arguments.get("expression")
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError("expected a non-empty 'expression'")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-").strip().rstrip("=")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot parse {expr!r}") from e
    return format_number(_evaluate(tree))


CALCULATOR = ToolSpec(
    name="calculator",
    description="evaluates an arithmetic expression (+ - * / ** and parentheses).",
    param="expression",
    param_description="the arithmetic expression",
    example="12 * (3 + 4)",
)

# ---------------------------------------------------------------------- calculate
_TWO_OPERAND = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
MAX_OPERAND = 1e15


def calculate(arguments: dict[str, Any]) -> str:
    """`a op b` for numbers `a`, `b` and `op` one of + - * / (the chained calculator's
    one function: two operands a call), shown as a calculator's display shows it:
    `478 + 718 = 1196` (the operation, then its value).

    Raises:
      ValueError: naming the argument that is missing or wrong.
    """
    unknown = set(arguments) - {"a", "op", "b"}
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)}: give a, op and b")
    values = []
    for name in ("a", "b"):
        v = arguments.get(name)
        if isinstance(v, str):
            try:
                v = float(v) if any(c in v for c in ".eE") else int(v)
            except ValueError:
                raise ValueError(f"{name}={v[:40]!r} is not a number") from None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{name} must be a number")
        if abs(v) > MAX_OPERAND:
            raise ValueError(f"{name} is beyond {MAX_OPERAND:g}")
        values.append(v)
    op = arguments.get("op")
    if op not in _TWO_OPERAND:
        raise ValueError(f"op must be one of {' '.join(_TWO_OPERAND)}")
    if op == "/" and values[1] == 0:
        raise ValueError("division by zero")
    a, b = map(format_number, values)
    return f"{a} {op} {b} = {format_number(_TWO_OPERAND[op](*values))}"


CALCULATE = ToolSpec(
    name="calculate",
    description="a op b: one arithmetic operation on two numbers.",
    param="a",
    param_description="the first number (then op: + - * /, and b: the second number)",
    example='{"a": 12, "op": "+", "b": 30}',
)
TOOLS: dict[str, tuple[ToolSpec, Callable[[dict[str, Any]], str]]] = {
    "calculator": (CALCULATOR, calculator),
    "calculate": (CALCULATE, calculate),
}


# ---------------------------------------------------------------------- running them
@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees
    failure: str | None = None  # one of FAILURES, None for a result


@dataclasses.dataclass(frozen=True)
class ToolBox:
    """The worker-side call: runs the named tool, cuts its output (picklable: it is
    what the sandbox's workers are started with)."""

    fns: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...]  # module-level functions
    max_output_chars: int

    def __call__(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        text = str(dict(self.fns)[name](arguments))
        if len(text) > self.max_output_chars:
            return text[: self.max_output_chars], True
        return text, False


class ToolRunner:
    """Executes tool calls, sandboxed (default) or inline, each bounded and counted.

    Args:
      tools: the tools offered, by name: (spec, module-level function), e.g. `TOOLS`
        entries.
      sandbox: the worker limits (deadline `timeout_s`, memory, ...); None runs tools on
        a thread in this process (only for trusted tools: a hang there is abandoned after
        the deadline, not killed).
      timeout_s: the deadline of one call when inline.
      workers: sandbox worker processes (or threads).
      max_output_chars: the longest result text passed back.
    """

    def __init__(
        self,
        tools: Mapping[str, tuple[ToolSpec, Callable[[dict[str, Any]], str]]],
        *,
        sandbox: Limits | None,
        timeout_s: float = 5.0,
        workers: int = 2,
        max_output_chars: int = 512,
    ):
        self.specs = {n: spec for n, (spec, _) in tools.items()}
        self.box = ToolBox(tuple((n, fn) for n, (_, fn) in tools.items()), max_output_chars)
        self.timeout_s = sandbox.timeout_s if sandbox is not None else timeout_s
        self._pool: SandboxPool | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        if sandbox is not None:
            self._pool = SandboxPool(self.box, workers=workers, limits=sandbox, name="tools")
        else:
            self._threads = concurrent.futures.ThreadPoolExecutor(workers, "tool")
        self._lock = threading.Lock()
        self.calls = 0
        self.failures: collections.Counter[str] = collections.Counter()

    def __call__(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Runs one call to its end (blocking at most about one deadline)."""
        if self._pool is not None:
            future = self._pool.submit(name, arguments, label=f"tool {name}")
            wait = self.timeout_s + 30.0  # the pool's own deadline fires first
        else:
            future = self._threads.submit(self.box, name, arguments)
            wait = self.timeout_s
        try:
            text, flooded = future.result(timeout=wait)
            failure = "flooded" if flooded else None
            if flooded:
                text += f"\n[output cut at {self.box.max_output_chars} characters]"
        except (RewardTimeout, concurrent.futures.TimeoutError):
            text, failure = f"error: {name} did not finish within {self.timeout_s:g} s", "timeout"
        except RewardWorkerDied:
            text, failure = f"error: {name} ran out of memory or crashed", "died"
        except Exception as e:  # noqa: BLE001 - the tool's own error, shown to the model
            text, failure = f"error: {str(e)[:200]}", "raised"
        with self._lock:
            self.calls += 1
            if failure is not None:
                self.failures[failure] += 1
        return ToolResult(text, failure)

    def close(self) -> None:
        """Stops the workers (a stuck call is abandoned, never waited for)."""
        if self._pool is not None:
            self._pool.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
