"""Partial rollout (pipeline/rollouts/partial.py), host only, on a fake stream: rounds,
continuations, round closure, the lag policies, the checkpoint's JSON of the work in
flight, the trainer's micro-batches of a round, and the trainer's half across processes
(`RemoteRounds`: the generation processes' round reports)."""

import dataclasses
import json
import os
import threading

import numpy as np
import pytest
from support import group_of_scores, rollout_context

from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import (
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.pipeline.rollouts import make_rollout
from streamrl_jax.pipeline.rollouts.partial import (
    PartialRollout,
    RemoteRounds,
    from_json,
    make,
    to_json,
)
from streamrl_jax.stream.sample_stream import StreamError

PARTIAL = dict(
    mode="stream_async", rollout="partial", group_size=2, partial_budget_tokens=4, max_lag=2
)


def _rollout(**kw):
    return PartialRollout(rollout_context(**PARTIAL, **kw))


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
    out, now, *_ = ro.returned(_back(a, 3, 0, "stop"))  # finished within the budget
    assert out is not None and now == []
    out, now, *_ = ro.returned(_back(b, 4, 0, "paused"))  # round 1 not open: it waits
    assert out is None and now == []
    assert ro.wait_round(0, timeout=1) == []  # round 0 closed, nothing completed in it
    (c,) = ro.open(1, [])  # round 1 holds the continuation, same request otherwise
    assert c.continuation is not None and len(c.continuation.tokens) == 4
    assert (c.seed, c.sampling, c.tag.round, c.segment_tokens) == (b.seed, b.sampling, 1, 4)
    with pytest.raises(TimeoutError, match=r"round 1 not closed .* \{1: 1\}"):
        ro.wait_round(1, timeout=0.01)
    out, _, *_ = ro.returned(_back(c, 7, 1, "stop"))
    np.testing.assert_array_equal(out.versions(), [0] * 4 + [1] * 3)
    assert ro.wait_round(1, timeout=1) == [(0, 0)]  # the group completed in round 1


def test_a_continuation_joins_an_open_round_at_once():
    ro = _rollout()
    (a, b), _ = ro.open(0, _requests(0)), ro.open(1, [])
    ro.returned(_back(a, 2, 0, "stop"))
    out, (c,), *_ = ro.returned(_back(b, 4, 0, "paused"))
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
    out, now, *_ = ro.returned(_back(b2, 12 - 1, 1, "paused"))
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
    saved = json.loads(json.dumps(ro.state(1)))  # what the checkpoint's metadata holds
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


def test_the_trainer_takes_the_rounds_groups_in_micro_batches():
    # Round 0 completed groups (0, 0) and (0, 1); the trainer takes them once scored,
    # deterministic: in (batch, group) order, members in member order.
    ro = _rollout(deterministic=True, micro_batch_groups=1)
    a, b, c, d = ro.open(0, _requests(0, groups=2))
    for q in (a, b, c, d):
        ro.returned(_back(q, 3, 0, "stop"))
    for g in (1, 0):
        for s in reversed(group_of_scores(0, g, [0.0, 1.0])):
            ro.scored(s)
    batches = list(ro.micro_batches(0, 0))
    assert [[(x.sample.tag.group, x.sample.tag.member) for x in g] for [g] in batches] == [
        [(0, 0), (0, 1)],
        [(1, 0), (1, 1)],
    ]
    assert ro.finish(0).metrics == {
        "carried_paused": 0.0,
        "carried_members": 0.0,
        "regenerated": 0.0,
        "dropped_lag": 0.0,
    }
    assert ro.plannable(3, 10) == range(3, 11)  # up to staleness (1) batches ahead


def test_a_failure_wakes_the_trainer_waiting_for_a_round():
    ro = _rollout()
    ro.open(0, _requests(0))
    ro.fail(RuntimeError("engine died"))
    with pytest.raises(StreamError, match="engine died"):
        ro.wait_round(0, timeout=30)


def test_carried_work_restored_after_its_round_opened_is_refused_not_lost():
    # A resumed generation process restores before its driver opens round k: restored
    # after, the continuations would wait for a round that already took its requests, and
    # the round would close (and train) without them.
    ro = _rollout()
    a, b = ro.open(0, _requests(0, groups=1))
    ro.returned(_back(a, 4, 0, "paused"))
    ro.returned(_back(b, 4, 0, "paused"))
    saved = json.loads(json.dumps(ro.state(1)))
    fresh = _rollout()
    fresh.open(1, _requests(1, groups=1))
    with pytest.raises(RuntimeError, match="carried into round 1 restored after the round"):
        fresh.restore(1, saved)


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
    saved = json.loads(json.dumps(ro.state(1)))
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


# ------------------------------------------------------------------ RemoteRounds


def _report(process, r, groups=(), **counts):
    fields = dict(paused=0, waiting_members=0, regenerated=0, dropped=0) | counts
    return RoundClosed(process, r, tuple(groups), **fields)


def _remote(processes=(0, 1)):
    ctx = rollout_context(**PARTIAL, prompts_per_step=4)
    return make(dataclasses.replace(ctx, where="trainer", generation_processes=processes))


def test_the_registry_gives_the_trainer_its_half_across_processes():
    assert isinstance(_remote(), RemoteRounds)
    assert isinstance(make(rollout_context(**PARTIAL)), PartialRollout)


def test_a_round_closes_once_every_process_reported_it():
    rr = _remote()
    rr.restore(0, {})
    rr.report(_report(0, 0, [(0, 1)], paused=2))
    with pytest.raises(TimeoutError, match=r"round 0 not reported closed .* processes \[1\]"):
        rr.wait_round(0)  # one process missing
    rr.report(_report(1, 0, [(0, 0)], paused=1, regenerated=3))
    assert rr.wait_round(0) == [(0, 0), (0, 1)]
    assert rr.finish(0).metrics == {
        "carried_paused": 3.0,
        "carried_members": 0.0,
        "regenerated": 3.0,
        "dropped_lag": 0.0,
    }


def test_a_waiting_trainer_wakes_on_the_last_report_and_on_failure():
    rr = _remote(processes=(0,))
    got = []
    thread = threading.Thread(target=lambda: got.append(rr.wait_round(0)))
    thread.start()
    rr.report(_report(0, 0, [(0, 2)]))
    thread.join(5)
    assert got == [[(0, 2)]]
    rr.fail(RuntimeError("generation-0 lost"))
    with pytest.raises(StreamError, match="generation-0 lost"):
        rr.wait_round(1)


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (_report(7, 0), "generation-7, which is not generating"),
        (_report(0, 1), "reported round 1; expected round 0"),
        (_report(0, 0, [(1, 0)]), r"group \(1, 0\) complete in round 0"),
        (_report(0, 0, [(0, 4)]), r"groups 0..3"),
    ],
)
def test_a_report_that_cannot_be_right_is_refused_naming_the_process(report, message):
    with pytest.raises(TransportError, match=message):
        _remote().report(report)


def test_a_report_repeated_is_refused():
    rr = _remote()
    rr.report(_report(0, 0))
    with pytest.raises(TransportError, match="reported round 0; expected round 1"):
        rr.report(_report(0, 0))


def test_a_checkpoint_across_processes_names_the_shares_and_resumes_from_its_round():
    # The carried work is the generation processes' (processes/carried.py): the trainer's
    # checkpoint names who wrote it; a resumed trainer waits for reports of round k on.
    rr = _remote()
    assert rr.state(2) == {"carried_by": [0, 1]}
    assert rr.restore(2, {"carried_by": [0, 1]}) == []
    with pytest.raises(TransportError, match="reported round 0; expected round 2"):
        rr.report(_report(0, 0))
    rr.report(_report(0, 2))
    # A checkpoint one process saved holds its carried work itself, and the other way
    # round: each is refused by the other, by name.
    with pytest.raises(ValueError, match="one process saved it"):
        _remote().restore(2, {"paused": [], "finished": []})
    with pytest.raises(ValueError, match="saved across processes"):
        make(rollout_context(**PARTIAL)).restore(2, {"carried_by": [0]})


def test_kinds_without_rounds_refuse_a_round_report():
    full = make_rollout("full", rollout_context())
    with pytest.raises(TransportError, match="has no rounds"):
        full.report(_report(0, 0))


def test_the_carried_work_shares_read_back_merged_owned_and_pruned(tmp_path):
    # processes/carried.py: each generation process's share of the work carried into
    # round k, beside the checkpoints.
    from streamrl_jax.pipeline.processes import carried

    def entry(batch, group, rid):
        return {"request_id": rid, "tag": {"batch": batch, "group": group}}

    carried.write(str(tmp_path), 3, 0, {"paused": [entry(2, 0, "a")], "finished": []})
    share = {"paused": [entry(2, 1, "b")], "finished": [entry(1, 3, "c")]}
    carried.write(str(tmp_path), 3, 1, share | {"episodes": [["b", {"turns": 1}]]})
    merged = carried.read(str(tmp_path), 3, [0, 1])
    assert [x["request_id"] for x in merged["paused"]] == ["a", "b"]
    assert merged["episodes"] == [["b", {"turns": 1}]]
    odd = carried.owned(merged, lambda batch, group: group % 2 == 1)  # a new owner of 1, 3
    assert [x["request_id"] for x in odd["paused"] + odd["finished"]] == ["b", "c"]
    assert odd["episodes"] == [["b", {"turns": 1}]]
    even = carried.owned(merged, lambda batch, group: group % 2 == 0)
    assert even["episodes"] == [] and [x["request_id"] for x in even["paused"]] == ["a"]
    with pytest.raises(ValueError, match=r"generation-2's carried .*generation-2.json"):
        carried.read(str(tmp_path), 3, [0, 2])  # a share that is not there
    (tmp_path / "carried" / "3" / "generation-1.json").write_text('{"paused": 1}')
    with pytest.raises(ValueError, match="generation-1.json is not a carried-work file"):
        carried.read(str(tmp_path), 3, [1])
    # Pruning keeps the checkpoint.keep newest multiples of every and the recent rounds.
    for k in range(1, 11):
        carried.write(str(tmp_path), k, 0, {"paused": [], "finished": []})
    carried.prune(str(tmp_path), 0, 10, every=2, keep=2, recent=3)
    kept = sorted(int(k) for k in os.listdir(tmp_path / "carried"))
    assert kept == [3, 8, 9, 10]  # 3: process 1's share is still there
    assert not (tmp_path / "carried" / "3" / "generation-0.json").exists()
