"""The pickle-free wire format: round trips, and hostile frames refused by name.

Hostile frames are built by decoding a valid frame into plain msgpack values,
changing one thing, and encoding it again, so each case differs from a good
frame in exactly the way its name says.

`python tests/wire_test.py` prints encode+decode timings (not asserted here).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import timeit
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from streamrl_jax.distributed import wire
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import (
    ChunkReport,
    GenerationFailed,
    RoundClosed,
    SpanReport,
)
from streamrl_jax.generation.types import FINISH_REASONS, RequestTag, Sample, Timings

SOURCE = "generation-3"


def make_sample(
    request_id: Any = "train/3/5/0", eval_version: int | None = None, p: int = 64, r: int = 256
) -> Sample:
    rng = np.random.default_rng(0)
    return Sample(
        request_id=request_id,
        prompt=rng.integers(0, 49152, p, dtype=np.int32),
        response=rng.integers(0, 49152, r, dtype=np.int32),
        logprobs=-rng.exponential(size=r).astype(np.float32),
        sampling_logprobs=-rng.exponential(size=r).astype(np.float32),
        finish_reason="length",
        policy_version=7,
        last_policy_version=8,
        instance_id=2,
        timings=Timings(enqueue=1.7e9, admit=1.7e9 + 0.25, finish=1.7e9 + 3.5),
        tag=RequestTag(
            batch=3,
            group=5,
            member=1,
            prompt_id="mixture/0/17",
            eval_version=eval_version,
            round=4,
        ),
        metadata={"answer": "42", "prompt_id": "mixture/0/17"},
        # In-flight weight update: W_8 reached the slot half way through the response.
        token_versions=np.repeat(np.int32([7, 8]), [r // 2, r - r // 2]),
    )


def _plain(payload: bytes) -> dict:
    """A frame as plain msgpack values (dicts, bytes, ...), to be tampered with."""
    return msgspec.msgpack.decode(payload)


def _tampered(msg: Any, change: Callable[[dict], None]) -> bytes:
    frame = _plain(wire.encode(msg))
    change(frame)
    return msgspec.msgpack.encode(frame)


def _refused(payload: bytes | memoryview) -> str:
    with pytest.raises(wire.WireError) as info:
        wire.decode(payload, source=SOURCE)
    message = str(info.value)
    assert f"from {SOURCE}" in message
    return message


def _i32(values: list[int]) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def _nested(levels: int) -> bytes:
    return b"\x91" * levels + b"\x01"  # [[[...[1]...]]]


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("request_id", ["train/3/5/0", "", 17, -(2**63)])
@pytest.mark.parametrize("eval_version", [None, 0, 4])
def test_sample_round_trip(request_id, eval_version):
    sent = make_sample(request_id, eval_version)
    got = wire.decode(wire.encode(sent), source=SOURCE)
    for field in dataclasses.fields(Sample):
        a, b = getattr(sent, field.name), getattr(got, field.name)
        if field.name == "metadata":
            assert b == {}  # the trainer looks the problem up by tag.prompt_id
        elif isinstance(a, np.ndarray):
            assert b.dtype == a.dtype and b.shape == a.shape, field.name
            np.testing.assert_array_equal(b, a, err_msg=field.name)
        else:
            assert b == a and type(b) is type(a), field.name
    assert got.tag.is_eval == (eval_version is not None)


@pytest.mark.parametrize("reason", FINISH_REASONS)
def test_every_finish_reason_crosses_the_wire(reason):
    # "paused": a partial-rollout sample past max_lag handed on under lag_policy="drop".
    sent = dataclasses.replace(make_sample(), finish_reason=reason)
    assert wire.decode(wire.encode(sent), source=SOURCE).finish_reason == reason


def test_sample_arrays_are_bit_exact_and_independent_of_the_payload():
    sent = make_sample(r=5)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32)
    sent = dataclasses.replace(sent, logprobs=specials, sampling_logprobs=specials[::-1].copy())
    buffer = bytearray(wire.encode(sent))
    got = wire.decode(memoryview(buffer), source=SOURCE)
    buffer[:] = b"\0" * len(buffer)  # a reused receive buffer must not change the sample
    assert got.logprobs.tobytes() == specials.tobytes()
    assert got.sampling_logprobs.tobytes() == specials[::-1].tobytes()
    np.testing.assert_array_equal(got.prompt, sent.prompt)


def test_strided_arrays_are_sent_contiguously():
    sent = make_sample(r=8)
    sent = dataclasses.replace(sent, prompt=np.arange(20, dtype=np.int32)[::2])
    got = wire.decode(wire.encode(sent), source=SOURCE)
    np.testing.assert_array_equal(got.prompt, np.arange(0, 20, 2))


@pytest.mark.parametrize(
    "msg",
    [
        ChunkReport("p1.0", 1.7e9, 1.7e9 + 0.1, 512, 31, 16, 2048),
        SpanReport("weight_receive/generation-1", "W3", 1.0, 2.5, {"wire_s": 0.5, "bytes": 4e9}),
        SpanReport("t", "n", 0.0, 0.0, {}),
        RoundClosed(0, 3, ((2, 1), (3, 0)), 5, 1, 2, 0),
        GenerationFailed(1, "RuntimeError('engine: out of memory ✗')"),
    ],
    ids=["chunk", "span", "span-no-args", "round", "failed"],
)
def test_report_round_trip(msg):
    got = wire.decode(wire.encode(msg), source=SOURCE)
    assert type(got) is type(msg) and got == msg


def test_numpy_scalars_and_int_span_args_encode():
    msg = ChunkReport("p0.1", np.float64(1.0), np.float32(2.0), np.int64(3), 4, 5, 6)
    assert wire.decode(wire.encode(msg), source=SOURCE) == ChunkReport("p0.1", 1, 2, 3, 4, 5, 6)
    span = wire.decode(wire.encode(SpanReport("t", "n", 0, 1, {"bytes": 10})), source=SOURCE)
    assert span.args == {"bytes": 10.0} and isinstance(span.args["bytes"], float)


# ---------------------------------------------------------------- encode refuses
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(prompt=np.arange(4)), "prompt must be a 1-D int32"),  # int64
        (dict(response=np.zeros((2, 2), np.int32)), "response must be a 1-D int32"),
        (dict(logprobs=np.zeros(256, np.float64)), "logprobs must be a 1-D float32"),
        (dict(logprobs=[0.0] * 256), "logprobs must be a 1-D float32 array, got list"),
        (dict(sampling_logprobs=np.zeros(255, np.float32)), "sampling_logprobs has 255"),
        (dict(prompt=np.zeros(0, np.int32)), "must not be empty"),
        (dict(request_id=("a", 1)), "request_id must be a str or an int"),
        (dict(request_id=True), "request_id must be a str or an int"),
        (dict(token_versions=np.full(255, 7, np.int32)), "token_versions has 255"),
        (dict(token_versions=np.full((2, 128), 7, np.int32)), "token_versions must be a 1-D"),
        (dict(token_versions=None), r"run 7\.\.7, but .* last_policy_version 8"),
        (
            dict(token_versions=np.int32([7] * 100 + [8] * 100 + [7] * 56)),
            r"decrease at token 200 \(8 -> 7\)",
        ),
    ],
)
def test_encode_refuses_a_sample_the_wire_cannot_carry(change, match):
    with pytest.raises(ValueError, match=match):
        wire.encode(dataclasses.replace(make_sample(), **change))


def test_encode_refuses_other_types():
    for msg in ({"type": "sample"}, "text", np.zeros(3, np.int32)):
        with pytest.raises(TypeError, match="cannot encode"):
            wire.encode(msg)


# ---------------------------------------------------------------- decode refuses
def _set(path: str, value: Any) -> Callable[[dict], None]:
    *parents, key = path.split(".")

    def change(frame: dict) -> None:
        for p in parents:
            frame = frame[p]
        frame[key] = value

    return change


HOSTILE_SAMPLES = {
    # name: (change to a good frame, text the error must contain)
    "unknown tag": (_set("type", "evil"), "Invalid value 'evil' - at `$.type`"),
    "weight-sync tag": (_set("type", "shards"), "`$.type`"),
    "unknown field": (_set("treedef", b"\x80\x04"), "unknown field `treedef`"),
    "missing field": (lambda f: f.pop("timings"), "missing required field `timings`"),
    "odd byte count": (_set("response", b"\0" * 7), "$.response has 7 bytes"),
    "empty response": (_set("response", b""), "$.response has 0 bytes"),
    "empty prompt": (_set("prompt", b""), "$.prompt has 0 bytes"),
    "lengths differ": (_set("logprobs", b"\0" * 1020), "$.logprobs has 255 elements"),
    "array as list": (_set("prompt", [1, 2, 3]), "Expected `bytes`, got `array` - at `$.prompt`"),
    "too many tokens": (
        _set("response", b"\0" * (4 * wire.MAX_TOKENS + 4)),
        "length <= 4194304 - at `$.response`",
    ),
    "finish reason": (_set("finish_reason", "exploded"), "at `$.finish_reason`"),
    "request_id list": (_set("request_id", ["a"]), "got `array` - at `$.request_id`"),
    "request_id dict": (_set("request_id", {"a": 1}), "got `object` - at `$.request_id`"),
    "request_id bool": (_set("request_id", True), "got `bool` - at `$.request_id`"),
    "request_id float": (_set("request_id", 1.5), "got `float` - at `$.request_id`"),
    "request_id null": (_set("request_id", None), "got `None` - at `$.request_id`"),
    "request_id long": (_set("request_id", "x" * 4097), "at `$.request_id`"),
    "prompt_id long": (
        _set("tag.prompt_id", "x" * 4097),
        "Expected `str` of length <= 4096 - at `$.tag.prompt_id`",
    ),
    "eval_version str": (_set("tag.eval_version", "4"), "at `$.tag.eval_version`"),
    "time as str": (_set("timings.finish", "soon"), "at `$.timings.finish`"),
    "version as float": (_set("policy_version", 7.0), "got `float` - at `$.policy_version`"),
    "tag unknown field": (_set("tag.metadata", {"a": 1}), "unknown field `metadata`"),
    "round before its batch": (_set("tag.round", 2), "$.tag.round is 2: a round holds"),
    "round as str": (_set("tag.round", "4"), "at `$.tag.round`"),
    # Per-token versions (in-flight weight updates): one per token, never decreasing,
    # from policy_version (7) to last_policy_version (8).
    "versions missing": (lambda f: f.pop("versions"), "missing required field `versions`"),
    "versions as list": (_set("versions", [7] * 256), "got `array` - at `$.versions`"),
    "versions short": (_set("versions", _i32([7] * 128 + [8] * 127)), "$.versions has 255"),
    "versions odd bytes": (_set("versions", b"\0" * 1023), "$.versions has 1023 bytes"),
    "versions decrease": (
        _set("versions", _i32([7] * 100 + [8] * 100 + [7] * 56)),
        "$.versions decrease at token 200 (8 -> 7)",
    ),
    "versions negative": (
        _set("versions", _i32([-1] * 128 + [8] * 128)),
        "$.versions has a negative version (-1)",
    ),
    "versions beyond last": (
        _set("versions", _i32([7] * 128 + [9] * 128)),
        "$.versions run 7..9, but the sample says policy_version 7, last_policy_version 8",
    ),
    "versions one version": (_set("versions", _i32([8] * 256)), "$.versions run 8..8"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SAMPLES))
def test_decode_refuses_a_tampered_sample(name):
    change, expect = HOSTILE_SAMPLES[name]
    assert expect in _refused(_tampered(make_sample(), change))


@pytest.mark.parametrize(
    "msg, change, expect",
    [
        (GenerationFailed(1, "x"), _set("reason", "x" * (64 * 1024 + 1)), "at `$.reason`"),
        (GenerationFailed(1, "x"), _set("process", "1"), "at `$.process`"),
        (
            SpanReport("t", "n", 0, 1, {}),
            _set("args", {f"k{i}": 1.0 for i in range(65)}),
            "length <= 64 - at `$.args`",
        ),
        (SpanReport("t", "n", 0, 1, {}), _set("args", {"k": "v"}), "at `$.args[...]`"),
        (SpanReport("t", "n", 0, 1, {}), _set("args", {"k" * 4097: 1.0}), "`key` in `$.args`"),
        (ChunkReport("p", 0, 1, 2, 3, 4, 5), _set("instance", "p" * 4097), "at `$.instance`"),
        (RoundClosed(0, 1, (), 0, 0, 0, 0), _set("round", -1), "`int` >= 0 - at `$.round`"),
        (RoundClosed(0, 1, (), 0, 0, 0, 0), _set("groups", [[1, 2, 3]]), "at `$.groups[0]`"),
        (RoundClosed(0, 1, (), 0, 0, 0, 0), _set("paused", -2), "at `$.paused`"),
    ],
)
def test_decode_refuses_a_tampered_report(msg, change, expect):
    assert expect in _refused(_tampered(msg, change))


def test_decode_refuses_garbage_and_truncation():
    good = wire.encode(make_sample())
    assert "malformed" in _refused(b"\xc1 not msgpack at all")
    assert "truncated" in _refused(good[:-7])
    assert "truncated" in _refused(b"")
    assert "trailing characters" in _refused(good + b"\0")
    assert "Expected `object`, got `int`" in _refused(b"\x01")


def test_decode_refuses_a_pickle_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    for payload in (pickle.dumps(Exploit()), pickle.dumps(Exploit(), protocol=0)):
        _refused(payload)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Exploit()))  # the guard: this payload is live
    assert marker.exists()


def test_decode_survives_deep_nesting():
    # 100,000 levels: a RecursionError (or a crash) in a decoder that recursed.
    deep = _nested(100_000)
    marker = msgspec.msgpack.encode("@@MARK@@")
    frame = msgspec.msgpack.encode({**_plain(wire.encode(make_sample())), "request_id": "@@MARK@@"})
    assert "at `$.request_id`" in _refused(frame.replace(marker, deep))
    span = wire.encode(SpanReport("t", "n", 0, 1, {"@@MARK@@": 1.0}))
    assert "`$.args`" in _refused(span.replace(marker, deep))
    assert "Expected `object`, got `array`" in _refused(deep)


def test_a_huge_declared_length_allocates_nothing():
    # A response declared as ~4 GiB (over the bound) or 4 MiB (within it), 4 bytes present.
    marker = msgspec.msgpack.encode(b"@@MARK@@")
    frame = msgspec.msgpack.encode({**_plain(wire.encode(make_sample())), "response": b"@@MARK@@"})
    over = frame.replace(marker, b"\xc6\xff\xff\xff\xf0abcd")
    within = frame.replace(marker, b"\xc6\x00\x40\x00\x00abcd")
    tracemalloc.start()  # sees msgspec's allocations (a 8 MiB bytes field peaks at 8 MiB)
    try:
        assert "length <= 4194304 - at `$.response`" in _refused(over)
        assert "truncated" in _refused(within)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_wire_error_is_a_transport_error():
    assert issubclass(wire.WireError, TransportError)


# ---------------------------------------------------------------- timings
def _time(fn: Callable[[], Any], n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


if __name__ == "__main__":
    sample = make_sample()
    payload = wire.encode(sample)
    enc = _time(lambda: wire.encode(sample), 20_000)
    dec = _time(lambda: wire.decode(payload, source=SOURCE), 20_000)
    print(f"sample (P=64, R=256, {len(payload)} B): encode {enc:.2f} us + decode {dec:.2f} us")
    pickled = pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
    pkl = _time(lambda: pickle.loads(pickle.dumps(sample, protocol=5)), 20_000)
    print(f"for comparison, pickle round trip of the sample ({len(pickled)} B): {pkl:.2f} us")


# ---------------------------------------------------------------- episodes
def make_episode() -> Sample:
    """A multi-turn episode: 256 tokens, the environment's at 100..139 (version 7, as the
    turn before them), its outcome in the metadata."""
    s = make_sample()
    mask = np.ones(s.num_tokens, bool)
    mask[100:140] = False
    versions = np.repeat(np.int32([7, 8]), [140, s.num_tokens - 140])
    episode = {"return": 0.75, "correct": True, "format_ok": True, "answer": "42",
               "turns": 2, "tool_calls": 1, "tool_failures": 0, "malformed_calls": 0,
               "cut_turns": 0, "env_tokens": 40, "outcome": "done"}  # fmt: skip
    return dataclasses.replace(
        s,
        policy_mask=mask,
        token_versions=versions,
        logprobs=np.where(mask, s.logprobs, 0.0).astype(np.float32),
        metadata={**s.metadata, "episode": episode},
    )


def test_an_episode_crosses_the_wire_with_its_mask_and_outcome():
    sent = make_episode()
    got = wire.decode(wire.encode(sent), source=SOURCE)
    np.testing.assert_array_equal(got.policy_mask, sent.policy_mask)
    assert got.policy_mask.dtype == np.bool_
    assert got.metadata == {"episode": sent.metadata["episode"]}  # the problem's: looked up
    np.testing.assert_array_equal(got.versions(), sent.versions())
    assert (got.oldest_version, got.newest_version) == (7, 8)
    plain = wire.decode(wire.encode(make_sample()), source=SOURCE)
    assert plain.policy_mask is None and plain.metadata == {}
    # An episode of one turn without the environment's tokens (an agent's answer at
    # once: no mask, every token the policy's) crosses with an all-policy mask.
    one_turn = make_episode()
    episode = {**one_turn.metadata["episode"], "turns": 1, "tool_calls": 0, "env_tokens": 0}
    one_turn = dataclasses.replace(make_sample(), policy_mask=None, metadata={"episode": episode})
    got = wire.decode(wire.encode(one_turn), source=SOURCE)
    assert got.policy_mask.all() and got.metadata == {"episode": episode}


def test_a_multi_agent_seat_crosses_with_its_role_and_turn_graph_and_an_unacted_one_masked():
    # pipeline/rollouts/multi_agent.py: a seat's role and the episode's turn graph cross
    # beside its outcome; a role that never acted crosses masked (no turn, no policy token).
    graph = [
        {"turn": 0, "role": "solver", "version": 7, "tokens": 100, "policy_tokens": 100},
        {"turn": 1, "role": "verifier", "version": 8, "tokens": 9, "policy_tokens": 9},
    ]
    seat = make_episode()
    seat = dataclasses.replace(
        seat, metadata={**seat.metadata, "role": "solver", "turn_graph": graph}
    )
    got = wire.decode(wire.encode(seat), source=SOURCE)
    assert got.metadata == {"episode": seat.metadata["episode"], "role": "solver",
                            "turn_graph": graph}  # fmt: skip
    s = make_sample()
    unacted = {**seat.metadata["episode"], "turns": 0, "tool_calls": 0, "outcome": "unacted"}
    unacted |= {"env_tokens": s.num_tokens, "masked": "never acted"}
    stand_in = dataclasses.replace(
        s,
        policy_mask=np.zeros(s.num_tokens, bool),
        metadata={"episode": unacted, "role": "verifier"},
    )
    got = wire.decode(wire.encode(stand_in), source=SOURCE)
    assert got.metadata == {"episode": unacted, "role": "verifier"} and not got.policy_mask.any()
    # a masked seat with a policy token, or an unmasked one without a turn: refused
    sneaky = dataclasses.replace(stand_in, policy_mask=np.ones(s.num_tokens, bool))
    assert "a masked seat is one that never acted" in _refused(wire.encode(sneaky))
    acted = make_episode()
    lying = {**acted.metadata["episode"], "outcome": "unacted"}
    bare = dataclasses.replace(acted, metadata={"episode": lying})
    assert "a masked seat is one that never acted" in _refused(wire.encode(bare))


HOSTILE_EPISODES = {
    "mask values": (_set("policy_mask", bytes([1] * 255 + [2])), "one 0/1 per response token"),
    "mask short": (_set("policy_mask", bytes([1] * 255)), "one 0/1 per response token"),
    "mask ends on the environment": (
        _set("policy_mask", bytes([1] * 255 + [0])),
        "end on a policy token",
    ),
    "outcome without mask": (_set("policy_mask", None), "$.episode without $.policy_mask"),
    "env tokens disagree": (_set("episode.env_tokens", 3), "$.episode.env_tokens is 3"),
    "return not finite": (_set("episode.ret", float("nan")), "a non-finite return"),
    "negative count": (_set("episode.tool_calls", -1), "a negative count"),
    "no turn": (_set("episode.turns", 0), "no turn"),
    "unknown outcome": (_set("episode.outcome", "won"), "at `$.episode.outcome`"),
    "answer too long": (_set("episode.answer", "x" * 4097), "at `$.episode.answer`"),
    "unknown field": (_set("episode.secret", 1), "unknown field `secret`"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_EPISODES))
def test_decode_refuses_a_tampered_episode(name):
    change, expect = HOSTILE_EPISODES[name]
    assert expect in _refused(_tampered(make_episode(), change))


def make_top(k: int = 5) -> Sample:
    """`make_sample` with each token's k alternatives (`EngineConfig.top_logprobs`)."""
    s = make_sample()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 49152, (s.num_tokens, k), dtype=np.int32)
    ids[:3] = -1  # a continuation's tokens: none
    lp = np.sort(-rng.exponential(size=(s.num_tokens, k)).astype(np.float32), axis=1)[:, ::-1]
    lp[:3] = -np.inf
    return dataclasses.replace(s, top_ids=ids, top_logprobs=lp)


def test_top_logprobs_cross_the_wire_bit_exact():
    sent = make_top()
    got = wire.decode(wire.encode(sent), source=SOURCE)
    assert got.top_ids.dtype == np.int32 and got.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(got.top_ids, sent.top_ids)
    assert got.top_logprobs.tobytes() == np.ascontiguousarray(sent.top_logprobs).tobytes()
    with pytest.raises(ValueError, match=r"int32 and float32 \[256, k\]"):
        wire.encode(dataclasses.replace(sent, top_ids=sent.top_ids[:-1]))
    with pytest.raises(ValueError, match="got int32.* and NoneType"):
        wire.encode(dataclasses.replace(sent, top_logprobs=None))
    with pytest.raises(ValueError, match=r"1 <= k <= 64"):
        wire.encode(make_top(k=65))


@pytest.mark.parametrize(
    "change, expect",
    [
        (_set("top.ids", b"\0" * 4 * 255 * 5), "$.top has 5100 and 5120 bytes"),
        (_set("top.k", 4), "256 tokens x 4 alternatives need 4096 each"),
        (_set("top.k", 65), "`int` <= 64 - at `$.top.k`"),
        (_set("top.k", 0), "`int` >= 1 - at `$.top.k`"),
        (_set("top.logprobs", [0.0]), "got `array` - at `$.top.logprobs`"),
        (_set("top.extra", 1), "unknown field `extra`"),
    ],
)
def test_decode_refuses_tampered_top_logprobs(change, expect):
    assert expect in _refused(_tampered(make_top(), change))
