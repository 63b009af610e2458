"""Partial rollout bookkeeping (pipeline/rollout.py), host only: rounds, continuations,
round closure, the lag policies and the checkpoint's JSON of the work in flight."""

import json

import numpy as np
import pytest

from streamrl_jax.config import PipelineSection
from streamrl_jax.generation.types import (
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.pipeline.rollout import PartialRollout, from_json, to_json
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.stream.sample_stream import StreamError


def _rollout(**kw):
    p = PipelineSection(mode="stream_async", group_size=2, partial_budget_tokens=4, max_lag=2, **kw)
    return PartialRollout(p, Schedule.from_config(p))


def _requests(batch, groups=1):
    return [
        GenerationRequest(
            request_id=f"{batch}/{g}/{m}",
            prompt=[1, 2, 3],
            max_new_tokens=12,
            sampling=SamplingParams(temperature=0.7, stop_ids=(5,)),
            seed=10 * g + m,
            tag=RequestTag(batch=batch, group=g, member=m, prompt_id=f"p{batch}.{g}"),
            metadata={"answer": "4"},
        )
        for g in range(groups)
        for m in range(2)
    ]


def _back(request, n, version, reason):
    """What the engine returns for a segment: n tokens in all, the new ones of `version`."""
    c = request.continuation
    old = 0 if c is None else len(c.tokens)
    versions = np.concatenate([[] if c is None else c.versions, [version] * (n - old)])
    return Sample(
        request_id=request.request_id,
        prompt=np.asarray(request.prompt, np.int32),
        response=np.arange(n, dtype=np.int32) + 6,
        logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32),
        sampling_logprobs=np.zeros(n, np.float32),
        finish_reason=reason,
        policy_version=int(versions[0]),
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=1.0, finish=2.0),
        tag=request.tag,
        metadata=request.metadata,
        token_versions=versions.astype(np.int32),
    )


def test_a_paused_sample_continues_next_round_and_its_group_trains_when_complete():
    ro = _rollout()
    a, b = ro.open(0, _requests(0))
    assert a.segment_tokens == 4 and a.tag.round == 0
    out, now = ro.returned(_back(a, 3, 0, "stop"))  # finished within the budget
    assert out is not None and now == []
    out, now = ro.returned(_back(b, 4, 0, "paused"))  # round 1 not open: it waits
    assert out is None and now == []
    assert ro.wait_round(0, timeout=1) == []  # round 0 closed, nothing completed in it
    (c,) = ro.open(1, [])  # round 1 holds the continuation, same request otherwise
    assert c.continuation is not None and len(c.continuation.tokens) == 4
    assert (c.seed, c.sampling, c.tag.round, c.segment_tokens) == (b.seed, b.sampling, 1, 4)
    with pytest.raises(TimeoutError, match=r"round 1 not closed .* \{1: 1\}"):
        ro.wait_round(1, timeout=0.01)
    out, _ = ro.returned(_back(c, 7, 1, "stop"))
    np.testing.assert_array_equal(out.versions(), [0] * 4 + [1] * 3)
    assert ro.wait_round(1, timeout=1) == [(0, 0)]  # the group completed in round 1


def test_a_continuation_joins_an_open_round_at_once():
    ro = _rollout()
    (a, b), _ = ro.open(0, _requests(0)), ro.open(1, [])
    ro.returned(_back(a, 2, 0, "stop"))
    out, (c,) = ro.returned(_back(b, 4, 0, "paused"))
    assert out is None and c.tag.round == 1 and c.continuation is not None
    assert ro.wait_round(0, timeout=1) == []
    ro.returned(_back(c, 6, 1, "stop"))
    assert ro.wait_round(1, timeout=1) == [(0, 0)]


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_a_sample_that_would_pass_max_lag_is_dropped_or_regenerated(policy):
    ro = _rollout(lag_policy=policy)
    a, b = ro.open(0, _requests(0))
    ro.returned(_back(a, 2, 0, "stop"))
    # b pauses in rounds 0 and 1 (its oldest token, version 0, is trained at step 2 at
    # the earliest: lag 2 = max_lag) and again in round 2: step 3 would be lag 3.
    (b1,) = ro.returned(_back(b, 4, 0, "paused"))[1] or ro.open(1, [])
    (b2,) = ro.returned(_back(b1, 8, 0, "paused"))[1] or ro.open(2, [])
    assert ro.regenerated == ro.dropped == 0 and len(b2.continuation.tokens) == 8
    out, now = ro.returned(_back(b2, 12 - 1, 1, "paused"))
    if policy == "drop":  # handed on as it is: pack_groups drops its group (counted)
        assert out.finish_reason == "paused" and now == [] and ro.dropped == 1
        assert ro.wait_round(2, timeout=1) == [(0, 0)]  # the group completes (to be dropped)
    else:  # restarted from its prompt under newer weights, no continuation
        assert out is None and ro.regenerated == 1
        (again,) = ro.open(3, [])
        assert again.continuation is None and again.seed == b.seed and again.tag.round == 3


def test_the_work_in_flight_round_trips_through_json():
    ro = _rollout()
    a, b, c, d = ro.open(0, _requests(0, groups=2))
    ro.returned(_back(a, 2, 0, "stop"))  # group 0: one member finished ...
    ro.returned(_back(b, 4, 0, "paused"))  # ... one paused
    ro.returned(_back(c, 4, 0, "paused"))
    ro.returned(_back(d, 4, 0, "paused"))
    assert ro.wait_round(0, timeout=1) == []
    saved = json.loads(json.dumps(ro.snapshot(1)))  # what the checkpoint's metadata holds
    assert len(saved["paused"]) == 3 and len(saved["finished"]) == 1
    fresh = _rollout()
    (member,) = fresh.restore(1, saved)
    assert member.request_id == a.request_id and member.finish_reason == "stop"
    conts = fresh.open(1, [])
    first = {q.request_id: q for q in (a, b, c, d)}
    for q in conts:
        want = first[q.request_id]
        assert (q.seed, q.sampling, q.max_new_tokens) == (want.seed, want.sampling, 12)
        assert q.continuation.tokens.tolist() == [6, 7, 8, 9] and q.tag.round == 1
    sample, _ = from_json(to_json(_back(a, 3, 0, "stop"), None))
    again = _back(a, 3, 0, "stop")
    np.testing.assert_array_equal(sample.logprobs, again.logprobs)  # float32 exactly
    assert sample.tag == again.tag and sample.metadata == again.metadata
    # the finished member completes its group with its sibling's continuation
    (cb,) = [q for q in conts if q.request_id == b.request_id]
    fresh.returned(_back(cb, 6, 1, "stop"))
    for q in conts:
        if q is not cb:
            fresh.returned(_back(q, 6, 1, "stop"))
    assert fresh.wait_round(1, timeout=1) == [(0, 0), (0, 1)]


def test_a_failure_wakes_the_trainer_waiting_for_a_round():
    ro = _rollout()
    ro.open(0, _requests(0))
    ro.fail(RuntimeError("engine died"))
    with pytest.raises(StreamError, match="engine died"):
        ro.wait_round(0, timeout=30)


def test_the_snapshot_is_the_state_at_the_rounds_close_even_when_later_rounds_ran():
    # In flight, round 1 runs before round 0 closes: a continuation may finish first.
    # The checkpoint's view of round 1's start must not hold that later member (a resumed
    # run regenerates it) but must hold the paused sample it continued.
    ro = _rollout()
    a, b, c, d = ro.open(0, _requests(0, groups=2))
    ro.open(1, [])
    ro.returned(_back(a, 2, 0, "stop"))
    (b1,) = ro.returned(_back(b, 4, 0, "paused"))[1]
    ro.returned(_back(b1, 6, 1, "stop"))  # group 0 completes in round 1, round 0 still open
    ro.returned(_back(c, 3, 0, "stop"))
    (d1,) = ro.returned(_back(d, 4, 0, "paused"))[1]
    assert ro.wait_round(0, timeout=1) == []
    saved = json.loads(json.dumps(ro.snapshot(1)))
    assert sorted(x["request_id"] for x in saved["paused"]) == [b.request_id, d.request_id]
    assert sorted(x["request_id"] for x in saved["finished"]) == [a.request_id, c.request_id]
    ro.returned(_back(d1, 5, 1, "stop"))
    assert ro.wait_round(1, timeout=1) == [(0, 0), (0, 1)]
    # Resumed from the snapshot, round 1 gives the same groups.
    fresh = _rollout()
    fresh.restore(1, saved)
    for q in fresh.open(1, []):
        fresh.returned(_back(q, 6, 1, "stop"))
    assert fresh.wait_round(1, timeout=1) == [(0, 0), (0, 1)]
    assert fresh.in_flight() == {"paused": 0, "waiting_members": 0}
