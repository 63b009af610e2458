"""Tool calls in the model's text: the formats, their parsers and their result messages.

A policy message calls tools by writing markup the environment's *tool format*
defines; the environment answers with one result message per call. Model output is
untrusted: parsing is a bounded regular-expression scan and a size-capped
`json.loads`, never evaluation, and at most `MAX_CALLS` calls are read per message.

* `hermes` (the Qwen2.5 / Qwen3 convention, NousResearch's Hermes format): a JSON
  object in `<tool_call>` tags, its result in a `tool` message (Qwen's template renders
  it inside `<tool_response>` tags)::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}
      </tool_call>

  Offered where the vocabulary has the `<tool_call>` token (the models trained on it).
* `simple` (any chat model; SmolLM2's, which has no tool convention of its own): one
  tool, one text argument::

      <tool_call>calculator: 12 * (3 + 4)</tool_call>

  and the result as a `tool` message holding the result text.

`"auto"` picks `hermes` where the vocabulary has `<tool_call>`, else `simple`
(`resolve_format`, checked at start-up: a format the model has no parser for is a
config error naming the field).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from streamrl_jax.environments.protocol import Message
from streamrl_jax.errors import UserError
from streamrl_jax.model import function_calls

MAX_CALLS = 4  # calls read from one message (the rest are ignored, counted malformed)
MAX_CALL_CHARS = 2000  # a call's markup longer than this is malformed (never parsed)
_CALL = re.compile(rf"<tool_call>(.{{0,{MAX_CALL_CHARS}}}?)</tool_call>", re.DOTALL)
_OPEN = re.compile(r"<tool_call>")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it."""

    name: str
    description: str
    param: str  # its one argument's name (the `simple` format's whole text)
    param_description: str
    example: str  # an example argument


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a message asks for."""

    calls: list[ToolCall]
    malformed: int  # call markup that could not be read (bad JSON, unknown tool, ...)

    @property
    def any(self) -> bool:
        """The message tried to call a tool (well-formed or not)."""
        return bool(self.calls) or self.malformed > 0


class ToolFormat(Protocol):
    name: str

    def describe(self, tools: Sequence[ToolSpec]) -> str:
        """The system-prompt text that teaches the format and lists the tools."""

    def parse(self, text: str, tools: Mapping[str, ToolSpec]) -> Parsed:
        """The calls in a policy message."""

    def result(self, call: ToolCall | None, text: str) -> Message:
        """The message that answers one call (None: a malformed one)."""

    def render(self, call: ToolCall) -> str:
        """A call as the model writes it (demonstrations)."""


def _bodies(text: str) -> tuple[list[str], int]:
    """The bodies of closed `<tool_call>` tags (at most MAX_CALLS) and how many opened
    tags were left unread (unclosed, too long or past MAX_CALLS)."""
    bodies = _CALL.findall(text)
    opened = len(_OPEN.findall(text))
    return bodies[:MAX_CALLS], opened - min(len(bodies), MAX_CALLS)


class Hermes:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (module docstring)."""

    name = "hermes"

    def describe(self, tools: Sequence[ToolSpec]) -> str:
        """The function-calling convention's text (`model/function_calls.py`), each tool
        a function of its one string argument."""
        return function_calls.CONVENTIONS["hermes"].describe([_function(t) for t in tools])

    def parse(self, text: str, tools: Mapping[str, ToolSpec]) -> Parsed:
        bodies, malformed = _bodies(text)
        calls = []
        for body in bodies:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                malformed += 1
                continue
            name = obj.get("name") if isinstance(obj, dict) else None
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError):
                    args = None
            if name not in tools or not isinstance(args, dict):
                malformed += 1
                continue
            calls.append(ToolCall(name, args))
        return Parsed(calls, malformed)

    def result(self, call: ToolCall | None, text: str) -> Message:
        return {"role": "tool", "content": text}

    def render(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"<tool_call>\n{body}\n</tool_call>"


class Simple:
    """`<tool_call>name: argument</tool_call>` (module docstring)."""

    name = "simple"

    def describe(self, tools: Sequence[ToolSpec]) -> str:
        listed = "; ".join(
            f"{t.name} ({t.param_description}, e.g. <tool_call>{t.name}: {t.example}</tool_call>)"
            for t in tools
        )
        return (
            "To use a tool, write <tool_call>NAME: INPUT</tool_call> and stop; its result "
            f"comes back in the next message. Tools: {listed}."
        )

    def parse(self, text: str, tools: Mapping[str, ToolSpec]) -> Parsed:
        bodies, malformed = _bodies(text)
        calls = []
        for body in bodies:
            name, sep, arg = body.partition(":")
            spec = tools.get(name.strip())
            if not sep or spec is None:
                malformed += 1
                continue
            calls.append(ToolCall(spec.name, {spec.param: arg.strip()}))
        return Parsed(calls, malformed)

    def result(self, call: ToolCall | None, text: str) -> Message:
        return {"role": "tool", "content": text}

    def render(self, call: ToolCall) -> str:
        (arg,) = call.arguments.values()
        return f"<tool_call>{call.name}: {arg}</tool_call>"


def _function(spec: ToolSpec) -> function_calls.Tool:
    """`spec` as an OpenAI function of its one string argument."""
    parameters = {
        "type": "object",
        "properties": {spec.param: {"type": "string", "description": spec.param_description}},
        "required": [spec.param],
    }
    return function_calls.Tool(spec.name, spec.description, parameters)


FORMATS: dict[str, ToolFormat] = {"hermes": Hermes(), "simple": Simple()}
TOOL_FORMATS = ("auto", *FORMATS)


def resolve_format(name: str, vocab: Mapping[str, int] | set[str]) -> ToolFormat:
    """The tool format `name` ("auto" or a `FORMATS` key) for a model with vocabulary
    `vocab`.

    Raises:
      UserError: an unknown format, or one this model has no parser for (naming the
        config field).
    """
    has_hermes = "<tool_call>" in vocab and "</tool_call>" in vocab
    if name == "auto":
        return FORMATS["hermes" if has_hermes else "simple"]
    if name not in FORMATS:
        raise UserError(f"environment.tool_format={name!r}: expected one of {TOOL_FORMATS}")
    if name == "hermes" and not has_hermes:
        raise UserError(
            "environment.tool_format='hermes': this model's vocabulary has no <tool_call> "
            "token, so it has no Hermes tool-call parser (the Qwen2.5/Qwen3 convention); "
            "use 'simple' or 'auto'"
        )
    return FORMATS[name]
