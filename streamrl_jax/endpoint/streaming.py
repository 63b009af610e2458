"""A turn streamed while it generates: its tokens from the engine's thread to the event
loop (`TokenFeed`), and the text of them that can be shown already (`ShownText`).

The engine reports a streaming request's new tokens after every host round trip
(`GenerationRequest.on_tokens`). A `TokenFeed` takes them on the engine's thread and
never blocks it: it appends them to one buffer (a slow client's tokens coalesce there;
it holds at most the turn's own tokens) and wakes the request's handler on its event
loop, which takes everything buffered at once.

`ShownText` decides what of the tokens so far a client may see: the decoded text, less
what may still change or be cut from the message — a trailing stop token (the turn
ends on it; not shown), an incomplete UTF-8 character (a character split across
tokens decodes to U+FFFD until its last byte comes), trailing whitespace (a tool-call
message's text is stripped), text that may begin a stop string or, with tools, a tool
call (`Convention.call_start`; a required or named call: all of it). The turn's final
message then adds what was held (`rest`): a streamed turn shows the text the same turn
returns unstreamed. The one exception: a message with tool calls strips the whitespace
before its text, which a stream may have shown already.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence

from streamrl_jax.endpoint.api import Chat
from streamrl_jax.generation.types import TokenDelta
from streamrl_jax.model import function_calls
from streamrl_jax.model.tokenizer import Tokenizer


class TokenFeed:
    """One streaming request's new tokens, from the engine's thread (`__call__`, its
    `on_tokens`) to the handler on `loop` (`wait`, `take`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, start: int):
        """`start`: the response index of the request's first new token (its history)."""
        self._loop = loop
        self._lock = threading.Lock()
        self._ready = asyncio.Event()  # set on the loop only
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._tops: list[list[tuple[int, float]]] = []  # each token's alternatives
        self._next = start
        self._woken = False
        self.broken = False  # a report out of order: the rest comes with the final turn

    def __call__(self, delta: TokenDelta) -> None:
        """The engine's report (its thread): buffered, the handler woken; never blocks."""
        with self._lock:
            if self.broken:
                return
            if delta.start != self._next:
                self.broken = True
                return
            self._ids.extend(delta.tokens.tolist())
            self._logprobs.extend(delta.logprobs.tolist())
            self._versions.extend(delta.versions.tolist())
            if delta.top_ids is None or delta.top_logprobs is None:
                self._tops.extend([] for _ in range(len(delta.tokens)))
            else:
                ids, lps = delta.top_ids.tolist(), delta.top_logprobs.tolist()
                self._tops.extend(
                    list(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)
                )
            self._next += len(delta.tokens)
            wake, self._woken = not self._woken, True
        if wake:  # (a loop closed, its server stopped: nobody reads)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._ready.set)

    async def wait(self) -> None:
        """Until tokens are buffered (or were, since the last `take`)."""
        await self._ready.wait()

    def take(self) -> tuple[list[int], list[float], list[int], list[list[tuple[int, float]]]]:
        """Every token buffered (ids, log-probs, versions, alternatives), in order; on the
        loop."""
        with self._lock:
            out = self._ids, self._logprobs, self._versions, self._tops
            self._ids, self._logprobs, self._versions, self._tops = [], [], [], []
            self._woken = False
            self._ready.clear()
        return out


def call_hold(convention: function_calls.Convention, chat: Chat) -> Callable[[str], int] | None:
    """Where a chat turn's text may begin a tool call (None: it reads no calls): the
    convention's `call_start` with `tool_choice` auto; 0 when a call is required or
    named (the turn is a call's continuation: nothing is shown before it is read)."""
    if not chat.tools or chat.choice.mode == "none":
        return None
    if chat.choice.mode == "auto":
        return convention.call_start
    return lambda text: 0


class ShownText:
    """The text a client may see of a turn's tokens so far (module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_ids: Sequence[int],
        stops: Sequence[str] = (),
        calls: Callable[[str], int] | None = None,
    ):
        """`stop_ids`: the tokens that end the turn; `stops`: its stop strings; `calls`:
        where a call may begin (`call_hold`)."""
        self._tok, self._stops, self._calls = tokenizer, tuple(stops), calls
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        self._ids: list[int] = []
        self.shown = ""  # the text shown so far
        self.diverged = False  # the final message did not extend what was shown

    def add(self, ids: Sequence[int]) -> str:
        """The text `ids` (the turn's next tokens) add to what may be shown."""
        self._ids.extend(int(i) for i in ids)
        visible = self._ids
        if visible and visible[-1] in self._stop_ids:
            visible = visible[:-1]  # the turn may end on it
        text = self._tok.decode(visible)
        if self._stops:
            text = text[: function_calls.marker_start(text, self._stops)]
        if self._calls is not None:
            text = text[: self._calls(text)]
        end = len(text)
        while end and (text[end - 1].isspace() or text[end - 1] == "\ufffd"):
            end -= 1
        text = text[:end]
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""  # nothing new, or a decode that changed what it ended with: later
        new, self.shown = text[len(self.shown) :], text
        return new

    def rest(self, final: str | None) -> str:
        """What the turn's final message `final` adds to the text shown."""
        final = final or ""
        if final.startswith(self.shown):
            return final[len(self.shown) :]
        lead = self.shown.lstrip()  # a message with calls: its text is stripped
        if final.startswith(lead):
            return final[len(lead) :]
        self.diverged = True
        same = next(
            (i for i, (a, b) in enumerate(zip(final, self.shown, strict=False)) if a != b),
            min(len(final), len(self.shown)),
        )
        return final[same:]
