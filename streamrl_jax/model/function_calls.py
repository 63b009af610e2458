"""OpenAI tool calling: a request's `tools` in the prompt, the policy's calls read back.

A *convention* is how one model family writes tool calls, and how it is shown its tools
and their results:

* `hermes` (Qwen2.5 / Qwen3, NousResearch's Hermes format; SmolLM2's instruct models and
  any ChatML model): the tools as JSON schemas in `<tools>` tags in the system message,
  each call a JSON object in `<tool_call>` tags (several: parallel calls), each result
  a `tool` message (Qwen's template puts it in `<tool_response>` tags)::

      <tool_call>
      {"name": "add", "arguments": {"a": 2, "b": 3}}
      </tool_call>

* `llama3_json` (Llama 3.1 / 3.2 / 3.3's JSON tool calling): the tools' schemas and the
  call format in the system message; a call is the whole message, a JSON object
  `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`; several
  separated by `;`), its result an `ipython` message.
* `gemma_tool_code` (Gemma 3's convention: its template has no tool role): the tools
  described in the first user turn, calls as Python calls with keyword arguments in a
  ```` ```tool_code ```` block (one per line), results in a ```` ```tool_output ````
  block of a user turn. Read with `ast.parse` and `ast.literal_eval` only, never run.

`of_tokenizer(tokenizer)` picks one from the vocabulary. Where the checkpoint's own
chat template renders `tools` (Qwen3's, Llama 3.1's), the tools are passed to it;
otherwise the convention's system text carries them. Calls earlier in a conversation
(an assistant message's `tool_calls` in a first request's history) are rendered as the
convention writes them.

`tool_choice`: `auto` reads calls from the text; `none` reads none (the text is the
answer); `required` and a named function start the policy's turn with the convention's
call opening (`{"name": "` for the JSON conventions; the name too for a named one),
given as prompt tokens (policy mask False): the policy writes the rest, so every token
it is trained on is still one it sampled. A reply whose call markup cannot be read
(bad JSON, an unknown function, arguments that are not an object, too many calls) is
returned whole as text (`finish_reason` "stop"), counted, never a 500.

Model output is untrusted: scans are bounded regular expressions over at most
`MAX_CALL_CHARS` per call, JSON through `json.loads`, Python through `ast` on bounded
text; at most `MAX_CALLS` calls are read per message.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

MAX_TOOLS = 64  # functions one request may offer
MAX_CALLS = 8  # calls read from one message (more: the message is returned as text)
MAX_CALL_CHARS = 4000  # a call longer than this is not read
MAX_SCHEMA_CHARS = 16000  # one function's JSON schema, serialised
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A request's tools, tool choice or tool messages are not usable (a 400)."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function a request offers: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """OpenAI's `{"type": "function", "function": {...}}` form (what templates read)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class Call:
    """A call the policy wrote: its id, the function and the arguments as JSON text."""

    id: str
    name: str
    arguments: str  # a JSON object, as returned in `function.arguments`

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: "auto", "none", "required", or "function" with `name`."""

    mode: str = "auto"
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class Read:
    """What a policy message says: its text outside the calls, and the calls."""

    content: str | None
    calls: list[tuple[str, dict[str, Any]]]  # (name, arguments), in order
    malformed: bool  # call markup that could not be read: the message is text


# ---------------------------------------------------------------------- requests
def check_tools(tools: Sequence[Any]) -> list[Tool]:
    """A request's `tools`, checked: at most MAX_TOOLS functions, each with a valid and
    unique name, a string description and an object schema.

    Raises:
      ToolError: naming the tool and what is wrong.
    """
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolError(f'{where}: only {{"type": "function", "function": {{...}}}} tools')
        if set(t) - {"type", "function"}:
            raise ToolError(f"{where}: unknown fields {sorted(set(t) - {'type', 'function'})}")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolError(f"{where}.function: an object is needed")
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function: unknown fields {sorted(unknown)}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name: 1-64 characters of [A-Za-z0-9_-] needed")
        if any(o.name == name for o in out):
            raise ToolError(f"{where}.function.name: {name!r} is offered twice")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description: a string is needed")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters: a JSON schema of type object needed")
        if not isinstance(f.get("strict", False), bool):
            raise ToolError(f"{where}.function.strict: a boolean is needed")
        if len(json.dumps(parameters)) > MAX_SCHEMA_CHARS:
            raise ToolError(f"{where}.function.parameters: over {MAX_SCHEMA_CHARS} characters")
        out.append(Tool(name, description, parameters))
    return out


def check_choice(choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    """A request's `tool_choice` (None: "auto" with tools, "none" without).

    Raises:
      ToolError: an unknown mode, a function not offered, a choice without tools.
    """
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError(
                f"tool_choice={choice[:40]!r}: 'auto', 'none', 'required' or a function",
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice={choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            'tool_choice: {"type": "function", "function": {"name": ...}} needed', "tool_choice"
        )
    if not any(t.name == name for t in tools):
        raise ToolError(f"tool_choice: function {name[:64]!r} is not in tools", "tool_choice")
    return ToolChoice("function", name)


def call_id(episode: str, turn: int, index: int) -> str:
    """A call's id: stable for an episode's turn and the call's place in it."""
    digest = hashlib.sha256(f"{episode}/{turn}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


# ---------------------------------------------------------------------- conventions
class Convention(Protocol):
    name: str

    def describe(self, tools: Sequence[Tool]) -> str:
        """The system text that shows the tools and how to call them."""

    def opening(self, choice: ToolChoice) -> str:
        """The text the policy's turn starts with ("" unless a call is required)."""

    def read(self, text: str) -> Read:
        """The calls in a policy message (`text` starts with `opening`)."""

    def call_start(self, text: str) -> int:
        """Where call markup may begin in `text`, the start of a message still being
        written (`tool_choice` auto): its text before that is not part of a call whatever
        follows (len(text): none may begin). A stream shows no more than that."""

    def write(self, calls: Sequence[Call]) -> str:
        """Calls as the policy writes them (a conversation's earlier calls)."""

    def results(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        """The conversation's `tool` messages as the chat template is given them."""


def _schemas(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.schema()) for t in tools)


def _blocks(block: re.Pattern, opener: str, text: str) -> list[str] | None:
    """The bodies of `text`'s call blocks ([] when it opens none); None when one it
    opens is not read whole (unclosed, or longer than MAX_CALL_CHARS)."""
    opened = text.count(opener)
    bodies = block.findall(text) if opened else []
    return bodies if len(bodies) == opened else None


def marker_start(text: str, markers: Sequence[str]) -> int:
    """The first position of `text` where one of `markers` starts, or where its end is
    the beginning of one (the marker may be completed by text to come); len(text) if
    neither."""
    at = len(text)
    for m in markers:
        found = text.find(m)
        if found < 0:  # the longest tail of `text` that begins `m`
            tails = range(max(0, len(text) - len(m) + 1), len(text))
            found = next((i for i in tails if m.startswith(text[i:])), len(text))
        at = min(at, found)
    return at


def _arguments(obj: Any) -> dict[str, Any] | None:
    """A call's arguments as a dict (some models write them as a JSON string)."""
    if isinstance(obj, str):
        try:
            obj = json.loads(obj) if len(obj) <= MAX_CALL_CHARS else None
        except (ValueError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


class _Openings:
    """`Convention.opening` from a convention's two openings: `required` (any call) and
    `named` (a format string of `name`)."""

    required: str
    named: str

    def opening(self, choice: ToolChoice) -> str:
        if choice.mode == "required":
            return self.required
        if choice.mode == "function":
            return self.named.format(name=choice.name)
        return ""


class Hermes(_Openings):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (module docstring)."""

    name = "hermes"
    required = '<tool_call>\n{"name": "'
    named = '<tool_call>\n{{"name": "{name}", "arguments": '
    _CALL = re.compile(rf"<tool_call>(.{{0,{MAX_CALL_CHARS}}}?)</tool_call>", re.DOTALL)

    def describe(self, tools: Sequence[Tool]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_schemas(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def read(self, text: str) -> Read:
        bodies = _blocks(self._CALL, "<tool_call>", text)
        if bodies == []:
            return Read(text, [], False)
        if bodies is None or len(bodies) > MAX_CALLS:
            return Read(text, [], True)
        calls = []
        for body in bodies:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                return Read(text, [], True)
            name = obj.get("name") if isinstance(obj, dict) else None
            args = _arguments(obj.get("arguments", {})) if isinstance(obj, dict) else None
            if not isinstance(name, str) or args is None:
                return Read(text, [], True)
            calls.append((name, args))
        content = self._CALL.sub("", text).strip()
        return Read(content or None, calls, False)

    def call_start(self, text: str) -> int:
        return marker_start(text, ("<tool_call>",))

    def write(self, calls: Sequence[Call]) -> str:
        return "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n'
            "</tool_call>"
            for c in calls
        )

    def results(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        return [{"role": m["role"], "content": m["content"]} for m in messages]


class Llama3Json(_Openings):
    """`{"name": ..., "parameters": {...}}` as the whole message (module docstring)."""

    name = "llama3_json"
    required = '{"name": "'
    named = '{{"name": "{name}", "parameters": '
    _PYTHON_TAG = "<|python_tag|>"

    def describe(self, tools: Sequence[Tool]) -> str:
        return (
            "You are a helpful assistant with tool calling capabilities. When you receive a "
            "tool call response, use the output to format an answer to the original user "
            "question.\n\nGiven the following functions, please respond with a JSON for a "
            "function call with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + _schemas(tools)
        )

    def read(self, text: str) -> Read:
        body = text.strip()
        if body.startswith(self._PYTHON_TAG):
            body = body[len(self._PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return Read(text, [], False)
        if len(body) > MAX_CALL_CHARS * MAX_CALLS:
            return Read(text, [], True)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return Read(text, [], True)
            name = obj.get("name") if isinstance(obj, dict) else None
            raw = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else None
            args = _arguments(raw)
            if not isinstance(name, str) or args is None or len(calls) == MAX_CALLS:
                return Read(text, [], True)
            calls.append((name, args))
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return Read(text, [], True)  # text after a call: not a call message
            at = len(body) - len(rest)
        return Read(None, calls, False)

    def call_start(self, text: str) -> int:
        # A call is the whole message: one starting (after spaces) with `{` or the tag.
        body = text.lstrip()
        if not body or body.startswith("{") or marker_start(body, (self._PYTHON_TAG,)) == 0:
            return 0
        return len(text)

    def write(self, calls: Sequence[Call]) -> str:
        return "; ".join(
            f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls
        )

    def results(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        role = {"tool": "ipython"}
        return [{"role": role.get(m["role"], m["role"]), "content": m["content"]} for m in messages]


class GemmaToolCode(_Openings):
    """```` ```tool_code\\nname(key=value)\\n``` ```` (module docstring)."""

    name = "gemma_tool_code"
    required = "```tool_code\n"
    named = "```tool_code\n{name}("
    _BLOCK = re.compile(rf"```tool_code\n(.{{0,{MAX_CALL_CHARS}}}?)```", re.DOTALL)

    def describe(self, tools: Sequence[Tool]) -> str:
        return (
            "You have access to functions. To call functions, write them as Python calls with "
            "keyword arguments, one per line, in a block\n```tool_code\n"
            "function_name(argument=value)\n```\nand stop; their results come back in a "
            "```tool_output``` block. The functions, as JSON schemas:\n" + _schemas(tools)
        )

    def read(self, text: str) -> Read:
        blocks = _blocks(self._BLOCK, "```tool_code", text)
        if blocks == []:
            return Read(text, [], False)
        if blocks is None:
            return Read(text, [], True)
        calls = []
        for line in (ln.strip() for b in blocks for ln in b.splitlines()):
            if not line:
                continue
            call = _python_call(line)
            if call is None or len(calls) == MAX_CALLS:
                return Read(text, [], True)
            calls.append(call)
        if not calls:
            return Read(text, [], True)
        content = self._BLOCK.sub("", text).strip()
        return Read(content or None, calls, False)

    def call_start(self, text: str) -> int:
        return marker_start(text, ("```tool_code",))

    def write(self, calls: Sequence[Call]) -> str:
        lines = []
        for c in calls:
            args = ", ".join(f"{k}={v!r}" for k, v in json.loads(c.arguments).items())
            lines.append(f"{c.name}({args})")
        return "```tool_code\n" + "\n".join(lines) + "\n```"

    def results(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        after_result = False  # consecutive results share one user turn
        for m in messages:
            if m["role"] != "tool":
                out.append({"role": m["role"], "content": m["content"]})
                after_result = False
                continue
            block = f"```tool_output\n{m['content']}\n```"
            if after_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
        return out


def _python_call(line: str) -> tuple[str, dict[str, Any]] | None:
    """`name(key=literal, ...)` as (name, arguments); None for anything else."""
    try:
        node = ast.parse(line, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        json.dumps(args)  # a literal JSON cannot carry (a set, bytes, a complex) is not read
    except (TypeError, ValueError):
        return None
    return node.func.id, args


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (Hermes(), Llama3Json(), GemmaToolCode())}


def interpret(convention: Convention, text: str, tools: Sequence[Tool], choice: ToolChoice) -> Read:
    """The policy's message `text` (its opening included) as content and calls: with no
    tools or `tool_choice` "none" all text; markup that cannot be read, or a call of a
    function the request did not offer, makes the whole message text (`malformed`)."""
    if choice.mode == "none" or not tools:
        return Read(text, [], False)
    read = convention.read(text)
    names = {t.name for t in tools}
    if read.malformed or any(name not in names for name, _ in read.calls):
        return Read(text, [], True)
    return read


def template_messages(
    convention: Convention, messages: Sequence[dict[str, Any]]
) -> list[dict[str, str]]:
    """A conversation as the chat template is given it: an assistant message's calls
    written as the convention writes them, `tool` results in the convention's form."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [Call(c["id"], c["name"], c["arguments"]) for c in m["tool_calls"]]
            out.append(
                {"role": "assistant", "content": assistant_text(convention, m["content"], calls)}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return convention.results(out)


def assistant_text(convention: Convention, content: str | None, calls: Sequence[Call]) -> str:
    """An assistant message's text with its calls: the content, then the calls as the
    convention writes them (what the policy samples for such a message)."""
    return "\n".join(x for x in (content, convention.write(calls)) if x)


def with_tools(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """`messages` with the tools' system `text` after the system message's (a system
    message first if there is none)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{"role": first["role"], "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def of_tokenizer(tokenizer: Any) -> Convention:
    """The convention of the model whose tokenizer is `tokenizer`: Llama 3's for a
    Llama-3 vocabulary, Gemma's for Gemma's, Hermes otherwise (ChatML models, and any
    model: it is plain text). Two lookups, no vocabulary built: a run renders a prompt
    with tools through it (`chat_text`) for every prompt it draws."""
    style = tokenizer.template_style
    if style == "llama3" or tokenizer.token_to_id("<|python_tag|>") is not None:
        return CONVENTIONS["llama3_json"]
    if style == "gemma":
        return CONVENTIONS["gemma_tool_code"]
    return CONVENTIONS["hermes"]


def chat_text(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[Tool]) -> str:
    """The prompt text of a conversation offering `tools`, ready for the assistant: the
    checkpoint's template given the tools where it renders them, else the convention's
    system text; earlier calls and results as the convention writes them. The endpoint's
    first request and an environment's first prompt in a run (`data.tokenize`) both."""
    convention = of_tokenizer(tokenizer)
    shown = template_messages(convention, messages)
    if tools and not tokenizer.renders_tools:
        shown = with_tools(shown, convention.describe(tools))
    schemas = [t.schema() for t in tools] if tools and tokenizer.renders_tools else None
    return tokenizer.apply_chat_template(shown, tools=schemas)
