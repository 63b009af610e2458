"""endpoint/turns.py: a request as its episode's next generation request, capped by the
episode budget (`Limits.episode_tokens`; docs/endpoint.md "The episode budget"): the
tokens after the first prompt, the request's own appended tokens included, leave the
turn's cap, and a request that leaves none is refused with `context_length_exceeded`,
the rule of in-process episodes (`pipeline/rollouts/episodes.answer`). The end-to-end
equality with in-process episodes is chained_calculator_test.py's."""

from __future__ import annotations

import json

import pytest
from scripted_policy import Scripted

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.book import EpisodeBook
from streamrl_jax.endpoint.turns import CONTEXT_EXCEEDED, Context, Turns
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer

FIRST, REPLY, MORE = "Count with me: one", " two three", " four five six"
TURN = 8  # Limits.max_tokens: the per-turn cap


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


class _Episode:
    """A completions episode whose first turn sampled REPLY, asked with `budget`."""

    def __init__(self, tok, budget: int):
        self.tok, self.budget = tok, budget
        self.turns = Turns(Context(tok, 1024, 2048))
        book = EpisodeBook()
        self.rec = book.take(book.open())
        policy = Scripted(tok)
        policy.script = [REPLY]
        first = self.ask(FIRST)
        self.turns.commit(self.rec, first, policy.submit(first).result(), FIRST)

    def ask(self, prompt: str, max_tokens: int | None = None):
        body = {"model": "p", "prompt": prompt}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        request = api.decode(json.dumps(body).encode(), api.CompletionRequest)
        _, s = api.check_completion(request, api.Limits(max_tokens=TURN), "p")
        return self.turns.completion(self.rec, prompt, s, self.turns.sampling(s), self.budget)

    def used(self) -> int:
        """The tokens after the first prompt the second request would leave behind it:
        the first turn's, then the new text's."""
        return len(self.rec.sample.response) + len(self.tok.encode(MORE))

    def second(self, max_tokens: int | None = None):
        return self.ask(self.rec.text + MORE, max_tokens)


@pytest.mark.parametrize(
    "over, max_tokens, cap",
    [(1, None, 1), (2, None, 2), (TURN + 5, None, TURN), (TURN + 5, 3, 3), (4, 6, 4)],
)  # fmt: skip
def test_a_turn_samples_at_most_what_is_left_of_the_episode_budget(tok, over, max_tokens, cap):
    # budget = used + over: the turn's cap is min(max_tokens, Limits.max_tokens, over).
    probe = _Episode(tok, 0)
    ep = _Episode(tok, probe.used() + over)
    request = ep.second(max_tokens)
    assert request.history == ep.used()  # the new text appended, as in-process
    assert request.max_new_tokens - request.generated == cap


def test_a_request_that_leaves_no_token_of_the_budget_is_refused(tok):
    # budget = used: nothing is left (in-process, the episode ends "episode_tokens"
    # here); the request is refused with OpenAI's code, and the episode is as it was.
    probe = _Episode(tok, 0)
    for budget in (probe.used(), probe.used() - 3):
        ep = _Episode(tok, budget)
        assert ep.used() == probe.used()  # (the first turn was not cut)
        before = ep.rec.sample
        with pytest.raises(api.ApiError, match=f"of its {budget} tokens after its first") as e:
            ep.second()
        assert e.value.code == CONTEXT_EXCEEDED and e.value.status == 400
        assert ep.rec.sample is before and ep.rec.turns == 1


def test_the_first_turn_is_capped_by_the_budget_too_and_none_is_no_budget(tok):
    turns = Turns(Context(tok, 1024, 2048))
    book = EpisodeBook()
    body = json.dumps({"model": "p", "prompt": FIRST}).encode()
    _, s = api.check_completion(api.decode(body, api.CompletionRequest), api.Limits(), "p")
    capped = turns.completion(book.take(book.open()), FIRST, s, turns.sampling(s), 5)
    assert capped.max_new_tokens == 5 and s.max_tokens == api.Limits().max_tokens
    free = turns.completion(book.take(book.open()), FIRST, s, turns.sampling(s), 0)
    assert free.max_new_tokens == s.max_tokens
    # no budget: the second turn is bounded by max_tokens (and the engine's context) only
    request = _Episode(tok, 0).second()
    assert request.max_new_tokens - request.generated == TURN
