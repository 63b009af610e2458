"""The pickle-free wire format of the cross-process channels.

Every message a generation process sends its training process (`Sample`,
`ChunkReport`, `SpanReport`, `RoundClosed`, `GenerationFailed`) is msgpack with a
fixed, typed schema (msgspec `Struct`s, one tag per message type; the weight
sync's messages are `shard_wire.py`'s). Arrays travel as raw little-endian bytes
with a fixed dtype per field (int32 tokens and per-token versions, float32
log-probs), so a frame never names a type to build and nothing is unpickled.
Every response token carries the policy version that sampled it (in-flight
weight updates: a sample may span versions; docs/pipeline.md), checked on
receipt like the other fields: one per token, never decreasing, from
`policy_version` to `last_policy_version`. The reports are their own
schema (`messages.py`); a `Sample` maps to and from `_Sample`.

Decoding is strict: unknown tags or fields, wrong types, over-long strings or
containers, and array lengths that disagree raise `WireError` naming the
sender and the field (msgspec's path, e.g. `$.tag.prompt_id`). msgspec checks
every declared length against the bytes actually present before it allocates,
so a hostile frame costs at most its own (bounded) size.

A mixture of experts' route record (`Sample.routes`, routing replay) travels as raw
u8/u16 ids with its layer and expert counts, its size checked against the sample's
fed positions on receipt (the ids against the model where the trainer packs them).
Each token's top log-probs (`Sample.top_ids`, `Sample.top_logprobs`, an engine with
`EngineConfig.top_logprobs`) travel as raw i32 and f32 [R, k] with their k, their sizes
checked against the response on receipt.

What does not cross the wire: `Sample.metadata` (the training process looks
the problem up in its own dataset by `tag.prompt_id`), except an episode's outcome
(`metadata["episode"]`, with the sample's policy mask: a multi-turn episode,
docs/episodes.md), checked on receipt (a finite return, counts >= 0, its environment
tokens those of the mask, the mask ending on a policy token; the version checks then
read the policy's tokens), and a multi-agent episode's seat's role and turn graph
(`metadata["role"]`, `metadata["turn_graph"]`; a role that never acted: a masked
outcome with no turn and no policy token). `decode` returns `metadata={}` or
`{"episode": ...}` (and `"role"`, `"turn_graph"`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import (
    ChunkReport,
    GenerationFailed,
    RoundClosed,
    SpanReport,
    Str,
    WireStruct,
)
from streamrl_jax.generation.types import FinishReason, RequestTag, Sample, Timings

MAX_TOKENS = 1 << 20  # elements of one token / log-prob array

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


class WireError(TransportError):
    """A received frame is not a well-formed message; names the sender and the problem."""


# ---------------------------------------------------------------- schema
# Raw little-endian bytes of a 1-D array; the 4-byte dtype is fixed per field.
_Raw4 = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_TOKENS)]
_Raw1 = Annotated[bytes, msgspec.Meta(max_length=MAX_TOKENS)]
MAX_ROUTE_BYTES = 1 << 28  # a sample's route record (positions x layers x k ids)
_RawRoutes = Annotated[bytes, msgspec.Meta(max_length=MAX_ROUTE_BYTES)]
MAX_TOP_K = 64  # alternatives per token (`EngineConfig.top_logprobs`)
MAX_TURNS = 4096  # turns of a multi-agent episode's graph
_RawTop = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_TOP_K * MAX_TOKENS)]


class _Routes(WireStruct):
    """A mixture of experts' route record (`Sample.routes`): u8 or u16 ids, row-major
    [prompt + response - 1, layers, k]; the ids are checked against the model where the
    trainer packs them (`routes.Spec.check`)."""

    ids: _RawRoutes
    layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    k: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    wide: bool  # u16 (more than 254 experts), else u8


class _Top(WireStruct):
    """Each response token's k most likely tokens (`Sample.top_ids`): i32 ids and f32
    log-probs, row-major [R, k]."""

    ids: _RawTop
    logprobs: _RawTop
    k: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOP_K)]


class _Tag(WireStruct):
    batch: int
    group: int
    member: int
    prompt_id: Str
    eval_version: int | None
    round: int = -1  # partial rollout: the round the sample ended in (>= batch), or -1


class _Timings(WireStruct):
    enqueue: float
    admit: float
    finish: float


class _Turn(WireStruct, array_like=True):
    """One turn of a multi-agent episode's graph (`metadata["turn_graph"]`)."""

    turn: Annotated[int, msgspec.Meta(ge=0)]
    role: Str
    version: Annotated[int, msgspec.Meta(ge=0)]
    tokens: Annotated[int, msgspec.Meta(ge=0)]
    policy_tokens: Annotated[int, msgspec.Meta(ge=0)]


class _Episode(WireStruct):
    """An episode's outcome (`Sample.metadata["episode"]`, pipeline/rollouts/episodes.py);
    a multi-agent episode's seat (pipeline/rollouts/multi_agent.py) adds its `role` and
    the episode's turn graph (`metadata["role"]`, `metadata["turn_graph"]`), or is a
    role that never acted (`masked`: no turn, no policy token)."""

    ret: float  # the return (finite)
    correct: bool
    format_ok: bool
    answer: Str | None
    turns: int  # >= 1
    tool_calls: int  # the counts: >= 0
    tool_failures: int
    malformed_calls: int
    cut_turns: int
    env_tokens: int  # = the policy mask's False entries
    outcome: Literal["done", "turn_limit", "context", "episode_tokens", "lag", "unacted"]
    masked: Str | None = None
    role: Str | None = None
    graph: Annotated[tuple[_Turn, ...], msgspec.Meta(max_length=MAX_TURNS)] | None = None


_EPISODE_COUNTS = ("tool_calls", "tool_failures", "malformed_calls", "cut_turns", "env_tokens")


class _Sample(WireStruct, tag="sample"):
    request_id: Str | int
    prompt: _Raw4  # i32[P], P >= 1
    response: _Raw4  # i32[R], R >= 1
    logprobs: _Raw4  # f32[R]
    sampling_logprobs: _Raw4  # f32[R]
    versions: _Raw4  # i32[R]: the policy version that sampled each response token
    finish_reason: FinishReason  # "paused": a partial-rollout sample handed on past max_lag
    policy_version: int
    last_policy_version: int
    instance_id: int
    timings: _Timings
    tag: _Tag
    # An episode's: u8[R] 1 on the policy's tokens, 0 on the environment's (None: all
    # the policy's), and its outcome.
    policy_mask: _Raw1 | None = None
    episode: _Episode | None = None
    routes: _Routes | None = None  # routing replay (`model.routing_replay`)
    top: _Top | None = None  # `EngineConfig.top_logprobs`


def _enc_hook(obj: Any) -> Any:
    # numpy scalars (an np.int64 version, an np.float32 time) as Python numbers.
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    raise TypeError(f"wire: cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(
    _Sample | ChunkReport | SpanReport | RoundClosed | GenerationFailed
)


# ---------------------------------------------------------------- messages
Message = Sample | ChunkReport | SpanReport | RoundClosed | GenerationFailed


def _raw(a: Any, dtype: np.dtype, field: str) -> memoryview:
    """`a`'s bytes, refusing anything but a 1-D array of exactly `dtype`."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
        got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"wire: Sample.{field} must be a 1-D {dtype.name} array, got {got}")
    return np.ascontiguousarray(a).data.cast("B")


def _encode_sample(s: Sample) -> _Sample:
    rid = s.request_id
    if isinstance(rid, np.integer):
        rid = int(rid)
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        raise ValueError(f"wire: Sample.request_id must be a str or an int, got {rid!r}")
    prompt = _raw(s.prompt, _I32, "prompt")
    response = _raw(s.response, _I32, "response")
    logprobs = _raw(s.logprobs, _F32, "logprobs")
    sampling_logprobs = _raw(s.sampling_logprobs, _F32, "sampling_logprobs")
    if not prompt or not response:
        raise ValueError("wire: Sample.prompt and Sample.response must not be empty")
    # Every token's version (`Sample.versions()`: policy_version throughout when none
    # were recorded), checked here as the receiver will, so a bad one fails at its source.
    token_versions = s.versions()
    versions = _raw(token_versions, _I32, "token_versions")
    arrays = (("logprobs", logprobs), ("sampling_logprobs", sampling_logprobs))
    for field, raw in (*arrays, ("token_versions", versions)):
        if len(raw) != len(response):
            raise ValueError(
                f"wire: Sample.{field} has {len(raw) // 4} elements, response {len(response) // 4}"
            )
    problem = _versions_problem(token_versions, s.policy_version, s.last_policy_version)
    if problem is not None:
        raise ValueError(f"wire: Sample.token_versions {problem}")
    mask = None
    if s.policy_mask is not None:
        m = np.asarray(s.policy_mask)
        if m.dtype != np.bool_ or m.shape != (len(response) // 4,):
            raise ValueError("wire: Sample.policy_mask must be a bool array, one per token")
        mask = m.astype(np.uint8).tobytes()
    episode = s.metadata.get("episode")
    if episode is not None and mask is None:  # every token the policy's (one turn, no tool)
        mask = np.ones(len(response) // 4, np.uint8).tobytes()
    t, tag = s.timings, s.tag
    routes = None
    if s.routes is not None:
        r = s.routes
        fed = len(prompt) // 4 + len(response) // 4 - 1
        if r.dtype not in (np.uint8, np.uint16) or r.ndim != 3 or r.shape[0] != fed:
            raise ValueError(
                f"wire: Sample.routes must be u8/u16 [{fed}, layers, k], got "
                f"{r.dtype}{list(r.shape)}"
            )
        wide = r.dtype == np.uint16
        ids = np.ascontiguousarray(r.astype("<u2") if wide else r).tobytes()
        routes = _Routes(ids, r.shape[1], r.shape[2], wide)
    top = None
    if s.top_ids is not None or s.top_logprobs is not None:
        top = _encode_top(s.top_ids, s.top_logprobs, len(response) // 4)
    return _Sample(
        rid,
        prompt,
        response,
        logprobs,
        sampling_logprobs,
        versions,
        s.finish_reason,
        s.policy_version,
        s.last_policy_version,
        s.instance_id,
        _Timings(t.enqueue, t.admit, t.finish),
        _Tag(tag.batch, tag.group, tag.member, tag.prompt_id, tag.eval_version, tag.round),
        mask,
        None if episode is None else _encode_episode(episode, s.metadata),
        routes,
        top,
    )


def _encode_episode(episode: dict[str, Any], metadata: dict[str, Any]) -> _Episode:
    """An episode's outcome, with a multi-agent seat's role and turn graph."""
    graph = metadata.get("turn_graph")
    return _Episode(
        ret=episode["return"],
        **{k: v for k, v in episode.items() if k != "return"},
        role=metadata.get("role"),
        graph=None if graph is None else tuple(_Turn(**t) for t in graph),
    )


def _encode_top(ids: Any, logprobs: Any, r: int) -> _Top:
    """A sample's top log-probs, refusing anything but i32 and f32 [r, k], 1 <= k <= 64."""
    shapes = [
        f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        for a in (ids, logprobs)
    ]
    ok = (
        isinstance(ids, np.ndarray)
        and isinstance(logprobs, np.ndarray)
        and ids.dtype == _I32
        and logprobs.dtype == _F32
        and ids.ndim == 2
        and ids.shape == logprobs.shape
        and ids.shape[0] == r
        and 1 <= ids.shape[1] <= MAX_TOP_K
    )
    if not ok:
        raise ValueError(
            f"wire: Sample.top_ids and top_logprobs must be int32 and float32 [{r}, k] "
            f"(1 <= k <= {MAX_TOP_K}), got {shapes[0]} and {shapes[1]}"
        )
    return _Top(
        np.ascontiguousarray(ids).tobytes(), np.ascontiguousarray(logprobs).tobytes(), ids.shape[1]
    )


def _top(t: _Top, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Received top log-probs as i32 and f32 [r, k], their sizes checked."""
    want = 4 * r * t.k
    if len(t.ids) != want or len(t.logprobs) != want:
        raise ValueError(
            f"$.top has {len(t.ids)} and {len(t.logprobs)} bytes; {r} tokens x {t.k} "
            f"alternatives need {want} each"
        )
    return (
        np.frombuffer(t.ids, _I32).reshape(r, t.k),
        np.frombuffer(t.logprobs, _F32).reshape(r, t.k),
    )


def _versions_problem(versions: np.ndarray, first: int, last: int) -> str | None:
    """What is wrong with a sample's per-token versions (None: nothing). A slot only ever
    moves to newer weights (at a chunk boundary), so they never decrease; the first token
    is sampled at admission (`policy_version`), the last under `last_policy_version`."""
    if versions.size and int(versions.min()) < 0:
        return f"has a negative version ({int(versions.min())})"
    if np.any(np.diff(versions) < 0):
        i = int(np.argmax(np.diff(versions) < 0))
        return f"decrease at token {i + 1} ({int(versions[i])} -> {int(versions[i + 1])})"
    if versions.size and (int(versions[0]), int(versions[-1])) != (first, last):
        return (
            f"run {int(versions[0])}..{int(versions[-1])}, but the sample says "
            f"policy_version {first}, last_policy_version {last}"
        )
    return None


def _decode_sample(w: _Sample) -> Sample:
    fields = ("prompt", "response", "logprobs", "sampling_logprobs", "versions")
    sizes = [len(getattr(w, field)) for field in fields]
    for field, size in zip(fields, sizes, strict=True):
        if size == 0 or size % 4:
            raise ValueError(f"$.{field} has {size} bytes, not a positive multiple of 4")
    for field, size in zip(fields[2:], sizes[2:], strict=True):
        if size != sizes[1]:
            raise ValueError(f"$.{field} has {size // 4} elements, $.response {sizes[1] // 4}")
    versions = np.frombuffer(w.versions, _I32)
    mask = None
    if w.policy_mask is not None:
        raw = np.frombuffer(w.policy_mask, np.uint8)
        unacted = w.episode is not None and w.episode.masked is not None
        if raw.size != sizes[1] // 4 or raw.max(initial=0) > 1 or not (raw[-1] or unacted):
            raise ValueError(
                "$.policy_mask must hold one 0/1 per response token and end on a policy token"
            )
        mask = raw.astype(bool)
    problem = _versions_problem(
        versions if mask is None else versions[mask], w.policy_version, w.last_policy_version
    )
    if problem is not None:
        raise ValueError(f"$.versions {problem}")
    metadata: dict[str, Any] = {}
    if w.episode is not None:
        metadata["episode"] = episode = _episode(w.episode, mask)
        role, graph = episode.pop("role"), episode.pop("graph")
        if role is not None:  # a multi-agent episode's seat
            metadata["role"] = role
        if graph is not None:
            fields = _Turn.__struct_fields__
            metadata["turn_graph"] = [{f: getattr(t, f) for f in fields} for t in graph]
    t, tag = w.timings, w.tag
    routes = None if w.routes is None else _routes(w.routes, sizes[0] // 4 + sizes[1] // 4 - 1)
    if tag.round != -1 and tag.round < tag.batch:
        raise ValueError(f"$.tag.round is {tag.round}: a round holds batches up to its own")
    top_ids, top_logprobs = (None, None) if w.top is None else _top(w.top, sizes[1] // 4)
    return Sample(
        request_id=w.request_id,
        prompt=np.frombuffer(w.prompt, _I32),
        response=np.frombuffer(w.response, _I32),
        logprobs=np.frombuffer(w.logprobs, _F32),
        sampling_logprobs=np.frombuffer(w.sampling_logprobs, _F32),
        finish_reason=w.finish_reason,
        policy_version=w.policy_version,
        last_policy_version=w.last_policy_version,
        instance_id=w.instance_id,
        timings=Timings(enqueue=t.enqueue, admit=t.admit, finish=t.finish),
        token_versions=versions,
        policy_mask=mask,
        metadata=metadata,
        routes=routes,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        tag=RequestTag(
            batch=tag.batch,
            group=tag.group,
            member=tag.member,
            prompt_id=tag.prompt_id,
            eval_version=tag.eval_version,
            round=tag.round,
        ),
    )


def _routes(r: _Routes, fed: int) -> np.ndarray:
    """A received route record as u8/u16[fed, layers, k], its size checked."""
    dtype = np.dtype("<u2") if r.wide else np.dtype(np.uint8)
    want = fed * r.layers * r.k * dtype.itemsize
    if len(r.ids) != want:
        raise ValueError(
            f"$.routes.ids has {len(r.ids)} bytes; {fed} fed positions x {r.layers} layers "
            f"x {r.k} ids need {want}"
        )
    return np.frombuffer(r.ids, dtype).reshape(fed, r.layers, r.k)


def _episode(e: _Episode, mask: np.ndarray | None) -> dict[str, Any]:
    """A received episode outcome as `metadata["episode"]`, its bounds checked."""
    if mask is None:
        raise ValueError("$.episode without $.policy_mask")
    unacted = e.masked is not None
    if unacted != (e.outcome == "unacted") or (unacted and (e.turns != 0 or mask.any())):
        raise ValueError(
            "$.episode: a masked seat is one that never acted (outcome 'unacted', no turn, "
            "no policy token), and only it"
        )
    if not np.isfinite(e.ret) or e.turns < (0 if unacted else 1):
        raise ValueError("$.episode: a non-finite return or no turn")
    if min(getattr(e, k) for k in _EPISODE_COUNTS) < 0:
        raise ValueError("$.episode: a negative count")
    if e.env_tokens != int((~mask).sum()):
        raise ValueError(
            f"$.episode.env_tokens is {e.env_tokens}, the policy mask has "
            f"{int((~mask).sum())} environment tokens"
        )
    out = {f: getattr(e, f) for f in e.__struct_fields__ if f not in ("ret", "masked")}
    if unacted:
        out["masked"] = e.masked
    return {"return": e.ret, **out}


# The reports are their own schema (messages.py); a Sample maps to and from `_Sample`.
_REPORTS = (ChunkReport, SpanReport, RoundClosed, GenerationFailed)


def encode(msg: Message) -> bytes:
    """One message as a frame payload for `decode`.

    `Sample.metadata` is not sent. Bounds on strings and lengths are checked
    only by the receiver, which refuses the frame naming the sender.

    Raises:
      TypeError: `msg` is not one of the five message types.
      ValueError: a `Sample` whose arrays are not 1-D int32 (prompt, response,
        token versions) and float32 (log-probs) of equal length >= 1, whose
        per-token versions decrease or do not run from `policy_version` to
        `last_policy_version`, or whose request id is neither a str nor an int.
    """
    if type(msg) is Sample:
        return _ENCODER.encode(_encode_sample(msg))
    if type(msg) not in _REPORTS:
        raise TypeError(f"wire: cannot encode a {type(msg).__name__}")
    return _ENCODER.encode(msg)


def decode(payload: bytes | memoryview, *, source: str) -> Message:
    """The message in a frame payload from `source` (a peer's name, for errors).

    The arrays of a returned `Sample` are read-only views of bytes the decoder
    owns (not of `payload`), and its `metadata` is `{}`.

    Raises:
      WireError: the payload is not a well-formed message; the message names
        `source` and the field or problem.
    """
    try:
        wire = _DECODER.decode(payload)
        return _decode_sample(wire) if type(wire) is _Sample else wire
    except (msgspec.MsgspecError, ValueError, RecursionError) as e:
        raise WireError(f"malformed message from {source}: {e}") from None
