"""A scripted policy behind the endpoint: each turn "samples" the tokens of a given text
(with made-up log-probs), so that a test decides what the policy writes (a call,
parallel calls, a malformed call). Shared by endpoint_tools_test.py and
chained_calculator_test.py."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from streamrl_jax.endpoint.server import endpoint_token
from streamrl_jax.generation.types import Sample, Timings, TokenDelta
from streamrl_jax.model.tokenizer import Tokenizer

TOKEN = endpoint_token(b"the tool-calling tests' secret")


class Scripted:
    """A backend whose policy writes `script`'s texts, one per turn (each then ends its
    turn with `<|im_end|>`; a streamed turn's tokens reported one by one first), cut as
    an engine cuts a turn at the request's `max_new_tokens` (finish "length"); every
    request it was given is kept. It also serves as an in-process episode's engine
    (`submit` takes any generation request; the sample echoes its identity)."""

    version = 0

    def __init__(self, tok: Tokenizer):
        self.tok, self.script, self.requests = tok, [], []
        self.released: list[str] = []

    def submit(self, request) -> Future:
        self.requests.append(request)
        new = [*self.tok.encode(self.script.pop(0)), self.tok.token_to_id("<|im_end|>")]
        cap = request.max_new_tokens - request.generated  # this turn's policy tokens
        finish = "stop" if len(new) <= cap else "length"
        new = new[:cap]
        cont = request.continuation
        before = np.zeros(0, np.int32) if cont is None else cont.tokens
        mask = np.ones(0, bool) if cont is None else cont.policy_mask
        logprobs = -0.25 * np.arange(1, len(new) + 1, dtype=np.float32)
        old_lp = np.zeros(0, np.float32) if cont is None else cont.logprobs
        if request.on_tokens is not None:  # a streamed turn: token by token, as an engine
            for k, (t, lp) in enumerate(zip(new, logprobs, strict=True)):
                request.on_tokens(
                    TokenDelta(request_id=request.request_id, start=len(before) + k,
                               tokens=np.int32([t]), logprobs=np.float32([lp]),
                               versions=np.int32([0]))
                )  # fmt: skip
        f: Future = Future()
        f.set_result(
            Sample(
                request_id=request.request_id,
                prompt=np.asarray(request.prompt, np.int32),
                response=np.r_[before, new].astype(np.int32),
                logprobs=np.r_[old_lp, logprobs].astype(np.float32),
                sampling_logprobs=np.zeros(len(before) + len(new), np.float32),
                finish_reason=finish,
                policy_version=0,
                last_policy_version=0,
                instance_id=0,
                timings=Timings(enqueue=time.time(), admit=time.time(), finish=time.time()),
                policy_mask=np.r_[mask, np.ones(len(new), bool)],
                tag=request.tag,
                metadata=request.metadata,
                sampling=request.sampling,
                seed=request.seed,
            )
        )
        return f

    def release(self, request_id) -> None:
        self.released.append(request_id)
