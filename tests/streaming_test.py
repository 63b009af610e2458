"""A turn streamed while it generates (endpoint/streaming.py): the text shown of its
tokens as they come, and their hand-off from the engine's thread to the event loop."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from streamrl_jax.endpoint.streaming import ShownText, TokenFeed
from streamrl_jax.generation.types import TokenDelta
from streamrl_jax.model import function_calls
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


def _one_by_one(shown: ShownText, ids: list[int]) -> list[str]:
    return [piece for i in ids if (piece := shown.add([i]))]


def test_a_character_split_across_tokens_is_shown_once_whole(tok):
    # SmolLM2's byte-level tokens split 東 and 京 over two tokens each: until the last
    # byte comes the decode ends in U+FFFD, which is never shown.
    text = "Grüße 🙂 — naïve 東京!"
    ids = tok.encode(text)
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))
    shown = ShownText(tok, tok.stop_ids)
    pieces = _one_by_one(shown, ids)
    assert not any("\ufffd" in p for p in pieces) and len(pieces) > 5
    assert "".join(pieces) == text and shown.rest(text) == ""
    assert pieces[-3:] == [" 東", "京", "!"]  # each once its last byte came


def test_the_stop_token_and_a_stop_strings_start_are_never_shown(tok):
    # The turn's last token may be the stop token (not shown), and text that may begin a
    # stop string is held until the turn's text says whether it was one.
    end = tok.token_to_id("<|im_end|>")
    shown = ShownText(tok, [end], stops=("STOP",))
    pieces = _one_by_one(shown, [*tok.encode("go STOP"), end])
    assert "".join(pieces) == "go"
    assert shown.rest("go ") == " " and not shown.diverged
    # Forced length (stop ids ignored): a stop id followed by more tokens was not the end.
    shown = ShownText(tok, [tok.encode(".")[0]])
    pieces = _one_by_one(shown, tok.encode("a. b. c."))
    assert "".join(pieces) == "a. b. c" and shown.rest("a. b. c.") == "."


@pytest.mark.parametrize(
    "name, written, before",
    [
        ("hermes", 'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Sure."),
        ("gemma_tool_code", "Sure.\n```tool_code\nf()\n```", "Sure."),
        ("llama3_json", '{"name": "f", "parameters": {}}', ""),
        ("llama3_json", "No call {here}.", "No call {here}."),
    ],
)
def test_text_that_may_start_a_call_is_held(tok, name, written, before):
    convention = function_calls.CONVENTIONS[name]
    shown = ShownText(tok, tok.stop_ids, calls=convention.call_start)
    assert "".join(_one_by_one(shown, tok.encode(written))) == before


def test_a_final_message_that_strips_what_was_shown_adds_the_rest(tok):
    shown = ShownText(tok, tok.stop_ids)
    assert shown.add(tok.encode("  Hi there")) == "  Hi there"
    assert shown.rest("Hi there, you.") == ", you." and not shown.diverged
    assert shown.rest("Bye.") == "Bye." and shown.diverged


def test_a_feed_coalesces_reports_and_refuses_one_out_of_order():
    # Reports from another thread are buffered and taken at once on the loop; a report
    # that does not follow the last one stops the feed (the final turn shows the rest).

    def delta(start: int, ids: list[int]) -> TokenDelta:
        n = len(ids)
        lps, versions = np.full(n, -0.5, np.float32), np.full(n, 3, np.int32)
        return TokenDelta(
            request_id="r", start=start, tokens=np.int32(ids), logprobs=lps, versions=versions
        )

    async def run() -> list:
        feed = TokenFeed(asyncio.get_running_loop(), start=4)
        engine = threading.Thread(target=lambda: [feed(delta(4, [7, 8])), feed(delta(6, [9]))])
        engine.start()
        engine.join(10)
        await asyncio.wait_for(feed.wait(), 10)
        first = feed.take()
        feed(delta(9, [1]))  # a gap: tokens 7 and 8 were never reported
        feed(delta(7, [5]))
        return [first, feed.take(), feed.broken]

    first, after, broken = asyncio.run(run())
    assert first == ([7, 8, 9], [-0.5] * 3, [3] * 3, [[], [], []])  # no alternatives kept
    assert after == ([], [], [], []) and broken
