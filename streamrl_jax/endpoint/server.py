"""The OpenAI-compatible HTTP endpoint: FastAPI on uvicorn, in a thread of its own.

Routes (every one needs `Authorization: Bearer <token>`):

* `GET /v1/models`: the one model served.
* `POST /v1/episodes`: a new episode's id (`{"id": "ep-…"}`); a scaffold sends it as
  the `X-Episode-Id` header of every request of that episode (`client.py`). A request
  without one is an episode of its own where `single_requests` (a served endpoint; a
  training run's refuses it: its episodes are the run's).
* `POST /v1/episodes/{id}/close`: ends the episode; returns its counts. (A training
  run closes its episodes itself and trains the recorded tokens.)
* `POST /v1/chat/completions`, `POST /v1/completions`: one completion of the episode
  (api.py: what is honoured and what is refused by name; turns.py: how the request
  becomes the episode's next turn; model/function_calls.py: tool calling).
  `stream: true` sends the completion as server-sent events, one chunk per token (a
  turn's tool calls: one chunk each), once its turn has finished generating. Each choice
  carries, beside OpenAI's fields, `token_ids` and `versions`: the tokens as sampled
  and the weights version of each.

The trust boundary (docs/endpoint.md): loopback unless `allow_remote`; the bearer
token compared in constant time; a body over `Limits.max_body_bytes` refused (413)
before it is read, and read within the request deadline; at most
`Limits.max_inflight` requests generating (more: 429, not a queue) and uvicorn's
`limit_concurrency` connections (more: 503); a body must arrive within
`Limits.body_timeout_s` (408) and each completion waits at most `Limits.timeout_s`
(504; the episode is then closed, its late sample dropped). A streamed completion is
recorded before its first event is sent, so a client that leaves mid-stream or never
reads loses nothing and holds no episode (only its connection, until it closes); an
episode id the book did not issue (404) or one closed (409) is refused. Errors are
OpenAI's JSON error body with a message naming what is wrong; a handler bug is a 500
with its repr, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.backend import Backend
from streamrl_jax.endpoint.book import BookError, EpisodeBook
from streamrl_jax.endpoint.turns import Turn, Turns

EPISODE_HEADER = "x-episode-id"


def endpoint_token(secret: bytes) -> str:
    """The bearer token of a run whose secret is `secret`."""
    return hmac.new(secret, b"streamrl-jax endpoint token", hashlib.sha256).hexdigest()


class Endpoint:
    """The endpoint's state: the book, the turns, the backend, the limits."""

    def __init__(
        self,
        turns: Turns,
        backend: Backend,
        token: str,
        *,
        served: str = "policy",
        limits: api.Limits = api.Limits(),
        book: EpisodeBook | None = None,
        single_requests: bool = True,
    ):
        """`single_requests`: a request without an episode id is an episode of its own
        (opened for it, closed after it); False where every episode must be one the
        caller opened (a training run's endpoint: its episodes are the run's)."""
        if len(token) < 16:
            raise ValueError("endpoint: the bearer token must be at least 16 characters")
        self.turns, self.backend, self.served, self.limits = turns, backend, served, limits
        self.book = book or EpisodeBook()
        self._token = token.encode()
        self._inflight = 0
        self.single_requests = single_requests
        self.counts = {
            "requests": 0, "refused": 0, "deadline": 0, "errors": 0, "tool_calls": 0,
            "malformed_calls": 0, "single_requests": 0,
        }  # fmt: skip

    # ------------------------------------------------------------------ checks
    def authorize(self, header: str | None) -> None:
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self._token):
            raise api.ApiError(401, "missing or wrong bearer token (Authorization: Bearer …)")

    async def body(self, request: Any) -> bytes:
        """The request body, refused (413) past the limit, read within the deadline."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise api.ApiError(413, f"request body of {declared} bytes; at most {limit}")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise api.ApiError(413, f"request body over {limit} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        wait = self.limits.body_timeout_s
        try:
            return await asyncio.wait_for(read(), wait)
        except TimeoutError:
            raise api.ApiError(408, f"request body not received in {wait:.0f} s") from None
        except ClientDisconnect:
            raise api.ApiError(400, "the client left before sending its whole body") from None

    # ------------------------------------------------------------------ a completion
    async def choices(self, eid: str | None, kind: str, said: Any, s: api.Sampling) -> list[Turn]:
        """The request's `s.n` completions, each its own episode: the first of episode
        `eid` (which must have no turn yet when n > 1), the others of episodes opened
        for them (returned in each choice's `episode_id`, for the client to go on with
        and close), or every one an episode of its own without `eid`. Submitted
        together, so the engine prefills their shared prompt once and forks its KV
        (`share_prefill`). With a `seed`, choice i samples with seed + i."""
        if s.n == 1:
            return [await self.complete(eid, kind, said, s)]
        if eid is not None and not self.book.fresh(eid):
            raise api.ApiError(400, f"n={s.n}: episode {eid[:80]!r} is not a new episode", "n")
        opened = [self.book.open() for _ in range(s.n - 1)] if eid is not None else []
        ids = [eid, *opened] if eid is not None else [None] * s.n
        each = [
            dataclasses.replace(s, n=1, seed=None if s.seed is None else s.seed + i)
            for i in range(s.n)
        ]
        got = await asyncio.gather(
            *(self.complete(e, kind, said, c) for e, c in zip(ids, each, strict=True)),
            return_exceptions=True,
        )
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            for e in opened:
                with contextlib.suppress(BookError):
                    self.book.close(e, "a sibling choice failed")
                self.backend.release(e)
            raise failed[0]
        return list(got)

    async def complete(self, eid: str | None, kind: str, said: Any, s: api.Sampling) -> Turn:
        """One completion of episode `eid` (`said`: chat messages or prompt text)."""
        if self._inflight >= self.limits.max_inflight:
            raise api.ApiError(
                429, f"{self._inflight} requests are generating (the endpoint's limit); retry"
            )
        params = self.turns.sampling(s)  # the request's own checks first, then the episode's
        self._inflight += 1
        single = eid is None and self.single_requests
        try:
            if single:
                eid = self.book.open()
                self.counts["single_requests"] += 1
            rec = self.book.take(eid)
            try:
                prepare = self.turns.chat if kind == "chat" else self.turns.completion
                request = prepare(rec, said, s, params)
                try:
                    future = self.backend.submit(request)
                except ValueError as e:
                    raise api.ApiError(400, str(e)) from None
                try:
                    sample = await asyncio.wait_for(
                        asyncio.wrap_future(future), self.limits.timeout_s
                    )
                except TimeoutError:
                    future.cancel()
                    self.backend.release(rec.id)
                    self.book.fail(rec, "a completion passed its deadline")
                    self.counts["deadline"] += 1
                    raise api.ApiError(
                        504,
                        f"episode {rec.id}: generation did not finish in "
                        f"{self.limits.timeout_s:.0f} s; the episode is closed",
                    ) from None
                turn = self.turns.commit(rec, request, sample, said)
                self.counts["tool_calls"] += len(turn.calls)
                self.counts["malformed_calls"] += turn.malformed
                return turn
            finally:
                self.book.give_back(rec)
        finally:
            self._inflight -= 1
            if single and eid is not None:
                self._end_single(eid)

    def _end_single(self, eid: str) -> None:
        """An episode of one request is over: closed, its kept slot given up."""
        with contextlib.suppress(BookError):  # closed already (its deadline passed)
            self.book.close(eid, "an episode of one request")
        self.backend.release(eid)


# ---------------------------------------------------------------------- responses
def _token_text(turns: Turns, ids: np.ndarray) -> list[str]:
    """Each token's text, cut so that the pieces join to the whole decode."""
    tok = turns.ctx.tokenizer
    out, before = [], ""
    for i in range(len(ids)):
        now = tok.decode(ids[: i + 1])
        out.append(now[len(before) :] if now.startswith(before) else now)
        before = now
    return out


def _token_entry(turns: Turns, token: int, logprob: float) -> dict[str, Any]:
    text = turns.ctx.tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _alternatives(turn: Turn, s: api.Sampling) -> list[list[tuple[int, float]]]:
    """Each token's `s.top_logprobs` most likely (id, log-prob), most likely first."""
    k = s.top_logprobs
    if not k or turn.top_ids is None or turn.top_logprobs is None:
        return [[] for _ in turn.token_ids]
    ids, lps = turn.top_ids[:, :k].tolist(), turn.top_logprobs[:, :k].tolist()
    return [list(zip(i, lp, strict=True)) for i, lp in zip(ids, lps, strict=True)]


def _logprob_entries(turns: Turns, turn: Turn, s: api.Sampling) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: each token, its log-prob and its alternatives."""
    entries = []
    ids, lps, tops = turn.token_ids.tolist(), turn.logprobs.tolist(), _alternatives(turn, s)
    for t, lp, top in zip(ids, lps, tops, strict=True):
        alternatives = [_token_entry(turns, i, v) for i, v in top]
        entries.append({**_token_entry(turns, t, lp), "top_logprobs": alternatives})
    return entries


def _top_dicts(turns: Turns, turn: Turn, s: api.Sampling) -> list[dict[str, float]] | None:
    """Completions' `top_logprobs`: per token {text: log-prob} of its alternatives (two
    that read the same: the likelier), None when none were asked for."""
    if not s.top_logprobs:
        return None
    tok = turns.ctx.tokenizer
    out = []
    for top in _alternatives(turn, s):
        d: dict[str, float] = {}
        for i, v in top:
            d.setdefault(tok.decode([i], skip_special_tokens=False), v)
        out.append(d)
    return out


def _usage(turns: Turn | list[Turn]) -> dict[str, int]:
    """Tokens read (the shared prompt once) and sampled (every choice's)."""
    turns = turns if isinstance(turns, list) else [turns]
    n = sum(len(t.token_ids) for t in turns)
    prompt = turns[0].prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def _extras(turn: Turn) -> dict[str, Any]:
    return {
        "token_ids": turn.token_ids.tolist(),
        "versions": turn.versions.tolist(),
        "episode_id": turn.episode,
    }


def _header(ep: Endpoint, turn: Turn, prefix: str, kind: str) -> dict[str, Any]:
    """A response's (or each event's) id, object kind, time and model."""
    return {
        "id": f"{prefix}-{turn.episode}-{int(time.time() * 1e6)}",
        "object": kind,
        "created": int(time.time()),
        "model": ep.served,
    }


def _message(turn: Turn) -> dict[str, Any]:
    """The assistant message of a chat turn: its text, or its calls (and any text
    outside them)."""
    if not turn.calls:
        return {"role": "assistant", "content": turn.content}
    calls = [c.openai() for c in turn.calls]
    return {"role": "assistant", "content": turn.content, "tool_calls": calls}


def chat_body(ep: Endpoint, turns: list[Turn], s: api.Sampling) -> dict[str, Any]:
    choices = []
    for i, turn in enumerate(turns):
        logprobs = {"content": _logprob_entries(ep.turns, turn, s)} if s.logprobs else None
        choices.append(
            {
                "index": i,
                "message": _message(turn),
                "logprobs": logprobs,
                "finish_reason": turn.finish_reason,
                **_extras(turn),
            }
        )
    return {
        **_header(ep, turns[0], "chatcmpl", "chat.completion"),
        "choices": choices,
        "usage": _usage(turns),
    }


def completion_body(ep: Endpoint, turns: list[Turn], s: api.Sampling) -> dict[str, Any]:
    choices = []
    for i, turn in enumerate(turns):
        logprobs = None
        if s.logprobs:
            pieces = _token_text(ep.turns, turn.token_ids)
            offsets = np.cumsum([0, *map(len, pieces)])[:-1].tolist()
            logprobs = {
                "tokens": pieces,
                "token_logprobs": turn.logprobs.tolist(),
                "top_logprobs": _top_dicts(ep.turns, turn, s),
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": i,
                "text": turn.text,
                "logprobs": logprobs,
                "finish_reason": turn.finish_reason,
                **_extras(turn),
            }
        )
    return {
        **_header(ep, turns[0], "cmpl", "text_completion"),
        "choices": choices,
        "usage": _usage(turns),
    }


def _shown_pieces(ep: Endpoint, turn: Turn) -> list[tuple[str, int]]:
    """Each token's text and its offset in the completion, a stop string cut away (it
    is not part of the completion)."""
    out, at = [], 0
    for piece in _token_text(ep.turns, turn.token_ids):
        piece = piece[: max(0, len(turn.text) - at)]
        out.append((piece, at))
        at += len(piece)
    return out


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def chat_events(ep: Endpoint, turn: Turn, s: api.Sampling) -> AsyncIterator[bytes]:
    """The completion as chat.completion.chunk events, one token each (a turn that made
    tool calls: its text, then one event per call)."""
    base = _header(ep, turn, "chatcmpl", "chat.completion.chunk")

    def event(choices: list, **more: Any) -> bytes:
        return _event({**base, "choices": choices, **more})

    yield event(
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    )
    if turn.calls:
        for chunk in _call_events(ep, turn, s, event):
            yield chunk
        return
    entries = _logprob_entries(ep.turns, turn, s) if s.logprobs else None
    if turn.content != turn.text:  # a required call's opening, not read as a call
        head = turn.content[: len(turn.content) - len(turn.text)]
        yield event([{"index": 0, "delta": {"content": head}, "finish_reason": None}])
    for i, (piece, _) in enumerate(_shown_pieces(ep, turn)):
        logprobs = {"content": [entries[i]]} if entries is not None else None
        choice = {
            "index": 0,
            "delta": {"content": piece},
            "logprobs": logprobs,
            "finish_reason": None,
            "token_ids": [int(turn.token_ids[i])],
            "versions": [int(turn.versions[i])],
        }
        yield event([choice])
    yield event([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": turn.finish_reason}])
    if s.include_usage:
        yield event([], usage=_usage(turn))
    yield b"data: [DONE]\n\n"


def _call_events(ep: Endpoint, turn: Turn, s: api.Sampling, event: Any) -> list[bytes]:
    """A turn that made tool calls as chunks: its text outside the calls, each call
    (whole: id, name, arguments), the finish; every token's id, version and log-prob on
    the first."""
    entries = _logprob_entries(ep.turns, turn, s) if s.logprobs else None
    first = {
        "index": 0,
        "delta": {"content": turn.content} if turn.content else {},
        "logprobs": {"content": entries} if entries is not None else None,
        "finish_reason": None,
        **_extras(turn),
    }
    out = [event([first])]
    for i, c in enumerate(turn.calls):
        delta = {"tool_calls": [{"index": i, **c.openai()}]}
        out.append(event([{"index": 0, "delta": delta, "finish_reason": None}]))
    out.append(event([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]))
    if s.include_usage:
        out.append(event([], usage=_usage(turn)))
    out.append(b"data: [DONE]\n\n")
    return out


async def completion_events(ep: Endpoint, turn: Turn, s: api.Sampling) -> AsyncIterator[bytes]:
    """The completion as text_completion events, one token each."""
    base = _header(ep, turn, "cmpl", "text_completion")
    pieces = _shown_pieces(ep, turn)
    tops = _top_dicts(ep.turns, turn, s)
    for i, (piece, at) in enumerate(pieces):
        logprobs = None
        if s.logprobs:
            logprobs = {
                "tokens": [piece],
                "token_logprobs": [float(turn.logprobs[i])],
                "top_logprobs": None if tops is None else [tops[i]],
                "text_offset": [at],
            }
        last = i == len(pieces) - 1
        choice = {
            "index": 0,
            "text": piece,
            "logprobs": logprobs,
            "finish_reason": turn.finish_reason if last else None,
            "token_ids": [int(turn.token_ids[i])],
            "versions": [int(turn.versions[i])],
        }
        yield _event({**base, "choices": [choice]})
    if s.include_usage:
        yield _event({**base, "choices": [], "usage": _usage(turn)})
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------- the app
def make_app(ep: Endpoint):
    """The FastAPI application of `ep`."""
    app = FastAPI(title="streamrl_jax endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, param: str | None = None, code: str | None = None):
        ep.counts["refused"] += 1
        body = api.ApiError(status, message, param, code).body()
        return JSONResponse(body, status_code=status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        ep.counts["requests"] += 1
        try:
            ep.authorize(request.headers.get("authorization"))
            return await call_next(request)
        except api.ApiError as e:
            return error(e.status, str(e), e.param, e.code)
        except BookError as e:
            return error(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - a bug: named, logged, a 500
            ep.counts["errors"] += 1
            logging.exception("endpoint: %s %s failed", request.method, request.url.path)
            return error(500, f"endpoint error: {e!r}")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": ep.served, "object": "model", "created": 0, "owned_by": "streamrl_jax"}
            ],
        }

    @app.post("/v1/episodes")
    async def open_episode() -> dict[str, Any]:
        return {"id": ep.book.open(), "object": "episode"}

    @app.post("/v1/episodes/{eid}/close")
    async def close_episode(eid: str) -> dict[str, Any]:
        rec = ep.book.close(eid)
        ep.backend.release(eid)
        policy = 0 if rec.sample is None else len(rec.sample.policy_token_ids())
        return {"id": eid, "object": "episode", "turns": rec.turns, "policy_tokens": policy}

    async def handle(request: Request, kind: str):
        body = await ep.body(request)
        eid = request.headers.get(EPISODE_HEADER)
        if kind == "chat":
            said, s = api.check_chat(api.decode(body, api.ChatRequest), ep.limits, ep.served)
        else:
            said, s = api.check_completion(
                api.decode(body, api.CompletionRequest), ep.limits, ep.served
            )
        turns = await ep.choices(eid, kind, said, s)
        if s.stream:
            events = chat_events if kind == "chat" else completion_events
            return StreamingResponse(events(ep, turns[0], s), media_type="text/event-stream")
        make = chat_body if kind == "chat" else completion_body
        return JSONResponse(make(ep, turns, s))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    return app


class EndpointServer:
    """uvicorn serving `make_app(endpoint)` on a thread of its own (`start` / `stop`)."""

    def __init__(
        self,
        endpoint: Endpoint,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        allow_remote: bool = False,
        max_connections: int = 256,
    ):
        import ipaddress

        import uvicorn

        if not allow_remote and not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"endpoint: host {host} is not loopback; pass allow_remote=True")
        self.endpoint = endpoint
        config = uvicorn.Config(
            make_app(endpoint),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            # uvicorn's own logging config would run dictConfig, which closes every
            # handler the process has (the run's log file and console among them).
            log_config=None,
            limit_concurrency=max_connections,
            timeout_keep_alive=5,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="endpoint", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        """Serves; returns the base URL (http://host:port) once listening.

        Raises:
          TimeoutError: uvicorn did not start listening within `timeout` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TimeoutError(f"endpoint: not listening after {timeout:.0f} s")
            time.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"endpoint: the server did not stop in {timeout:.0f} s")
