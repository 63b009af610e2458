"""The OpenAI request bodies the endpoint takes, decoded strictly, and its errors.

Bodies are decoded with msgspec into the structs below (unknown fields are refused by
name, types checked), then `check_*` applies the endpoint's limits and refuses, by
name, every parameter it does not honour. What is honoured: `model` (the one served),
`messages` / `prompt`, `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`,
`stop` (up to `Limits.max_stop` strings of any length: the returned text ends before the
first, the recorded tokens run through the token that completed it: turns.py), `seed`
(the episode's, fixed by its first request), `stream` (tokens sent as they are
generated: server.py), `logprobs` (the sampled tokens'
log-probs) with chat's `top_logprobs` / completions' `logprobs: k` (each token's k most
likely alternatives, k up to `MAX_TOP_LOGPROBS` and the engine's
`EngineConfig.top_logprobs`: refused past either, naming the limit; both under the
unmodified model distribution), `n` up to `Limits.max_n` (each choice an
episode of its own, forked from the shared prompt; streamed, the choices' chunks
interleaved, each naming its `index`; in a training run, whose `max_n` is its group
size, the choices are the run's episodes of one group: `PipelineBackend.choices`),
`tools` and
`tool_choice` (OpenAI function calling: model/function_calls.py), assistant messages'
`tool_calls` and `tool` messages answering them by `tool_call_id`, `response_format`
of type text, and vLLM's `ignore_eos` (exactly `max_tokens` tokens: for benchmarks).
Accepted and ignored (they change nothing here): `user`, `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, `parallel_tool_calls`, zero
penalties. Refused when set: `functions` / `function_call` (the legacy form of tools),
other `response_format`s, `logit_bias`, non-zero `frequency_penalty` /
`presence_penalty`, `echo`, `suffix`, `best_of` > 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import msgspec

from streamrl_jax.model import function_calls

MAX_TOP_LOGPROBS = 20  # OpenAI's bound of `top_logprobs`
# The header naming the episode a request is a turn of (each episode's client sends it).
EPISODE_HEADER = "x-episode-id"


class ApiError(Exception):
    """A refused request: HTTP `status`, OpenAI's error `type`, the message, the param."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 64
    max_tokens: int = 256  # per completion (the run's generation.max_new_tokens)
    max_stop: int = 4
    timeout_s: float = 120.0  # per completion: its generation
    body_timeout_s: float = 30.0  # per request: its body received
    max_inflight: int = 64  # requests generating at once; more are refused (429)
    max_n: int = 1  # choices a request may ask for (`n`; each its own episode)
    # An episode's tokens after its first prompt, sampled and appended (a run's episode
    # budget: config.episode_tokens); a turn gets at most what is left of it, and a
    # request with nothing left is refused (`turns.CONTEXT_EXCEEDED`). 0: no budget, the
    # engine's context only.
    episode_tokens: int = 0


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class _Function(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: _Function
    type: Literal["function"] = "function"
    index: int | None = None  # a streamed reply's calls, as OpenAI's clients accumulate them


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[_ToolCall] | None = None
    refusal: str | None = None
    # what an assistant message returned by OpenAI's clients carries back (model_dump)
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    # OpenAI's fields that change nothing here: accepted, ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool | None = None  # vLLM's extension: exactly max_tokens (benchmarks)


class ChatRequest(_Common):
    messages: list[Message] = []
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] = ""
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The body as `kind`, or a 400 naming the field (msgspec's path)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


def _refuse_set(req: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(req, name, None)
        if value not in (None, False, 0, 0.0, {}, []):
            raise ApiError(400, f"{name!r} is not supported by this endpoint", name)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a checked request asks the engine for."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    ignore_eos: bool = False
    n: int = 1  # choices: each its own episode, forked from the shared prompt
    top_logprobs: int = 0  # alternatives per token (with `logprobs`)


def check_common(
    req: _Common,
    limits: Limits,
    served: str,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int = 0,
) -> Sampling:
    """The parameters both APIs share, checked (module docstring); `top_logprobs`: the
    alternatives per token the request asks for (checked by its API's own check)."""
    if req.model != served:
        raise ApiError(
            404, f"model {req.model[:100]!r} is not served here; it serves {served!r}", "model"
        )
    _refuse_set(req, ("logit_bias", "frequency_penalty", "presence_penalty"))
    n = 1 if req.n is None else req.n
    if not 1 <= n <= limits.max_n:
        raise ApiError(
            400,
            f"n={n} must be in [1, {limits.max_n}] (each choice is an episode of its own)",
            "n",
        )
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        raise ApiError(
            400, f"max_tokens={max_tokens} must be in [1, {limits.max_tokens}]", "max_tokens"
        )
    t = 1.0 if req.temperature is None else req.temperature
    if not (math.isfinite(t) and 0.0 <= t <= 2.0):
        raise ApiError(400, f"temperature={t} must be in [0, 2]", "temperature")
    p = 1.0 if req.top_p is None else req.top_p
    if not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise ApiError(400, f"top_p={p} must be in (0, 1]", "top_p")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > limits.max_stop or any(not s or len(s) > 64 for s in stop):
        raise ApiError(400, f"stop: at most {limits.max_stop} strings of 1-64 characters", "stop")
    options = req.stream_options or {}
    if set(options) - {"include_usage"}:
        raise ApiError(
            400, f"stream_options: only include_usage is supported, got {sorted(options)}"
        )
    return Sampling(
        max_tokens=max_tokens or limits.max_tokens,
        temperature=float(t),
        top_p=float(p),
        stop=stop,
        seed=req.seed,
        stream=bool(req.stream),
        include_usage=bool(options.get("include_usage")),
        logprobs=logprobs,
        ignore_eos=bool(req.ignore_eos),
        n=n,
        top_logprobs=top_logprobs,
    )


@dataclasses.dataclass(frozen=True)
class Chat:
    """A checked chat request: the conversation (each message `{"role", "content"}`, an
    assistant message's calls as `tool_calls` [{"id", "name", "arguments"}], a tool
    result's `tool_call_id`), the tools offered and the tool choice."""

    messages: list[dict[str, Any]]
    tools: list[function_calls.Tool] = dataclasses.field(default_factory=list)
    choice: function_calls.ToolChoice = function_calls.ToolChoice("none")


def check_chat(req: ChatRequest, limits: Limits, served: str) -> tuple[Chat, Sampling]:
    """The conversation, its tools and the sampling, checked (module docstring)."""
    _refuse_set(req, ("functions", "function_call"))
    if req.response_format not in (None, {"type": "text"}):
        raise ApiError(
            400, "response_format: only {'type': 'text'} is supported", "response_format"
        )
    if not req.messages:
        raise ApiError(400, "messages: at least one message is needed", "messages")
    if len(req.messages) > limits.max_messages:
        n = len(req.messages)
        raise ApiError(400, f"messages: {n} messages; at most {limits.max_messages}", "messages")
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"top_logprobs={top} must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
        )
    if top and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
    try:
        tools = function_calls.check_tools(req.tools or [])
        choice = function_calls.check_choice(req.tool_choice, tools)
    except function_calls.ToolError as e:
        raise ApiError(400, str(e), e.param) from None
    max_tokens = req.max_completion_tokens or req.max_tokens
    sampling = check_common(req, limits, served, max_tokens, bool(req.logprobs), top)
    return Chat(_messages(req.messages), tools, choice), sampling


def _messages(given: list[Message]) -> list[dict[str, Any]]:
    """The messages as plain dicts; every `tool` message answers a call of the assistant
    message before it (by `tool_call_id`), once."""
    messages: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # the last assistant message's calls not answered yet
    for i, m in enumerate(given):
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ApiError(
                    400, f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        out: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant messages have tool_calls")
        if m.role == "assistant":
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in m.tool_calls or ()
            ]
            if calls:
                out["tool_calls"] = calls
            open_calls = {c["id"] for c in calls}
        elif m.role == "tool":
            if m.tool_call_id not in open_calls:
                raise ApiError(
                    400,
                    f"messages[{i}].tool_call_id={str(m.tool_call_id)[:64]!r}: not a call of "
                    "the assistant message before it (or already answered)",
                    "messages",
                )
            open_calls.discard(m.tool_call_id)
            out["tool_call_id"] = m.tool_call_id
        else:
            open_calls = set()
        messages.append(out)
    return messages


def check_completion(req: CompletionRequest, limits: Limits, served: str) -> tuple[str, Sampling]:
    """The prompt text and the sampling, checked."""
    _refuse_set(req, ("echo", "suffix"))
    if req.best_of not in (None, 1):
        raise ApiError(400, f"best_of={req.best_of}: not supported", "best_of")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt: a non-empty string is needed", "prompt")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"logprobs={req.logprobs} must be in [0, {MAX_TOP_LOGPROBS}] (the sampled tokens' "
            "log-probs and that many alternatives each)",
            "logprobs",
        )
    logprobs, top = req.logprobs is not None, req.logprobs or 0
    return prompt, check_common(req, limits, served, req.max_tokens, logprobs, top)
