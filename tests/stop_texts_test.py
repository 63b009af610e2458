"""Stop strings read on the host (generation/stop_texts.py): the windowed search finds
the token a whole-text search finds, checked chunk by chunk as the engine checks it, on
SmolLM2's byte-level tokenizer (characters split across tokens, special tokens that
decode to nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl_jax.generation.stop_texts import first_stop
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer

TEXT = (
    "The answer is 42.\n\nObservation: the tool said «ok» 🙂 then </answer> and more text "
    "that goes on; naïve café — 数学 and <|im_end|> after a special token, END END."
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


def _whole(tok, tokens, texts):
    """The reference: the first token whose whole-prefix text holds a stop string."""
    return next(
        (j for j in range(len(tokens)) if any(t in tok.decode(tokens[: j + 1]) for t in texts)),
        None,
    )


def _chunked(tok, tokens, texts, chunk):
    """`first_stop` called as the engine calls it: after every `chunk` new tokens."""
    checked = 0
    for end in range(1, len(tokens) + 1, chunk):
        got = first_stop(tok.decode, tokens[: end + chunk - 1], checked, texts)
        if got is not None:
            return got
        checked = min(end + chunk - 1, len(tokens))
    return None


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_the_windowed_search_finds_the_token_the_whole_text_does(tok, chunk):
    tokens = tok.encode(TEXT)
    rng = np.random.default_rng(0)
    cases = [("\n\n",), ("</answer>",), ("🙂",), ("数学",), ("END END",), ("absent",)]
    cases += [("é —", "Observation:"), ("«ok» 🙂 th",)]
    for _ in range(20):  # substrings of the text, splitting tokens anywhere
        a = int(rng.integers(0, len(TEXT) - 12))
        cases.append((TEXT[a : a + int(rng.integers(1, 12))],))
    for texts in cases:
        assert _chunked(tok, tokens, texts, chunk) == _whole(tok, tokens, texts), texts


def test_a_long_turn_reads_only_its_tail(tok):
    # The tokens before the window are never decoded again: a detokenizer that counts
    # what it is given sees a bounded window per check, not the whole turn.
    tokens = tok.encode("word " * 400)
    seen = []

    def counting(ids):
        seen.append(len(ids))
        return tok.decode(ids)

    assert first_stop(counting, tokens, len(tokens) - 4, ("STOP",)) is None
    assert max(seen) <= 4 * 4 + 8 + 4
    assert first_stop(tok.decode, tokens, 0, ()) is None
    assert first_stop(tok.decode, tokens, len(tokens), ("word",)) is None
