"""Host-side datatypes of the generation engine: requests in, samples out.

`GenerationRequest` is what a caller (the dispatcher, a benchmark) hands to an
engine or to the `GenerationService`; `Sample` is what comes back, one per
request, the moment its last token is sampled. Both are plain frozen host
dataclasses: they never cross a jit boundary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "context", "forced", "paused"]
# Device-side finish codes (0 = still running), shared with the engine. "paused": the
# request's `segment_tokens` ran out before it finished (partial rollout): a partial
# sample, to be continued by a request with its `Continuation`.
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "context", "forced", "paused")
# Bounds of a request's stop strings (`SamplingParams.stop_texts`): the host checks the
# text of the last few tokens after every round trip (`generation/stop_texts.py`).
MAX_STOP_TEXTS = 16
MAX_STOP_TEXT_CHARS = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is drawn from the model's logits.

    The sampling distribution is softmax(filter(logits / temperature)), where
    `filter` keeps the `top_k` largest logits (ties at the k-th value are kept)
    and then the smallest prefix of the sorted, renormalised distribution whose
    mass reaches `top_p` (the token that crosses `top_p` is kept).

    Attributes:
      temperature: 0 means greedy (argmax of the unmodified logits); > 0 divides
        the logits before filtering and sampling.
      top_k: keep the k most likely tokens; 0 disables the filter.
      top_p: nucleus mass in (0, 1]; 1 disables the filter.
      stop_ids: token ids that end a sample (included in the response); empty
        means the engine's default stop ids.
      stop_texts: strings that end a sample once the text of the tokens it sampled
        (after its continuation's, decoded by the engine's detokenizer) contains one:
        the response ends with the token that completed it (finish reason "stop");
        tokens its round trip sampled after that one are discarded. Needs an engine
        built with a detokenizer; ignored with a forced length.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    stop_texts: tuple[str, ...] = ()

    @classmethod
    def greedy(cls, stop_ids: Sequence[int] = ()) -> SamplingParams:
        return cls(temperature=0.0, stop_ids=tuple(stop_ids))

    def validate(self, vocab_size: int, max_stop_ids: int) -> None:
        """Raises ValueError naming the offending field."""
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"sampling.temperature must be a finite float >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an int >= 0, got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {p!r}")
        if len(self.stop_ids) > max_stop_ids:
            raise ValueError(
                f"sampling.stop_ids has {len(self.stop_ids)} ids; at most {max_stop_ids}"
            )
        for s in self.stop_ids:
            if not isinstance(s, int | np.integer) or not 0 <= s < vocab_size:
                raise ValueError(f"sampling.stop_ids: {s!r} is not a token id < {vocab_size}")
        texts = self.stop_texts
        if not isinstance(texts, tuple) or len(texts) > MAX_STOP_TEXTS:
            raise ValueError(
                f"sampling.stop_texts must be a tuple of at most {MAX_STOP_TEXTS} strings"
            )
        for t in texts:
            if not isinstance(t, str) or not 1 <= len(t) <= MAX_STOP_TEXT_CHARS:
                raise ValueError(
                    f"sampling.stop_texts: {str(t)[:64]!r} is not a string of 1-"
                    f"{MAX_STOP_TEXT_CHARS} characters"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestTag:
    """Where a request's sample belongs in the pipeline: routing only, never scored.

    The engine echoes it untouched from `GenerationRequest.tag` to `Sample.tag`.

    Attributes:
      batch: global batch b of a training sample; -1 for a held-out evaluation.
      group: index of the prompt in its batch (the GRPO group), or of the eval prompt.
      member: index of the sample in its group.
      prompt_id: the problem's id.
      eval_version: the policy version a held-out evaluation scores; None for training.
      round: partial rollout (pipeline.partial_budget_tokens): the round (step) whose
        generation this segment belongs to; -1 outside partial rollout.
    """

    batch: int = -1
    group: int = 0
    member: int = 0
    prompt_id: str = ""
    eval_version: int | None = None
    round: int = -1  # partial rollout: the generation round of this segment (-1: = batch)

    @property
    def is_eval(self) -> bool:
        return self.eval_version is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Continuation:
    """The response a paused sample already has: the engine re-prefills prompt + these
    tokens and samples on from token number len(tokens) (same per-token keys, so under
    the same weights the continuation draws what the uninterrupted sample would).

    Attributes:
      tokens: i32[K] response tokens so far (K >= 1).
      logprobs: f32[K] their behaviour log-probs.
      sampling_logprobs: f32[K].
      versions: i32[K] the version that sampled each (an environment token: the
        version of the policy token before it; never read as a lag).
      admit: wall time the sample was first admitted.
      policy_mask: bool[K] True on tokens the policy sampled, False on tokens an
        environment appended (an episode's tool results and chat scaffolding: never
        trained, their log-probs 0); None: every token is the policy's. Sampling goes
        on with counter = the number of policy tokens.
      routes: the routes of the positions the sample's slot held (`Sample.routes`); an
        extension in place (an episode's kept slot) keeps them, a re-prefill routes
        every position again.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    sampling_logprobs: np.ndarray
    versions: np.ndarray
    admit: float = 0.0
    policy_mask: np.ndarray | None = None
    routes: np.ndarray | None = None

    @classmethod
    def of(cls, sample: Sample) -> Continuation:
        """Where a paused sample stopped."""
        return cls(
            tokens=np.asarray(sample.response, np.int32),
            logprobs=np.asarray(sample.logprobs, np.float32),
            sampling_logprobs=np.asarray(sample.sampling_logprobs, np.float32),
            versions=sample.versions(),
            admit=sample.timings.admit,
            policy_mask=sample.policy_mask,
            routes=sample.routes,
        )

    @classmethod
    def after(cls, sample: Sample, env_tokens: Sequence[int]) -> Continuation:
        """An episode's turns so far: `sample`'s response, then `env_tokens` an
        environment appended (policy mask False, log-probs 0, the version of the policy
        token before them)."""
        k = len(env_tokens)
        mask = (
            np.ones(sample.num_tokens, bool) if sample.policy_mask is None else sample.policy_mask
        )
        zeros = np.zeros(k, np.float32)
        return cls(
            tokens=np.concatenate([sample.response, np.asarray(env_tokens, np.int32)]),
            logprobs=np.concatenate([sample.logprobs, zeros]),
            sampling_logprobs=np.concatenate([sample.sampling_logprobs, zeros]),
            versions=np.concatenate(
                [sample.versions(), np.full(k, sample.last_policy_version, np.int32)]
            ),
            admit=sample.timings.admit,
            policy_mask=np.concatenate([mask, np.zeros(k, bool)]),
            routes=sample.routes,
        )

    @property
    def policy_tokens(self) -> int:
        """How many of `tokens` the policy sampled (the next token's sampling counter)."""
        if self.policy_mask is None:
            return len(self.tokens)
        return int(np.count_nonzero(self.policy_mask))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to complete.

    Attributes:
      request_id: caller-chosen id, echoed in the `Sample`.
      prompt: token ids of the prompt (non-empty).
      max_new_tokens: response length cap (finish reason "length").
      sampling: sampling parameters.
      seed: the sample's randomness: token t is drawn with
        `fold_in(key(seed), t)`, so it depends only on (weights, prompt, seed).
      forced_length: if set, ignore stop ids and `max_new_tokens` and stop at
        exactly this many response tokens (finish reason "forced"); for
        length-replay benchmarks. prompt + forced_length must fit the context.
      priority: admission priority inside an instance (predicted length);
        used only when the engine admits longest-first ("lpt").
      tag: the pipeline's routing of the sample (batch, group, member, ...), echoed.
      metadata: the task's payload for the reward function (its answer, task
        name, ...), echoed; opaque to the engine and the pipeline.
      segment_tokens: partial rollout: pause after this many new tokens (finish
        reason "paused") unless the sample finishes first; None = never pause.
      continuation: the response of a paused sample to continue (re-prefilled), or an
        episode's turns so far with the environment's tokens appended; the sample
        returned holds the whole response, continuation first. `max_new_tokens` (and
        `segment_tokens`) count the policy tokens of the whole response.
      adapter: the LoRA adapter slot to decode with, on an engine with adapter slots
        (`EngineConfig.adapters`; -1: the base model alone); 0 on any other engine.
      keep_kv: keep the slot's KV once the sample ends (a stop, the length cap or a
        forced length), for
        a continuation with the same `request_id` (an episode's next turn): the engine
        appends the continuation's new tokens to the KV in place instead of
        re-prefilling, and the slot stays reserved until then or until `release`.
      on_tokens: asks for partial results: the engine calls it after each host round
        trip with the tokens the request gained in it (`TokenDelta`), every sampled
        token once and in order, the last before its `Sample` is returned (which stays
        the exact record). Called on the engine's thread: it must not block.
    """

    request_id: Any
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    forced_length: int | None = None
    priority: float = 0.0
    tag: RequestTag = RequestTag()
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    segment_tokens: int | None = None
    continuation: Continuation | None = None
    keep_kv: bool = False
    adapter: int = 0
    on_tokens: Callable[[TokenDelta], None] | None = None

    @classmethod
    def next_turn(
        cls,
        sample: Sample,
        env_tokens: Sequence[int],
        budget: int,
        *,
        sampling: SamplingParams | None = None,
        forced: bool = False,
        keep_kv: bool = True,
    ) -> GenerationRequest:
        """An episode's next turn after `sample`: its tokens so far, then `env_tokens`
        the environment appended (`Continuation.after`), and up to `budget` more policy
        tokens; the sample's id, prompt, seed, tag, metadata and adapter.

        Args:
          sample: the turn that ended.
          env_tokens: the environment's tokens after it (tool output, scaffolding).
          budget: policy tokens this turn may add.
          sampling: this turn's sampling (None: the sample's).
          forced: exactly `budget` more tokens, stop ids ignored (`forced_length`).
          keep_kv: the slot keeps its KV, the turn appended in place (False: the
            whole episode is prefilled again).
        """
        cont = Continuation.after(sample, env_tokens)
        n = cont.policy_tokens + budget
        return cls(
            request_id=sample.request_id,
            prompt=sample.prompt.tolist(),
            max_new_tokens=n,
            forced_length=n if forced else None,
            sampling=sample.sampling if sampling is None else sampling,
            seed=sample.seed,
            tag=sample.tag,
            metadata=sample.metadata,
            continuation=cont,
            keep_kv=keep_kv,
            adapter=sample.adapter,
        )

    @property
    def generated(self) -> int:
        """Policy tokens the request already has (its continuation's): the counter the
        next token is sampled with."""
        return 0 if self.continuation is None else self.continuation.policy_tokens

    @property
    def history(self) -> int:
        """Tokens after the prompt the request already has (its continuation's)."""
        return 0 if self.continuation is None else len(self.continuation.tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenDelta:
    """The tokens a running request gained in one host round trip (its
    `GenerationRequest.on_tokens` asked for them): a view of what its `Sample` will hold.

    Attributes:
      request_id: the request's.
      start: the index in the response of the first of them (a continuation's tokens
        come first: an episode's next turn starts at `GenerationRequest.history`).
      tokens: i32[K] sampled token ids (K >= 1).
      logprobs: f32[K] their behaviour log-probs (`Sample.logprobs`).
      versions: i32[K] the weights version that sampled each.
      top_ids, top_logprobs: [K, k] each token's k likeliest alternatives
        (`EngineConfig.top_logprobs`; None when the engine keeps none).
    """

    request_id: Any
    start: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timings:
    """Wall-clock times (`time.time()` seconds) of one sample's life."""

    enqueue: float  # accepted by the engine
    admit: float  # prefilled into a slot
    finish: float  # last token fetched to the host


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """A completed generation.

    Attributes:
      request_id: from the request.
      prompt: i32[P] prompt token ids.
      response: i32[R] sampled token ids (R >= 1; a stop id that ended the
        sample is its last token).
      logprobs: f32[R] behaviour log-probs: log_softmax(logits)[token] under
        the *unmodified* model distribution (temperature 1, no top-k/top-p) of
        the weights that sampled the token, i.e. exactly what the trainer
        recomputes with `Llama.token_logprobs`.
      sampling_logprobs: f32[R] log-prob of the token under the distribution it
        was actually drawn from (after temperature, top-k, top-p); 0 for greedy.
      finish_reason: "stop" | "length" | "context" | "forced".
      policy_version: weights version when the sample was admitted (prefill).
      last_policy_version: weights version of its last token; differs from
        `policy_version` only if `update_weights` landed mid-sample.
      token_versions: i32[R] the weights version that sampled each response token
        (in-flight weight updates: a sample may span versions); None when the
        producer did not record them (every token then has `policy_version`).
      instance_id: the generation instance that produced it.
      timings: enqueue / admit / finish wall times.
      tag: from the request.
      metadata: from the request.
      policy_mask: bool[R] True on the tokens the policy sampled, False on the tokens
        an environment appended (an episode's tool results and scaffolding: never
        trained; their log-probs are 0); None: all are the policy's.
      sampling, seed: the request's (echoed: an episode's next turn is drawn the same
        way, its tokens keyed on from the policy-token count).
      routes: u8/u16[P + R - 1, L, k] a mixture of experts' routes of every fed
        position (prompt, then the response but its last token), recorded with
        `EngineConfig.record_routes` for routing replay (`model/routes.py`); else None.
      adapter: the request's adapter slot (echoed: several learners' samples are routed
        by it).
      top_ids, top_logprobs: i32[R, k], f32[R, k] the k most likely tokens of each
        response token's position and their log-probs under the same distribution as
        `logprobs` (the unmodified model's), most likely first, from an engine with
        `EngineConfig.top_logprobs` k > 0; rows of tokens the request did not sample
        here (its continuation's) hold ids -1 and log-probs -inf. None otherwise.
    """

    request_id: Any
    prompt: np.ndarray
    response: np.ndarray
    logprobs: np.ndarray
    sampling_logprobs: np.ndarray
    finish_reason: FinishReason
    policy_version: int
    last_policy_version: int
    instance_id: int
    timings: Timings
    tag: RequestTag = RequestTag()
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    token_versions: np.ndarray | None = None
    policy_mask: np.ndarray | None = None
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    routes: np.ndarray | None = None
    adapter: int = 0
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.response.shape[0])

    def policy_token_ids(self) -> np.ndarray:
        """i32[N]: the tokens the policy sampled (the response without the environment's)."""
        r = self.response
        return r if self.policy_mask is None else r[np.asarray(self.policy_mask, bool)]

    def policy_versions(self) -> np.ndarray:
        """i32[N]: the version of every policy token (an environment token's KV version
        says nothing of the policy that sampled the episode)."""
        v = self.versions()
        return v if self.policy_mask is None else v[np.asarray(self.policy_mask, bool)]

    def versions(self) -> np.ndarray:
        """i32[R]: the version of every response token (`token_versions`, or
        `policy_version` throughout when none were recorded)."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, np.int32)
        return np.full((self.num_tokens,), self.policy_version, np.int32)

    @property
    def oldest_version(self) -> int:
        """The oldest policy token's version: a sample's lag at step b is b - this."""
        v = self.policy_versions()
        return int(v.min()) if v.size else self.policy_version

    @property
    def newest_version(self) -> int:
        v = self.policy_versions()
        return int(v.max()) if v.size else self.last_policy_version


class ChunkReport(msgspec.Struct, forbid_unknown_fields=True, frozen=True, tag="chunk"):
    """One engine round trip (a decode chunk, with any prefill before it), wall times.

    The one value that travels from the engine (`Engine(on_chunk=...)`) to the run's
    generation meter and trace, and across processes on the sample wire (its own wire
    schema: the bounds are checked when a frame is decoded, `distributed/wire.py`).
    """

    instance: Annotated[str, msgspec.Meta(max_length=256)]  # "0"; across processes "p<k>.<i>"
    t0: float  # wall time the round trip began (time.time())
    t1: float  # ... and ended
    tokens: int  # tokens emitted over all slots
    running: int  # slots running during the chunk (finished ones included)
    steps: int = 0  # decode steps of the chunk (the most any slot emitted)
    prefilled: int = 0  # prompt rows prefilled before it (forked group members not counted)
    # Episodes' next turns admitted before it: appended to their kept slot's KV in place,
    # or re-prefilled whole (their slot was given up).
    extended: int = 0
    reprefilled: int = 0
