"""Hostile or broken HTTP clients of the OpenAI-compatible endpoint (the endpoint cases
of `tools/bench_bad_inputs.py`).

One endpoint serves every case (`configs/agent.py:tiny`'s engine on loopback, built on
first use). Each case sends its bad request on a raw socket or with httpx and must get
the expected status with an OpenAI error body naming the problem, within its timeout;
afterwards the endpoint must still serve (a fresh episode's completion), hold no
episode busy and have logged no handler error (a 500).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TOKEN = "bad-requests-token-" + "0" * 32
USER = [{"role": "user", "content": "What is 2 + 2?"}]
_SERVED: dict = {}


@dataclasses.dataclass(frozen=True)
class HttpCase:
    name: str
    expect: str  # "<status> <text in the error message>" or the outcome's text
    send: Callable[[dict], str]  # the served endpoint -> the outcome


def _serve() -> dict:
    if _SERVED:
        return _SERVED
    import importlib.util

    import jax

    # The tiny job's two devices (a test process has set its own already).
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", 2)

    from streamrl_jax.config import from_config_dict
    from streamrl_jax.endpoint import api
    from streamrl_jax.endpoint.client import EndpointClient
    from streamrl_jax.endpoint.kit import serve
    from streamrl_jax.pipeline import components

    spec = importlib.util.spec_from_file_location("agent", os.path.join(REPO, "configs/agent.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny")
    c.log.tensorboard = False
    cfg = from_config_dict(c.to_dict())
    parts = components.build(cfg, warm=False)
    service = parts.generation.service(
        [p.params for p in parts.initial_weights], 0, on_chunk=lambda r: None,
        precompile=False, continuations=False,
    )  # fmt: skip
    limits = api.Limits(
        max_tokens=cfg.generation.max_new_tokens, max_messages=8, body_timeout_s=2.0
    )
    endpoint, server = serve(service, parts.tokenizer, TOKEN, limits)
    _SERVED.update(endpoint=endpoint, server=server, backend=endpoint.backend, url=server.url,
                   client=EndpointClient(server.url, TOKEN))  # fmt: skip
    for n in (2, 6):  # compiles what the cases run
        with _SERVED["client"].episode() as (oc, _):
            oc.chat.completions.create(model="policy", messages=USER, max_tokens=n)
    return _SERVED


def close() -> None:
    if _SERVED:
        _SERVED["server"].stop()
        _SERVED["backend"].close()
        _SERVED.clear()


def _post(s: dict, path: str, body: bytes, headers: dict | None = None, token: str | None = TOKEN):
    import httpx

    h = {"Authorization": f"Bearer {token}"} if token else {}
    h.update(headers or {})
    r = httpx.post(s["url"] + path, content=body, headers=h, timeout=30)
    try:
        message = r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not an OpenAI error body: shown as it is
        message = r.text[:200]
    return f"{r.status_code} {message}"


def _chat(**fields) -> bytes:
    return json.dumps({"model": "policy", "messages": USER, **fields}).encode()


def _simple(
    body: bytes,
    headers: dict | None = None,
    token: str | None = TOKEN,
    episode=True,
    path: str = "/v1/chat/completions",
):
    def send(s: dict) -> str:
        h = dict(headers or {})
        if episode:
            h.setdefault("X-Episode-Id", s["client"].open())
        return _post(s, path, body, h, token)

    return send


def _closed(s: dict) -> str:
    eid = s["client"].open()
    s["client"].close(eid)
    return _post(s, "/v1/chat/completions", _chat(max_tokens=2), {"X-Episode-Id": eid})


def _raw_socket(s: dict) -> socket.socket:
    host, port = s["url"].removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _request_head(eid: str, length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"X-Episode-Id: {eid}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _settled(s: dict, eid: str, timeout: float = 30.0) -> bool:
    """Whether episode `eid`'s turn was recorded and the episode let go in time."""
    book = s["endpoint"].book
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = book._open.get(eid)
        if rec is None or (rec.turns and not rec.busy):
            return True
        time.sleep(0.01)
    return False


def _leaves_mid_stream(s: dict) -> str:
    eid = s["client"].open()
    body = _chat(max_tokens=6, stream=True)
    with _raw_socket(s) as sock:
        sock.sendall(_request_head(eid, len(body)) + body)
        sock.recv(32)  # the first bytes, then gone
    if not _settled(s, eid):
        return "hang: the episode stayed busy"
    return f"recorded {s['endpoint'].book.close(eid).turns} turn(s) of the stream the client left"


def _never_reads(s: dict) -> str:
    eid = s["client"].open()
    body = _chat(max_tokens=6, stream=True)
    with _raw_socket(s) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.sendall(_request_head(eid, len(body)) + body)
        if not _settled(s, eid):
            return "hang: the episode stayed busy"
        turns = s["endpoint"].book.close(eid).turns
        return f"recorded {turns} turn(s) for a client that never read"


def _never_finishes_body(s: dict) -> str:
    eid = s["client"].open()
    with _raw_socket(s) as sock:
        sock.sendall(_request_head(eid, 1000) + b'{"model": "policy"')
        reply = sock.recv(4096).decode(errors="replace")
    status = reply.split(" ", 2)[1] if reply.startswith("HTTP/1.1") else "none"
    return f"{status} {reply.rsplit(chr(10), 1)[-1][:200]}"


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    },
}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    ],
}


def _tools_changed(s: dict) -> str:
    eid = s["client"].open()
    h = {"X-Episode-Id": eid}
    first = _post(s, "/v1/chat/completions", _chat(max_tokens=2, tools=[ADD]), h)
    if not first.startswith("200"):
        return f"the first turn failed: {first}"
    rec = s["endpoint"].book._open[eid]
    messages = [*USER, {"role": "assistant", "content": rec.messages[-1]["content"]},
                {"role": "user", "content": "Again."}]  # fmt: skip
    body = _chat(messages=messages, max_tokens=2)  # no tools: not what the prompt holds
    got = _post(s, "/v1/chat/completions", body, h)
    s["client"].close(eid)
    return got


def _tool_cases() -> list[HttpCase]:
    """Malformed tool schemas, tool choices and tool messages: one clear 400 each."""

    def tool(**function):
        return {"type": "function", "function": {"name": "add", **function}}

    many = [tool(name=f"f{i}") for i in range(65)]
    answer = {"role": "tool", "tool_call_id": "call_9", "content": "3"}
    return [
        HttpCase("endpoint: tool without a function", "400 tools[0].function: an object is",
                 _simple(_chat(tools=[{"type": "function"}]))),
        HttpCase("endpoint: tool of another type", "400 tools[0]: only {",
                 _simple(_chat(tools=[{"type": "code_interpreter"}]))),
        HttpCase("endpoint: tool with a bad name", "400 tools[0].function.name: 1-64",
                 _simple(_chat(tools=[tool(name="rm -rf /")]))),
        HttpCase("endpoint: tool offered twice", "400 tools[1].function.name: 'add' is offered",
                 _simple(_chat(tools=[ADD, ADD]))),
        HttpCase("endpoint: tool parameters not an object schema", "400 tools[0].function.param",
                 _simple(_chat(tools=[tool(parameters={"type": "string"})]))),
        HttpCase("endpoint: tool with an unknown field", "400 tools[0].function: unknown fields",
                 _simple(_chat(tools=[tool(returns="int")]))),
        HttpCase("endpoint: oversized tool list", "400 tools: 65 tools; at most 64",
                 _simple(_chat(tools=many))),
        HttpCase("endpoint: oversized tool schema", "400 tools[0].function.parameters: over",
                 _simple(_chat(tools=[tool(parameters={"type": "object", "x": "y" * 20000})]))),
        HttpCase("endpoint: tool_choice of a function not offered", "400 tool_choice: function",
                 _simple(_chat(tools=[ADD], tool_choice={"type": "function",
                                                         "function": {"name": "mul"}}))),
        HttpCase("endpoint: tool_choice required without tools", "400 tool_choice='required' ne",
                 _simple(_chat(tool_choice="required"))),
        HttpCase("endpoint: unknown tool_choice", "400 tool_choice='sometimes'",
                 _simple(_chat(tools=[ADD], tool_choice="sometimes"))),
        HttpCase("endpoint: tool message with an unknown id", "400 messages[2].tool_call_id=",
                 _simple(_chat(tools=[ADD], messages=[*USER, CALLED, answer]))),
        HttpCase("endpoint: tool message without a call", "400 messages[1].tool_call_id=None",
                 _simple(_chat(messages=[*USER, {"role": "tool", "content": "3"}]))),
        HttpCase("endpoint: malformed tool call in history", "400 invalid request: Object missing",
                 _simple(_chat(messages=[*USER, {"role": "assistant", "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "add"}}]}]))),
        HttpCase("endpoint: tool calls on a user message", "400 messages[0]: only assistant",
                 _simple(_chat(messages=[{**USER[0], "tool_calls": CALLED["tool_calls"]}]))),
        HttpCase("endpoint: tools changed within an episode", "400 tools: episode",
                 _tools_changed),
    ]  # fmt: skip


def _sampling_cases() -> list[HttpCase]:
    """Stop strings and top log-probs out of bounds (the tiny job's engine keeps no
    alternatives: `generation.top_logprobs` 0)."""
    completion = json.dumps({"model": "policy", "prompt": "2 + 2 =", "logprobs": 21}).encode()
    return [
        HttpCase("endpoint: top_logprobs past OpenAI's 20", "400 top_logprobs=21 must be in",
                 _simple(_chat(logprobs=True, top_logprobs=21))),
        HttpCase("endpoint: top_logprobs past the engine's", "400 top_logprobs=3: this endpoint"
                 " returns at most 0", _simple(_chat(logprobs=True, top_logprobs=3))),
        HttpCase("endpoint: top_logprobs without logprobs", "400 top_logprobs needs logprobs",
                 _simple(_chat(top_logprobs=2))),
        HttpCase("endpoint: negative top_logprobs", "400 top_logprobs=-1 must be in",
                 _simple(_chat(logprobs=True, top_logprobs=-1))),
        HttpCase("endpoint: completions logprobs past 20", "400 logprobs=21 must be in",
                 _simple(completion, path="/v1/completions")),
        HttpCase("endpoint: five stop strings", "400 stop: at most 4 strings",
                 _simple(_chat(stop=["a", "b", "c", "d", "e"]))),
        HttpCase("endpoint: an empty stop string", "400 stop: at most 4 strings of 1-64",
                 _simple(_chat(stop=[""]))),
        HttpCase("endpoint: an oversized stop string", "400 stop: at most 4 strings of 1-64",
                 _simple(_chat(stop="x" * 65))),
        HttpCase("endpoint: a stop string not a string", "400 invalid request: Expected `str`",
                 _simple(_chat(stop=[7]))),
    ]  # fmt: skip


def cases() -> list[HttpCase]:
    big = b'{"model": "policy", "messages": [' + b" " * (2 << 20) + b"]}"
    return [
        HttpCase("endpoint: malformed JSON", "400 malformed JSON body",
                 _simple(b'{"model": "policy", "messages": [')),
        HttpCase("endpoint: oversized body", "413 request body of", _simple(big)),
        HttpCase("endpoint: too many messages", "400 messages: 9 messages; at most 8",
                 _simple(_chat(messages=USER * 9))),
        HttpCase("endpoint: missing token", "401 missing or wrong bearer token",
                 _simple(_chat(), token=None)),
        HttpCase("endpoint: wrong token", "401 missing or wrong bearer token",
                 _simple(_chat(), token="x" * 51)),
        HttpCase("endpoint: unknown model", "404 model 'gpt-4' is not served",
                 _simple(_chat(model="gpt-4"))),
        HttpCase("endpoint: max_tokens beyond the limit", "400 max_tokens=100000 must be in",
                 _simple(_chat(max_tokens=100000))),
        HttpCase("endpoint: unknown episode id", "404 episode 'ep-forged' was not issued",
                 _simple(_chat(), {"X-Episode-Id": "ep-forged"}, episode=False)),
        HttpCase("endpoint: closed episode id", "is closed (closed by its client)", _closed),
        HttpCase("endpoint: unsupported parameter", "400 'functions' is not supported",
                 _simple(_chat(functions=[{"name": "add"}]))),
        HttpCase("endpoint: unsupported response format", "400 response_format: only",
                 _simple(_chat(response_format={"type": "json_object"}))),
        *_tool_cases(),
        *_sampling_cases(),
        HttpCase("endpoint: client leaves mid-stream", "recorded 1 turn(s) of the stream",
                 _leaves_mid_stream),
        HttpCase("endpoint: client never reads", "recorded 1 turn(s) for a client that never",
                 _never_reads),
        HttpCase("endpoint: body never finished", "408 ", _never_finishes_body),
    ]  # fmt: skip


def run(case: HttpCase) -> tuple[str, str]:
    """(outcome, detail): "clear", "wrong", "hang" or "traceback" (a handler error)."""
    s = _serve()
    errors = s["endpoint"].counts.get("errors", 0)
    start = time.monotonic()
    try:
        got = case.send(s)
    except TimeoutError as e:
        return "hang", repr(e)
    except Exception as e:  # noqa: BLE001 - a client-side failure is a wrong outcome
        return "wrong", repr(e)
    if time.monotonic() - start > 60:
        return "hang", f"{got} after {time.monotonic() - start:.0f} s"
    if got.startswith("500") or s["endpoint"].counts.get("errors", 0) != errors:
        return "traceback", got
    eid = s["client"].open()
    healthy = _post(s, "/v1/chat/completions", _chat(max_tokens=2), {"X-Episode-Id": eid})
    s["client"].close(eid)  # its kept slot given up
    if not healthy.startswith("200"):
        return "wrong", f"{got}; then the endpoint answered {healthy}"
    return ("clear" if case.expect in got else "wrong"), got
