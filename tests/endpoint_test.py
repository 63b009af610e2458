"""The OpenAI-compatible endpoint (streamrl_jax/endpoint), driven by the official
`openai` client on loopback: chat and completions, streaming and not, the recorded
tokens equal to those returned (across a weight update between turns, the next turn
extending the kept KV), and the trust boundary: every bad request a clear 4xx with
nothing lost or hung, a deadline, back-pressure, a client that leaves mid-stream or
never finishes its body, and a bounded load."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import threading
import time
from concurrent.futures import Future

import jax
import numpy as np
import openai
import pytest
from support import agent_config

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.backend import ServiceBackend
from streamrl_jax.endpoint.client import EndpointClient, EndpointError
from streamrl_jax.endpoint.kit import serve
from streamrl_jax.endpoint.server import Endpoint, EndpointServer, endpoint_token
from streamrl_jax.generation.types import Continuation, GenerationRequest, SamplingParams
from streamrl_jax.pipeline import components

TOKEN = endpoint_token(b"a run secret for the tests")
USER = [{"role": "user", "content": "What is 17 + 25?"}]


@dataclasses.dataclass
class Served:
    endpoint: Endpoint
    server: EndpointServer
    backend: ServiceBackend
    client: EndpointClient
    params: list


@pytest.fixture(scope="module")
def served():
    """The tiny agent model's engine behind the endpoint on loopback, keeping 5
    alternatives per token (`top_logprobs`). One decode shape (`pipeline.deterministic`:
    every slot over the whole cache): the tests' turns and loads compile no chunk beyond
    the first (the buckets are engine_test.py's). As `serve` builds it, a kept slot is
    given up to a waiting request at once (`kv_hold_s=0`): a test's episodes left open
    never make a later test's requests wait."""
    cfg = agent_config(
        pipeline__deterministic=True, generation__top_logprobs=5, generation__kv_hold_s=0.0
    )
    c = components.build(cfg, warm=False)
    params = [p.params for p in c.initial_weights]
    service = c.generation.service(
        params, 0, on_chunk=lambda r: None, precompile=False, continuations=False
    )
    limits = api.Limits(max_tokens=cfg.generation.max_new_tokens, max_messages=8, max_n=4)
    endpoint, server = serve(service, c.tokenizer, TOKEN, limits)
    yield Served(endpoint, server, endpoint.backend, EndpointClient(server.url, TOKEN), params)
    server.stop()
    endpoint.backend.close()


def _chat(oc, messages, **kw):
    return oc.chat.completions.create(model="policy", messages=messages, **kw)


def _extras(choice):
    return np.asarray(choice.model_extra["token_ids"]), choice.model_extra["versions"]


def test_a_chat_episode_is_recorded_as_returned_and_continues_in_place(served):
    # Two turns of one episode, the second streamed: the record holds exactly the
    # returned tokens and log-probs (float32, bitwise) with the chat template's tokens
    # around the client's new message between them (policy mask False), and the second
    # turn extends the kept KV instead of re-prefilling the history.
    extended = served.backend.service.engines[0].metrics()["extended"]
    eid = served.client.open()
    oc = served.client.openai(eid)
    r1 = _chat(oc, USER, max_tokens=6, logprobs=True, temperature=0.8)
    c1 = r1.choices[0]
    ids1, v1 = _extras(c1)
    lp1 = np.float32([e.logprob for e in c1.logprobs.content])
    assert len(ids1) == r1.usage.completion_tokens and v1 == [0] * len(ids1)
    history = [*USER, {"role": "assistant", "content": c1.message.content},
               {"role": "user", "content": "Check it with a calculator."}]  # fmt: skip
    stream = _chat(oc, history, max_tokens=5, logprobs=True, stream=True, temperature=0.8)
    chunks = [ch for ch in stream if ch.choices]
    ids2 = np.asarray([i for ch in chunks for i in ch.choices[0].model_extra.get("token_ids", [])])
    lp2 = np.float32([e.logprob for ch in chunks if ch.choices[0].logprobs
                      for e in ch.choices[0].logprobs.content])  # fmt: skip
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and len(ids2) == len(lp2)
    rec = served.endpoint.book.close(eid)
    s = rec.sample
    np.testing.assert_array_equal(s.policy_token_ids(), np.r_[ids1, ids2])
    np.testing.assert_array_equal(s.logprobs[s.policy_mask], np.r_[lp1, lp2])
    env = ~s.policy_mask
    assert env.sum() > 0 and np.all(s.logprobs[env] == 0)
    text = served.endpoint.turns.ctx.tokenizer.decode(s.response[env], skip_special_tokens=False)
    assert "Check it with a calculator." in text and text.endswith("<|im_start|>assistant\n")
    assert served.backend.service.engines[0].metrics()["extended"] == extended + 1
    oc.close()


def test_a_weight_update_between_turns_keeps_each_tokens_version_and_logprob(served):
    eid = served.client.open()
    oc = served.client.openai(eid)
    r1 = _chat(oc, USER, max_tokens=4, logprobs=True, extra_body={"ignore_eos": True})
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 4
    # (on the host: eager device multiplies would compile a kernel per leaf shape)
    newer = [
        jax.tree.map(lambda x: (np.asarray(x) * 1.01).astype(x.dtype), p) for p in served.params
    ]
    served.backend.update_weights(newer, 1)
    try:
        history = [*USER, {"role": "assistant", "content": r1.choices[0].message.content},
                   {"role": "user", "content": "Again."}]  # fmt: skip
        r2 = _chat(oc, history, max_tokens=3, logprobs=True, extra_body={"ignore_eos": True})
    finally:
        served.backend.update_weights(served.params, 0)
    (ids1, v1), (ids2, v2) = _extras(r1.choices[0]), _extras(r2.choices[0])
    assert v1 == [0] * 4 and v2 == [1] * 3
    s = served.endpoint.book.close(eid).sample
    np.testing.assert_array_equal(s.versions()[s.policy_mask], [0] * 4 + [1] * 3)
    lps = [np.float32([e.logprob for e in r.choices[0].logprobs.content]) for r in (r1, r2)]
    np.testing.assert_array_equal(s.logprobs[s.policy_mask], np.r_[lps[0], lps[1]])
    np.testing.assert_array_equal(s.policy_token_ids(), np.r_[ids1, ids2])
    oc.close()


def test_n_choices_are_episodes_of_their_own_forked_from_the_shared_prompt(served):
    # n = 4 on a new episode: four choices, the first the episode's, three new episodes
    # (their ids returned, each going on as itself); the engine prefills the prompt once
    # and forks its KV to the other three; each record holds exactly its choice's tokens.
    engine = served.backend.service.engines[0]
    forked = engine.metrics()["forked"]
    eid = served.client.open()
    oc = served.client.openai(eid)
    r = _chat(oc, USER, n=4, max_tokens=3, extra_body={"ignore_eos": True})
    ids = [c.model_extra["episode_id"] for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and ids[0] == eid and len(set(ids)) == 4
    assert engine.metrics()["forked"] == forked + 3
    assert r.usage.completion_tokens == 12
    for c, e in zip(r.choices, ids, strict=True):
        s = served.endpoint.book.close(e).sample
        np.testing.assert_array_equal(s.policy_token_ids(), c.model_extra["token_ids"])
    oc.close()


def test_n_choices_stream_interleaved_each_as_its_episode_recorded_it(served):
    # n = 4 streamed: each chunk names its choice (`index`); per choice the concatenated
    # text, token ids and log-probs are its episode's recorded turn and the same choice
    # unstreamed (same seed); each choice finishes once, the usage of all comes last.
    engine = served.backend.service.engines[0]
    kw = dict(n=4, max_tokens=6, seed=11, logprobs=True, extra_body={"ignore_eos": True})
    with served.client.episode() as (oc, _):
        whole = _chat(oc, USER, **kw).choices
    for c in whole[1:]:  # (the first closes with its `episode`)
        served.client.close(c.model_extra["episode_id"])
    before = engine.metrics()
    eid = served.client.open()
    oc = served.client.openai(eid)
    chunks = list(_chat(oc, USER, stream=True, stream_options={"include_usage": True}, **kw))
    # the prompt prefilled at most once (a slot may still hold it), the others forked
    forked, rows = (engine.metrics()[k] - before[k] for k in ("forked", "prefill_rows"))
    assert forked + rows == 4 and rows <= 1
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    per = {i: [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
           for i in range(4)}  # fmt: skip
    assert sum(map(len, per.values())) == len(chunks) - 1  # every chunk one choice's
    ids = [p[0].model_extra["episode_id"] for p in per.values()]
    assert ids[0] == eid and len(set(ids)) == 4
    for i, p in per.items():
        text = "".join(c.delta.content or "" for c in p)
        tokens = [t for c in p for t in c.model_extra.get("token_ids", [])]
        lps = [e.logprob for c in p if c.logprobs for e in c.logprobs.content]
        assert [c.finish_reason for c in p if c.finish_reason] == ["length"]
        rec = _close(served, ids[i])
        assert text == rec.messages[-1]["content"] == whole[i].message.content
        assert tokens == rec.sample.response.tolist() == whole[i].model_extra["token_ids"]
        assert lps == [e.logprob for e in whole[i].logprobs.content]
    # Completions: each choice's text and tokens as its episode recorded them.
    eid = served.client.open()
    oc = served.client.openai(eid)
    pieces = list(oc.completions.create(model="policy", prompt="Once upon a time", n=2,
                                        max_tokens=5, stream=True))  # fmt: skip
    for i in range(2):
        p = [c.choices[0] for c in pieces if c.choices[0].index == i]
        rec = _close(served, p[0].model_extra["episode_id"])
        assert "".join(c.text for c in p) == rec.text[len("Once upon a time") :]
        tokens = [t for c in p for t in c.model_extra["token_ids"]]
        assert tokens == rec.sample.response.tolist() and p[-1].finish_reason is not None
    assert rec.id != eid
    oc.close()


def _close(served, eid):
    """Episode `eid` closed (its kept slot given up); its record."""
    rec = served.endpoint.book.close(eid)
    served.backend.release(eid)
    return rec


def test_a_turn_past_the_episodes_context_is_refused_with_openais_code(served):
    with served.client.episode() as (oc, eid):
        r = _chat(oc, USER, max_tokens=2)
        history = [*USER, {"role": "assistant", "content": r.choices[0].message.content},
                   {"role": "user", "content": "seven " * 2000}]  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="tokens of context") as e:
            _chat(oc, history, max_tokens=2)
        assert e.value.code == "context_length_exceeded"
        assert served.endpoint.book._open[eid].turns == 1  # the episode is as it was


def test_completions_stream_and_not_extend_the_recorded_text(served):
    with served.client.episode() as (oc, eid):
        r1 = oc.completions.create(model="policy", prompt="Once upon a time", max_tokens=5,
                                   logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        text = "Once upon a time" + r1.choices[0].text + " The end."
        stream = oc.completions.create(model="policy", prompt=text, max_tokens=4, stream=True,
                                       logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        pieces = list(stream)
        ids = [i for p in pieces for i in p.choices[0].model_extra["token_ids"]]
        assert len(ids) == 4 and pieces[-1].choices[0].finish_reason == "length"
        logprobs = [p.choices[0].logprobs for p in pieces if p.choices[0].logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        offsets = [o for lp in logprobs for o in lp.text_offset]
        streamed = "".join(p.choices[0].text for p in pieces)
        assert "".join(tokens) == streamed and len(offsets) == 4
        assert offsets == np.cumsum([0, *map(len, tokens)])[:-1].tolist()
        rec = served.endpoint.book._open[eid]
        assert rec.turns == 2 and len(rec.sample.policy_token_ids()) == 9
        with pytest.raises(openai.BadRequestError, match="must extend its recorded text"):
            oc.completions.create(model="policy", prompt="Once upon a different time")


# ---------------------------------------------------------------------- bad input
def _raw(served, path, body, headers=None, token=TOKEN):
    """One HTTP request as bytes on a socket: (status, JSON body)."""
    import httpx

    h = {"Authorization": f"Bearer {token}"} if token else {}
    h.update(headers or {})
    r = httpx.post(served.server.url + path, content=body, headers=h, timeout=30)
    return r.status_code, r.json()


@pytest.mark.parametrize(
    "body,headers,token,status,message",
    [
        (b'{"model": "policy", "messages": [', {}, TOKEN, 400, "malformed JSON body"),
        (b"{}", {}, None, 401, "missing or wrong bearer token"),
        (b"{}", {}, "x" * 64, 401, "missing or wrong bearer token"),
        (json.dumps({"model": "gpt-4", "messages": USER}), {}, TOKEN, 404, "'gpt-4' is not served"),
        (json.dumps({"model": "policy", "messages": USER * 9}), {}, TOKEN, 400, "at most 8"),
        (json.dumps({"model": "policy", "messages": USER, "max_tokens": 10**6}), {}, TOKEN, 400,
         "max_tokens=1000000 must be in"),
        (json.dumps({"model": "policy", "messages": USER, "tools": [{"type": "function"}]}), {},
         TOKEN, 400, "tools[0].function: an object is needed"),
        (json.dumps({"model": "policy", "messages": USER, "functions": [{"name": "f"}]}), {},
         TOKEN, 400, "'functions' is not supported"),
        (json.dumps({"model": "policy", "messages": USER, "n": 5}), {}, TOKEN, 400,
         "n=5 must be in [1, 4]"),
        (json.dumps({"model": "policy", "messages": USER, "logprobs": True, "top_logprobs": 21}),
         {}, TOKEN, 400, "top_logprobs=21 must be in [0, 20]"),
        (json.dumps({"model": "policy", "messages": USER, "logprobs": True, "top_logprobs": 6}),
         {}, TOKEN, 400, "top_logprobs=6: this endpoint returns at most 5 alternatives"),
        (json.dumps({"model": "policy", "messages": USER, "top_logprobs": 2}), {}, TOKEN, 400,
         "top_logprobs needs logprobs: true"),
        (json.dumps({"model": "policy", "messages": USER, "stop": ["a", "b", "c", "d", "e"]}), {},
         TOKEN, 400, "stop: at most 4 strings of 1-64 characters"),
        (json.dumps({"model": "policy", "messages": USER, "stop": ["x" * 65]}), {}, TOKEN, 400,
         "stop: at most 4 strings of 1-64 characters"),
        (json.dumps({"model": "policy", "messages": USER, "temperature": "hot"}), {}, TOKEN, 400,
         "$.temperature"),
        (json.dumps({"model": "policy", "messages": USER, "secret": 1}), {}, TOKEN, 400,
         "unknown field `secret`"),
        (json.dumps({"model": "policy", "messages": USER}), {"X-Episode-Id": "ep-forged"}, TOKEN,
         404, "was not issued"),
        (b"x" * (2 << 20), {}, TOKEN, 413, "at most 1048576"),
    ],
)  # fmt: skip
def test_a_bad_request_is_a_clear_4xx(served, body, headers, token, status, message):
    before = served.endpoint.book.num_open
    got, payload = _raw(served, "/v1/chat/completions", body, headers, token)
    assert got == status and message in payload["error"]["message"], payload
    assert served.endpoint.book.num_open == before


def test_a_closed_episode_and_a_diverging_history_are_refused(served):
    eid = served.client.open()
    oc = served.client.openai(eid)
    r = _chat(oc, USER, max_tokens=3)
    with pytest.raises(openai.BadRequestError, match=r"first difference at messages\[1\]"):
        _chat(oc, [*USER, {"role": "assistant", "content": "edited"},
                   {"role": "user", "content": "next"}])  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="an assistant turn this endpoint did not"):
        _chat(oc, [*USER, {"role": "assistant", "content": r.choices[0].message.content},
                   {"role": "assistant", "content": "mine"}])  # fmt: skip
    served.client.close(eid)
    with pytest.raises(openai.ConflictError, match="is closed"):
        _chat(oc, USER)
    with pytest.raises(EndpointError, match="409 episode .* is closed"):
        served.client.close(eid)
    oc.close()


# ---------------------------------------------------------------------- slow and failing parts
class _StuckBackend:
    """A backend whose generation never finishes (or finishes when told)."""

    version = 0

    def __init__(self):
        self.futures: list[Future] = []
        self.released: list[str] = []

    def submit(self, request):
        f: Future = Future()
        self.futures.append(f)
        return f

    def release(self, request_id):
        self.released.append(request_id)


class _Held:
    """The served engine's backend, each turn's completion held until the test lets it
    go (`let_go`): the engine generates it meanwhile."""

    version = 0

    def __init__(self, inner: ServiceBackend):
        self.inner, self.turns = inner, []

    def submit(self, request):
        held: Future = Future()
        self.turns.append((self.inner.submit(request), held))
        return held

    def release(self, request_id):
        self.inner.release(request_id)

    def let_go(self):
        for generated, held in self.turns:
            if not held.done():
                held.set_result(generated.result(timeout=60))


def _held_server(served):
    backend = _Held(served.backend)
    ep = Endpoint(
        served.endpoint.turns, backend, TOKEN, limits=api.Limits(max_tokens=16, timeout_s=60)
    )
    server = EndpointServer(ep)
    return ep, backend, server, EndpointClient(server.start(), TOKEN)


def _streamed(chunks):
    """A chat stream's text and token ids, concatenated."""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids", [])]
    return text, ids


def test_a_stream_sends_tokens_while_its_turn_is_still_generating(served):
    # The turn's completion is held until the stream has shown text: a stream sent only
    # once its turn finished would show none (and end in a 504 at its deadline). The text
    # and tokens streamed are those of the same turn unstreamed (same seed), the record
    # holds them, and the usage comes last.
    kw = dict(max_tokens=16, seed=7, extra_body={"ignore_eos": True}, logprobs=True)
    with served.client.episode() as (oc, _):
        whole = _chat(oc, USER, **kw).choices[0]
    ep, held, server, client = _held_server(served)
    try:
        with client.episode() as (oc, eid):
            stream = _chat(oc, USER, stream=True, stream_options={"include_usage": True}, **kw)
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if _streamed(chunks)[0]:
                    break
            assert not held.turns[0][1].done()  # (only `let_go` finishes it)
            held.let_go()
            chunks.extend(stream)
            text, ids = _streamed(chunks)
            assert text == whole.message.content and ids == whole.model_extra["token_ids"]
            lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
            assert lps == [e.logprob for e in whole.logprobs.content]
            assert chunks[-2].choices[0].finish_reason == "length"
            assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
            np.testing.assert_array_equal(ep.book._open[eid].sample.response, ids)
    finally:
        server.stop()


def test_a_client_that_closes_its_stream_early_loses_nothing(served):
    # The client reads the first text of a turn still generating and closes the stream:
    # the turn goes on, and its whole is recorded in the episode.
    kw = dict(max_tokens=16, seed=8, extra_body={"ignore_eos": True})
    with served.client.episode() as (oc, _):
        whole = _chat(oc, USER, **kw).choices[0].model_extra["token_ids"]
    ep, held, server, client = _held_server(served)
    try:
        eid = client.open()
        oc = client.openai(eid)
        stream = _chat(oc, USER, stream=True, **kw)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if _streamed(chunks)[0]:
                break
        stream.close()
        held.let_go()
        deadline = time.monotonic() + 30
        while ep.book._open[eid].busy and time.monotonic() < deadline:
            time.sleep(0.01)
        rec = ep.book._open[eid]
        assert rec.turns == 1 and rec.sample.response.tolist() == whole
        assert len(_streamed(chunks)[1]) < len(whole)  # it left before the end
        oc.close()
    finally:
        server.stop()


def test_a_training_runs_backend_hands_the_driver_a_streamed_turn_as_asked():
    # A run's endpoint (`PipelineBackend`): the turn the driver submits keeps the run's
    # identity and the request's own `on_tokens`, so its engine reports to the stream.
    from streamrl_jax.endpoint.backend import PipelineBackend
    from streamrl_jax.generation.types import GenerationRequest, RequestTag

    backend = PipelineBackend(validate=lambda q: None, follow=lambda q: None)
    run = GenerationRequest(request_id=41, prompt=[1, 2], max_new_tokens=4, seed=9,
                            tag=RequestTag(batch=3))  # fmt: skip
    backend.expect("ep-1", run)
    feed: list = []
    backend.submit(GenerationRequest(request_id="ep-1", prompt=[1, 2], max_new_tokens=4,
                                     on_tokens=feed.append))  # fmt: skip
    q = backend.first("ep-1", timeout=5)
    assert (q.request_id, q.tag, q.seed) == (41, RequestTag(batch=3), 9)
    assert q.on_tokens == feed.append


def test_a_training_runs_n_choices_are_its_groups_episodes_not_started(served):
    # A run's endpoint maps a request's n choices onto the episodes the run registered
    # for one prompt's group, in member order, asked on the first not started with n the
    # number not started; anything else is a 400 naming what to ask.
    from streamrl_jax.endpoint.backend import PipelineBackend
    from streamrl_jax.generation.types import RequestTag

    backend = PipelineBackend(validate=lambda q: None, follow=lambda q: None)
    ep = Endpoint(served.endpoint.turns, backend, TOKEN, limits=api.Limits(max_n=4),
                  single_requests=False)  # fmt: skip
    server = EndpointServer(ep)
    client = EndpointClient(server.start(), TOKEN)
    try:
        eids = {}
        for group, member, prompt in ((1, 2, [5, 6]), (1, 0, [5, 6]), (1, 1, [5, 6]),
                                      (2, 0, [5, 6]), (2, 1, [7])):  # fmt: skip
            tag = RequestTag(batch=0, group=group, member=member)
            q = GenerationRequest(request_id=f"train/0/{group}/{member}", prompt=prompt,
                                  max_new_tokens=4, tag=tag)  # fmt: skip
            eids[group, member] = ep.book.open(seed=member)
            backend.expect(eids[group, member], q)
        a, b, c = (eids[1, m] for m in range(3))
        assert backend.choices(a, 3, ep.book.fresh) == [a, b, c]
        for eid, n, message in ((a, 2, "has 3 not started .*: ask n=3"),
                                (b, 2, "is not the first of its group's episodes not started"),
                                (eids[2, 0], 2, "is not one prompt's")):  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=message) as e:
                _chat(client.openai(eid), USER, n=n, max_tokens=2)
            assert e.value.param == "n"
        backend.submit(GenerationRequest(request_id=a, prompt=[5, 6], max_new_tokens=4))
        assert backend.choices(b, 2, ep.book.fresh) == [b, c]  # (a started)
        assert ep.book.num_open == 5
    finally:
        client.close_client()
        server.stop()


def _stuck_server(served, **limits):
    backend = _StuckBackend()
    ep = Endpoint(served.endpoint.turns, backend, TOKEN, limits=api.Limits(**limits))
    server = EndpointServer(ep)
    return ep, backend, server, EndpointClient(server.start(), TOKEN)


def test_starting_a_server_leaves_the_processes_logging_alone(served):
    # (uvicorn's default logging config runs dictConfig, which closes every handler, and
    # absl's handler closes its file with it: a run's log went silent once its endpoint
    # started.)
    import io
    import logging

    class Owning(logging.StreamHandler):  # closes its stream with itself, as absl's does
        def close(self):
            self.stream.close()
            super().close()

    stream = io.StringIO()
    handler = Owning(stream)
    log = logging.getLogger("streamrl-test-log")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    _, _, server, _ = _stuck_server(served)
    try:
        log.info("logged after the endpoint started")
        assert not stream.closed
        assert "logged after the endpoint started" in stream.getvalue()
    finally:
        server.stop()
        log.removeHandler(handler)
        handler.close()


def test_a_completion_past_its_deadline_is_a_504_and_closes_its_episode(served):
    ep, backend, server, client = _stuck_server(served, timeout_s=0.5)
    try:
        eid = client.open()
        # The stuck backend never finishes: a 504 naming the deadline is the deadline's
        # path (checked by the answer, not a wall clock)
        with pytest.raises(openai.APIStatusError, match="did not finish in 0 s") as e:
            _chat(client.openai(eid), USER)
        assert e.value.status_code == 504
        assert backend.futures[0].cancelled() and backend.released == [eid]
        with pytest.raises(openai.ConflictError, match="passed its deadline"):
            _chat(client.openai(eid), USER)
        assert ep.counts["deadline"] == 1
    finally:
        server.stop()


def test_requests_past_the_inflight_limit_are_refused_not_queued(served):
    ep, backend, server, client = _stuck_server(served, max_inflight=1, timeout_s=20)
    try:
        first = client.openai(client.open())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_chat, first, USER, max_tokens=2)
            while not backend.futures:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError, match="1 requests are generating"):
                _chat(client.openai(client.open()), USER)
            backend.futures[0].cancel()  # the first one ends (as an error): nothing hangs
            with pytest.raises(openai.APIError):
                pending.result(timeout=30)
    finally:
        server.stop()


def test_a_client_that_leaves_mid_stream_loses_nothing(served):
    # The raw HTTP client reads the stream's first bytes and hangs up; the turn is
    # recorded (it finished before streaming), the server goes on serving, and the
    # episode continues from the recorded turn.
    eid = served.client.open()
    body = json.dumps({"model": "policy", "messages": USER, "max_tokens": 6, "stream": True,
                       "extra": None}).replace(', "extra": null', "")  # fmt: skip
    host, port = served.server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"X-Episode-Id: {eid}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 30
    while served.endpoint.book._open[eid].busy and time.monotonic() < deadline:
        time.sleep(0.01)
    rec = served.endpoint.book._open[eid]
    assert rec.turns == 1
    history = [*rec.messages, {"role": "user", "content": "go on"}]
    oc = served.client.openai(eid)
    assert _chat(oc, history, max_tokens=2).choices[0].finish_reason in ("stop", "length")
    served.client.close(eid)
    oc.close()


def test_a_client_that_never_finishes_its_body_is_timed_out(served):
    ep, _, server, client = _stuck_server(served, body_timeout_s=0.5)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                f'{TOKEN}\r\nContent-Length: 1000\r\n\r\n{{"model"'.encode()
            )
            reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"not received in" in reply
        assert client.open().startswith("ep-")  # still serving
    finally:
        server.stop()


def test_a_bounded_load_loses_no_request_and_leaves_nothing_open(served):
    # 24 episodes of two turns from 8 threads, each its own official client: every
    # request answered (200, or 429 when the in-flight limit is reached: retried), every
    # episode closed with both turns recorded, the book empty again.
    before = served.endpoint.book.num_open

    def one(i: int) -> int:
        with served.client.episode() as (oc, eid):
            r = _chat(oc, [{"role": "user", "content": f"Task {i}"}], max_tokens=3)
            history = [{"role": "user", "content": f"Task {i}"},
                       {"role": "assistant", "content": r.choices[0].message.content},
                       {"role": "user", "content": "more"}]  # fmt: skip
            _chat(oc, history, max_tokens=3)
            return served.endpoint.book._open[eid].turns

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        turns = list(pool.map(one, range(24), timeout=300))
    assert turns == [2] * 24
    assert served.endpoint.book.num_open == before
    assert threading.active_count() < 200


# ---------------------------------------------------------------------- stop strings, top_logprobs
def test_a_multi_token_stop_string_cuts_the_text_and_the_next_turn_goes_on_exactly(served):
    # A turn's tokens depend only on (weights, prompt, seed): a free turn shows the text;
    # a stop string inside the text of three of its tokens then ends the turn at the
    # token that completed it. The text returned (and streamed) stops before it, the
    # record holds the tokens as sampled through that token, and the next turn extends
    # the kept KV and draws what a fresh prefill of the same history draws.
    tok = served.endpoint.turns.ctx.tokenizer
    engine = served.backend.service.engines[0]
    with served.client.episode() as (oc, _):
        free = _chat(oc, USER, max_tokens=16, seed=7, extra_body={"ignore_eos": True})
    ids = free.choices[0].model_extra["token_ids"]
    stop = tok.decode(ids[4:7])[1:-1]  # inside the text of three tokens
    assert len(tok.encode(stop)) > 1 and stop not in tok.decode(ids[:6])
    j = next(j for j in range(len(ids)) if stop in tok.decode(ids[: j + 1]))
    whole = tok.decode(ids[: j + 1])
    eid = served.client.open()
    oc = served.client.openai(eid)
    r1 = _chat(oc, USER, max_tokens=16, seed=7, stop=[stop, "never"], logprobs=True)
    c1 = r1.choices[0]
    assert c1.finish_reason == "stop" and c1.message.content == whole[: whole.find(stop)]
    assert c1.model_extra["token_ids"] == ids[: j + 1] and stop not in c1.message.content
    assert len(c1.logprobs.content) == j + 1
    rec = served.endpoint.book._open[eid]
    np.testing.assert_array_equal(rec.sample.policy_token_ids(), ids[: j + 1])
    extended = engine.metrics()["extended"]
    history = [*USER, {"role": "assistant", "content": c1.message.content},
               {"role": "user", "content": "And then?"}]  # fmt: skip
    r2 = _chat(oc, history, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert engine.metrics()["extended"] == extended + 1
    s = served.endpoint.book.close(eid).sample
    oc.close()
    ids2 = r2.choices[0].model_extra["token_ids"]
    np.testing.assert_array_equal(s.policy_token_ids(), ids[: j + 1] + ids2)
    env = s.response[j + 1 : len(s.response) - len(ids2)]
    # the policy did not end its turn: the template's closing comes first
    assert tok.decode(env, skip_special_tokens=False).startswith("<|im_end|>")
    # The same history prefilled afresh (no kept slot) draws the same tokens.
    m = len(s.response) - len(ids2)  # the history: the first turn and the template's
    cont = Continuation(
        tokens=s.response[:m], logprobs=s.logprobs[:m], sampling_logprobs=s.sampling_logprobs[:m],
        versions=s.versions()[:m], policy_mask=s.policy_mask[:m],
    )  # fmt: skip
    ref = served.backend.submit(
        GenerationRequest(
            request_id="fresh-prefill",
            prompt=s.prompt.tolist(),
            seed=s.seed,
            max_new_tokens=j + 1 + 5,
            forced_length=j + 1 + 5,
            continuation=cont,
            sampling=SamplingParams(temperature=0.0),
        )
    ).result(timeout=120)
    np.testing.assert_array_equal(ref.response, s.response)
    np.testing.assert_allclose(ref.logprobs, s.logprobs, atol=1e-4)
    # Streamed, the stop string's text never appears either.
    with served.client.episode() as (oc, _):
        stream = _chat(oc, USER, max_tokens=16, seed=7, stop=stop, stream=True)
        chunks = [ch for ch in stream if ch.choices]
    shown = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert shown == c1.message.content and chunks[-1].choices[0].finish_reason == "stop"


def _check_alternatives(tok, content, s) -> int:
    """Chat's `logprobs.content` against the record `s`: each token's 3 alternatives are
    the texts of the recorded ids with their log-probs, most likely first; the sampled
    token's entry equals its log-prob when it is among them (returns how often), else
    they are all likelier."""
    assert len(content) == s.num_tokens
    found = 0
    for i, e in enumerate(content):
        top = e.top_logprobs
        assert [a.token for a in top] == [
            tok.decode([t], skip_special_tokens=False) for t in s.top_ids[i, :3]
        ]
        assert [a.logprob for a in top] == s.top_logprobs[i, :3].tolist()
        assert [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
        assert all(bytes(a.bytes) == a.token.encode() for a in top)
        hit = [a for a, t in zip(top, s.top_ids[i, :3], strict=True) if t == s.response[i]]
        if hit:
            found += 1
            assert hit[0].logprob == e.logprob
        else:
            assert top[-1].logprob >= e.logprob
    return found


def test_top_logprobs_in_chat_and_completions(served):
    # Each token's alternatives under the model's own distribution (as `logprobs`), most
    # likely first; the sampled token's entry equals its log-prob when it is among them;
    # each alternative is the text of the recorded id.
    tok = served.endpoint.turns.ctx.tokenizer
    for temperature in (1.0, 0.0):  # (greedy: every token the most likely)
        eid = served.client.open()
        oc = served.client.openai(eid)
        r = _chat(oc, USER, max_tokens=6, temperature=temperature, logprobs=True, top_logprobs=3)
        s = served.endpoint.book.close(eid).sample
        oc.close()
        found = _check_alternatives(tok, r.choices[0].logprobs.content, s)
        if temperature == 0:
            assert found == s.num_tokens
    # Streamed, each chunk carries its tokens' alternatives (the engine reports them
    # with the tokens): joined, the same entries as the record's.
    with served.client.episode() as (oc, eid):
        stream = _chat(oc, USER, max_tokens=6, logprobs=True, top_logprobs=3, stream=True)
        content = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content]  # fmt: skip
        s = served.endpoint.book._open[eid].sample
    _check_alternatives(tok, content, s)
    with served.client.episode() as (oc, eid):
        c = oc.completions.create(
            model="policy", prompt="Once upon a time", max_tokens=5, logprobs=2, temperature=0
        )
        s = served.endpoint.book._open[eid].sample
    lp = c.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == s.num_tokens
    for i, (d, piece, v) in enumerate(zip(lp.top_logprobs, lp.tokens, lp.token_logprobs,
                                          strict=True)):  # fmt: skip
        assert list(d.values()) == sorted(d.values(), reverse=True) and 1 <= len(d) <= 2
        assert list(d) == [tok.decode([t], skip_special_tokens=False) for t in s.top_ids[i, :2]]
        assert d[piece] == v  # greedy: the sampled token is the most likely
    with served.client.episode() as (oc, _):
        with pytest.raises(openai.BadRequestError, match=r"logprobs=21 must be in \[0, 20\]"):
            oc.completions.create(model="policy", prompt="x", logprobs=21)
        with pytest.raises(openai.BadRequestError, match="at most 5 alternatives"):
            oc.completions.create(model="policy", prompt="x", logprobs=6)


def test_a_training_runs_backend_keeps_a_turns_stop_strings():
    # A run's episode samples as the run does (its placeholder's id, seed, temperature),
    # but stops where the turn asked: its stop ids and stop strings reach the driver.
    from streamrl_jax.endpoint.backend import PipelineBackend

    validated = []
    backend = PipelineBackend(validated.append, lambda q: q)
    run = SamplingParams(temperature=0.7, top_p=0.9)
    backend.expect("ep-1", GenerationRequest(request_id="run/3", prompt=[1], max_new_tokens=4,
                                             sampling=run, seed=11))  # fmt: skip
    asked = SamplingParams(temperature=0.0, stop_ids=(2,), stop_texts=("END", "\n\n"))
    backend.submit(GenerationRequest(request_id="ep-1", prompt=[5, 6], max_new_tokens=4,
                                     sampling=asked))  # fmt: skip
    q = backend.first("ep-1", timeout=5)
    assert validated == [q] and (q.request_id, q.seed, q.prompt) == ("run/3", 11, [5, 6])
    assert q.sampling == SamplingParams(
        temperature=0.7, top_p=0.9, stop_ids=(2,), stop_texts=("END", "\n\n")
    )
