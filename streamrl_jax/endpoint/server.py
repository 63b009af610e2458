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
  `stream: true` sends the completion as server-sent events while its turn generates:
  after each engine round trip, the text its new tokens settle (streaming.py: a
  character split across tokens once whole, never the stop token or text that may
  begin a stop string or a tool call), then what the recorded turn adds (its tool
  calls: one chunk each, whole), the finish and the usage. With `n` > 1 the choices
  stream interleaved, each chunk one choice's (`index`), each with its own finish, the
  usage of all once at the end. Each choice (each chunk) carries, beside OpenAI's
  fields, `token_ids` and `versions`: the tokens as sampled and the weights version of
  each.

The trust boundary (docs/endpoint.md): loopback unless `allow_remote`; the bearer
token compared in constant time; a body over `Limits.max_body_bytes` refused (413)
before it is read, and read within the request deadline; at most
`Limits.max_inflight` requests generating (more: 429, not a queue) and uvicorn's
`limit_concurrency` connections (more: 503); a body must arrive within
`Limits.body_timeout_s` (408) and each completion waits at most `Limits.timeout_s`
(504; the episode is then closed, its late sample dropped; a stream already sent ends
with OpenAI's error body as an event). A streamed turn is recorded by a task of its own
(`Endpoint.finish_apart`), so a client that leaves mid-stream or never reads loses
nothing and holds no episode once its turn ends; the tokens a slow reader has not taken
are coalesced in one buffer (at most the turn's), so no client blocks the engine. An
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
from concurrent.futures import Future
from typing import Any

import numpy as np
from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.backend import Backend
from streamrl_jax.endpoint.book import BookError, EpisodeBook, Record
from streamrl_jax.endpoint.streaming import ShownText, TokenFeed, call_hold
from streamrl_jax.endpoint.turns import Turn, Turns
from streamrl_jax.generation.types import GenerationRequest, Sample

EPISODE_HEADER = api.EPISODE_HEADER


def endpoint_token(secret: bytes) -> str:
    """The bearer token of a run whose secret is `secret`."""
    return hmac.new(secret, b"streamrl-jax endpoint token", hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Submitted:
    """A completion handed to the backend (`Endpoint.start`), its turn not yet recorded."""

    rec: Record  # its episode's record (taken: busy until the turn is recorded)
    request: GenerationRequest
    future: Future[Sample]
    said: Any  # the chat or the prompt text
    single: str | None  # the episode opened for this request alone (closed after it)
    feed: TokenFeed | None = None  # its tokens as they are sampled (a streamed turn)


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
        self._finishing: set[asyncio.Task] = set()  # streamed turns being recorded
        self.counts = {
            "requests": 0, "refused": 0, "deadline": 0, "errors": 0, "tool_calls": 0,
            "malformed_calls": 0, "single_requests": 0, "stream_diverged": 0,
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
        """The request's `s.n` completions (`start_choices`), once each is recorded; a
        failed choice fails the request (after its siblings finished), and the episodes
        opened for it are closed."""
        subs, opened = await self.start_choices(eid, kind, said, s)
        got = await asyncio.gather(*(self.finish(sub) for sub in subs), return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            self._close_opened(opened)
            raise failed[0]
        return list(got)

    async def start_choices(
        self, eid: str | None, kind: str, said: Any, s: api.Sampling, stream: bool = False
    ) -> tuple[list[Submitted], list[str]]:
        """The request's `s.n` completions submitted (`finish` records each), each its own
        episode: the first of episode `eid` (which must have no turn yet when n > 1), the
        others of episodes opened for them (returned in each choice's `episode_id`, for
        the client to go on with and close; the second list), or every one an episode of
        its own without `eid`; in a training run, the episodes of `eid`'s group
        (`Backend.choices`). Submitted together, so the engine prefills their shared
        prompt once and forks its KV (`share_prefill`). With a `seed`, choice i samples
        with seed + i. A choice that cannot start fails the request once those started
        are recorded (the episodes opened for it closed)."""
        if s.n == 1:
            return [self.start(eid, kind, said, s, stream)], []
        if eid is not None and not self.book.fresh(eid):
            raise api.ApiError(400, f"n={s.n}: episode {eid[:80]!r} is not a new episode", "n")
        ids, opened = self._choice_ids(eid, s.n)
        each = [
            dataclasses.replace(s, n=1, seed=None if s.seed is None else s.seed + i)
            for i in range(s.n)
        ]
        subs: list[Submitted] = []
        try:
            for e, c in zip(ids, each, strict=True):
                subs.append(self.start(e, kind, said, c, stream))
        except BaseException:
            await asyncio.gather(*(self.finish(sub) for sub in subs), return_exceptions=True)
            self._close_opened(opened)
            raise
        return subs, opened

    def _choice_ids(self, eid: str | None, n: int) -> tuple[list[str | None], list[str]]:
        """The episodes of a request's n choices, and those opened for it."""
        if eid is None:
            return [None] * n, []
        try:
            group = self.backend.choices(eid, n, self.book.fresh)
        except ValueError as e:
            raise api.ApiError(400, str(e), "n") from None
        if group is not None:
            return list(group), []
        opened = [self.book.open() for _ in range(n - 1)]
        return [eid, *opened], opened

    def _close_opened(self, opened: list[str]) -> None:
        """The episodes opened for a request's choices, closed (a sibling failed: the
        client may never learn their ids)."""
        for e in opened:
            with contextlib.suppress(BookError):
                self.book.close(e, "a sibling choice failed")
            self.backend.release(e)

    async def stream_choices(
        self, eid: str | None, kind: str, said: Any, s: api.Sampling
    ) -> tuple[list[Submitted], list[asyncio.Task[Turn]]]:
        """The request's choices started as streams, each recorded by a task of its own
        (`finish_apart`); when one fails, the episodes opened for the others are closed
        once all are recorded."""
        subs, opened = await self.start_choices(eid, kind, said, s, stream=True)
        tasks = [self.finish_apart(sub) for sub in subs]
        if opened:
            self._keep(asyncio.ensure_future(self._close_if_failed(tasks, opened)))
        return subs, tasks

    async def _close_if_failed(self, tasks: list[asyncio.Task[Turn]], opened: list[str]) -> None:
        got = await asyncio.gather(*tasks, return_exceptions=True)
        if any(isinstance(g, BaseException) for g in got):
            self._close_opened(opened)

    async def complete(self, eid: str | None, kind: str, said: Any, s: api.Sampling) -> Turn:
        """One completion of episode `eid` (`said`: chat messages or prompt text)."""
        return await self.finish(self.start(eid, kind, said, s))

    def start(
        self, eid: str | None, kind: str, said: Any, s: api.Sampling, stream: bool = False
    ) -> Submitted:
        """A completion of episode `eid` checked and submitted (`finish` commits its turn);
        with `stream`, its tokens are reported as they are sampled (`Submitted.feed`).
        On the event loop."""
        if self._inflight >= self.limits.max_inflight:
            raise api.ApiError(
                429, f"{self._inflight} requests are generating (the endpoint's limit); retry"
            )
        params = self.turns.sampling(s)  # the request's own checks first, then the episode's
        self._inflight += 1
        single = eid is None and self.single_requests
        rec = None
        try:
            if single:
                eid = self.book.open()
                self.counts["single_requests"] += 1
            rec = self.book.take(eid)
            prepare = self.turns.chat if kind == "chat" else self.turns.completion
            request = prepare(rec, said, s, params, self.limits.episode_tokens)
            feed = None
            if stream:
                feed = TokenFeed(asyncio.get_running_loop(), request.history)
                request = dataclasses.replace(request, on_tokens=feed)
            try:
                future = self.backend.submit(request)
            except ValueError as e:
                raise api.ApiError(400, str(e)) from None
            return Submitted(rec, request, future, said, eid if single else None, feed)
        except BaseException:
            if rec is not None:
                self.book.give_back(rec)
            self._inflight -= 1
            if single and eid is not None:
                self._end_single(eid)
            raise

    async def finish(self, sub: Submitted) -> Turn:
        """The submitted completion's turn, once generated, recorded in its episode."""
        rec = sub.rec
        try:
            try:
                sample = await asyncio.wait_for(
                    asyncio.wrap_future(sub.future), self.limits.timeout_s
                )
            except TimeoutError:
                sub.future.cancel()
                self.backend.release(rec.id)
                self.book.fail(rec, "a completion passed its deadline")
                self.counts["deadline"] += 1
                raise api.ApiError(
                    504,
                    f"episode {rec.id}: generation did not finish in "
                    f"{self.limits.timeout_s:.0f} s; the episode is closed",
                ) from None
            turn = self.turns.commit(rec, sub.request, sample, sub.said)
            self.counts["tool_calls"] += len(turn.calls)
            self.counts["malformed_calls"] += turn.malformed
            return turn
        finally:
            self.book.give_back(rec)
            self._inflight -= 1
            if sub.single is not None:
                self._end_single(sub.single)

    def finish_apart(self, sub: Submitted) -> asyncio.Task[Turn]:
        """`finish(sub)` as a task of its own: a streamed turn is recorded whether or not
        its client stays to read it (the task is kept until done, its failure retrieved:
        the stream reports it, or nobody is left to)."""
        return self._keep(asyncio.ensure_future(self.finish(sub)))

    def _keep(self, task: asyncio.Task) -> asyncio.Task:
        """`task` kept until done, its failure retrieved (logged when it is a bug)."""
        self._finishing.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._finishing.discard(task)
        if task.cancelled():
            return
        e = task.exception()
        if e is not None and not isinstance(e, api.ApiError | BookError):
            logging.error("endpoint: a streamed completion failed: %r", e)

    def _end_single(self, eid: str) -> None:
        """An episode of one request is over: closed, its kept slot given up."""
        with contextlib.suppress(BookError):  # closed already (its deadline passed)
            self.book.close(eid, "an episode of one request")
        self.backend.release(eid)


# ---------------------------------------------------------------------- responses
def _token_text(turns: Turns, ids: np.ndarray, start: int = 0) -> list[str]:
    """Each token's text from `start` on (the tokens before it read as its prefix), cut
    so that the pieces join to the whole decode."""
    tok = turns.ctx.tokenizer
    out, before = [], tok.decode(ids[:start]) if start else ""
    for i in range(start, len(ids)):
        now = tok.decode(ids[: i + 1])
        out.append(now[len(before) :] if now.startswith(before) else now)
        before = now
    return out


def _token_entry(turns: Turns, token: int, logprob: float) -> dict[str, Any]:
    text = turns.ctx.tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


Alternatives = list[tuple[int, float]]  # a token's most likely (id, log-prob), likeliest first


def _alternatives(turn: Turn) -> list[Alternatives]:
    """Each token of `turn` with the alternatives the engine kept (none: empty)."""
    if turn.top_ids is None or turn.top_logprobs is None:
        return [[] for _ in turn.token_ids]
    ids, lps = turn.top_ids.tolist(), turn.top_logprobs.tolist()
    return [list(zip(i, lp, strict=True)) for i, lp in zip(ids, lps, strict=True)]


def _logprob_entries(
    turns: Turns, ids: Any, logprobs: Any, tops: list[Alternatives], s: api.Sampling
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: each token, its log-prob and its `s.top_logprobs`
    alternatives."""
    entries = []
    ids, lps = np.asarray(ids).tolist(), np.asarray(logprobs).tolist()
    for t, lp, top in zip(ids, lps, tops, strict=True):
        alternatives = [_token_entry(turns, i, v) for i, v in top[: s.top_logprobs]]
        entries.append({**_token_entry(turns, t, lp), "top_logprobs": alternatives})
    return entries


def _top_dicts(turns: Turns, tops: list[Alternatives], s: api.Sampling) -> list | None:
    """Completions' `top_logprobs`: per token {text: log-prob} of its `s.top_logprobs`
    alternatives (two that read the same: the likelier), None when none were asked for."""
    if not s.top_logprobs:
        return None
    tok = turns.ctx.tokenizer
    out = []
    for top in tops:
        d: dict[str, float] = {}
        for i, v in top[: s.top_logprobs]:
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


def _header(ep: Endpoint, episode: str, prefix: str, kind: str) -> dict[str, Any]:
    """A response's (or each event's) id, object kind, time and model."""
    return {
        "id": f"{prefix}-{episode}-{int(time.time() * 1e6)}",
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
        logprobs = None
        if s.logprobs:
            entries = _logprob_entries(
                ep.turns, turn.token_ids, turn.logprobs, _alternatives(turn), s
            )
            logprobs = {"content": entries}
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
        **_header(ep, turns[0].episode, "chatcmpl", "chat.completion"),
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
                "top_logprobs": _top_dicts(ep.turns, _alternatives(turn), s),
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
        **_header(ep, turns[0].episode, "cmpl", "text_completion"),
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


Tokens = tuple[list[int], list[float], list[int], list[Alternatives]]  # ids, lps, versions, tops


async def _recorded(ep: Endpoint, task: asyncio.Task[Turn]) -> Turn | bytes:
    """The streamed turn as recorded, or the error event that ends its stream (its
    status sent already: OpenAI's error body as an event, which its clients raise)."""
    try:
        return await task
    except api.ApiError as e:
        return _event(e.body())
    except BookError as e:
        return _event(api.ApiError(e.status, str(e)).body())
    except Exception as e:  # noqa: BLE001 - a bug: named (logged by `_finished`)
        ep.counts["errors"] += 1
        return _event(api.ApiError(500, f"endpoint error: {e!r}").body())


def _shown(ep: Endpoint, sub: Submitted, s: api.Sampling) -> ShownText:
    """What of a streamed turn's text its client may see as it generates."""
    tok = ep.turns.ctx.tokenizer
    stop_ids = [*sub.request.sampling.stop_ids, *tok.stop_ids]
    calls = call_hold(ep.turns.convention, sub.said) if isinstance(sub.said, api.Chat) else None
    return ShownText(tok, stop_ids, s.stop, calls)


def _rest(ep: Endpoint, shown: ShownText, final: str | None) -> str:
    """What the recorded turn's text adds to what was streamed (counted where the stream
    showed text the final message does not start with: module `streaming`)."""
    rest = shown.rest(final)
    if shown.diverged:
        ep.counts["stream_diverged"] += 1
        logging.warning("endpoint: a streamed text is not the start of its turn's message")
    return rest


class _Progress:
    """How far one streamed choice got: the tokens taken (`every`), those sent in pieces
    (`sent`), those whose text is not shown yet (`held`)."""

    def __init__(self, ep: Endpoint, sub: Submitted, s: api.Sampling):
        self.ep, self.shown = ep, _shown(ep, sub, s)
        self.held: Tokens = ([], [], [], [])
        self.sent = 0
        self.every: list[int] = []

    def add(self, got: Tokens) -> tuple[str, Tokens] | None:
        """The text the engine's next tokens `got` settle and the tokens it shows (taken
        as sent), or None while it shows nothing new."""
        for have, new in zip(self.held, got, strict=True):
            have.extend(new)
        self.every.extend(got[0])
        text = self.shown.add(got[0])
        if not text:
            return None
        held, self.held = self.held, ([], [], [], [])
        self.sent += len(held[0])
        return text, held

    def rest(self, turn: Turn, final: str | None) -> tuple[str, Tokens]:
        """What the recorded `turn` (its message `final`) adds to the text shown, and its
        tokens not sent yet."""
        at = self.sent
        tail = (turn.token_ids[at:], turn.logprobs[at:], turn.versions[at:],
                _alternatives(turn)[at:])  # fmt: skip
        return _rest(self.ep, self.shown, final), tail


class ChatChoice:
    """A streamed chat choice's chunks: an opening (the role, the choice's episode), the
    text its tokens settle as they come (each chunk with those tokens' ids, versions and
    log-probs), then what the recorded turn adds (a turn that made tool calls: one chunk
    per call, whole), the finish."""

    def __init__(self, ep: Endpoint, sub: Submitted, s: api.Sampling, index: int):
        self.ep, self.sub, self.s, self.index = ep, sub, s, index
        self.progress = _Progress(ep, sub, s)

    def opening(self) -> list[dict[str, Any]]:
        first = {"role": "assistant", "content": ""}
        return [{"index": self.index, "delta": first, "logprobs": None, "finish_reason": None,
                 "episode_id": self.sub.rec.id}]  # fmt: skip

    def add(self, got: Tokens) -> list[dict[str, Any]]:
        settled = self.progress.add(got)
        return [] if settled is None else [self._piece(settled[0], *settled[1])]

    def end(self, turn: Turn) -> list[dict[str, Any]]:
        out, i = [], self.index
        rest, tail = self.progress.rest(turn, turn.content)
        if rest or len(tail[0]):
            out.append(self._piece(rest, *tail))
        for k, c in enumerate(turn.calls):
            delta = {"tool_calls": [{"index": k, **c.openai()}]}
            out.append({"index": i, "delta": delta, "finish_reason": None})
        out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": turn.finish_reason})
        return out

    def _piece(self, text: str, ids: Any, lps: Any, versions: Any, tops: Any) -> dict[str, Any]:
        s = self.s
        entries = _logprob_entries(self.ep.turns, ids, lps, tops, s) if s.logprobs else None
        return {
            "index": self.index,
            "delta": {"content": text} if text else {},
            "logprobs": {"content": entries} if entries is not None else None,
            "finish_reason": None,
            "token_ids": np.asarray(ids).tolist(),
            "versions": np.asarray(versions).tolist(),
        }


class CompletionChoice:
    """A streamed completion choice's chunks: the text its tokens settle as they come,
    then what the recorded turn adds, with the finish (each chunk with the choice's
    episode)."""

    def __init__(self, ep: Endpoint, sub: Submitted, s: api.Sampling, index: int):
        self.ep, self.sub, self.s, self.index = ep, sub, s, index
        self.progress = _Progress(ep, sub, s)
        self.offset = 0  # the next token's offset in the completion text

    def opening(self) -> list[dict[str, Any]]:
        return []

    def add(self, got: Tokens) -> list[dict[str, Any]]:
        sent = self.progress.sent
        settled = self.progress.add(got)
        if settled is None:
            return []
        at = []
        if self.s.logprobs:  # each token's text and offset (as `_shown_pieces`)
            every = np.asarray(self.progress.every[: self.progress.sent])
            for p in _token_text(self.ep.turns, every, sent):
                at.append((p, self.offset))
                self.offset += len(p)
        return [self._piece(settled[0], settled[1], at, None)]

    def end(self, turn: Turn) -> list[dict[str, Any]]:
        at = _shown_pieces(self.ep, turn)[self.progress.sent :] if self.s.logprobs else []
        rest, tail = self.progress.rest(turn, turn.text)
        return [self._piece(rest, tail, at, turn.finish_reason)]

    def _piece(self, text: str, tokens: Tokens, at: list, finish: str | None) -> dict[str, Any]:
        ids, lps, versions, tops = tokens
        logprobs = None
        if self.s.logprobs:
            logprobs = {
                "tokens": [p for p, _ in at],
                "token_logprobs": np.asarray(lps).tolist(),
                "top_logprobs": _top_dicts(self.ep.turns, tops, self.s),
                "text_offset": [o for _, o in at],
            }
        return {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "token_ids": np.asarray(ids).tolist(),
            "versions": np.asarray(versions).tolist(),
            "episode_id": self.sub.rec.id,
        }


async def _ready(subs: dict[int, Submitted], tasks: dict[int, asyncio.Task[Turn]]) -> None:
    """Until a choice has new tokens or its turn is recorded."""
    waits = [asyncio.ensure_future(sub.feed.wait()) for sub in subs.values()]
    try:
        await asyncio.wait([*waits, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def stream_events(
    ep: Endpoint,
    kind: str,
    subs: list[Submitted],
    tasks: list[asyncio.Task[Turn]],
    s: api.Sampling,
) -> AsyncIterator[bytes]:
    """A request's streamed choices as server-sent events while they generate (chat:
    chat.completion.chunk, completions: text_completion), interleaved as their tokens
    come, each chunk one choice's (`index`); the usage of them all once at the end when
    asked. A choice whose turn fails ends the stream with its error (the others are
    still recorded)."""
    if kind == "chat":
        base, make = _header(ep, subs[0].rec.id, "chatcmpl", "chat.completion.chunk"), ChatChoice
    else:
        base, make = _header(ep, subs[0].rec.id, "cmpl", "text_completion"), CompletionChoice

    def event(choices: list, **more: Any) -> bytes:
        return _event({**base, "choices": choices, **more})

    streams = [make(ep, sub, s, i) for i, sub in enumerate(subs)]
    for st in streams:
        for c in st.opening():
            yield event([c])
    live, recorded = dict(enumerate(tasks)), dict[int, Turn]()
    while live:
        await _ready({i: subs[i] for i in live}, live)
        for i, task in list(live.items()):
            if task.done():
                turn = await _recorded(ep, task)
                if isinstance(turn, bytes):
                    yield turn
                    return
                for c in streams[i].end(turn):
                    yield event([c])
                recorded[i] = turn
                del live[i]
                continue
            got = subs[i].feed.take()
            if got[0]:
                for c in streams[i].add(got):
                    yield event([c])
    if s.include_usage:
        yield event([], usage=_usage([recorded[i] for i in range(len(subs))]))
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
        if s.stream:
            subs, tasks = await ep.stream_choices(eid, kind, said, s)
            events = stream_events(ep, kind, subs, tasks, s)
            return StreamingResponse(events, media_type="text/event-stream")
        turns = await ep.choices(eid, kind, said, s)
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
