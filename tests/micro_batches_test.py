"""Packing complete groups into a trainer micro-batch: gate, group advantages, stats."""

import collections
import dataclasses

import numpy as np
import pytest

from streamrl_jax.config import PipelineSection
from streamrl_jax.generation.types import RequestTag, Sample, Timings
from streamrl_jax.pipeline.micro_batches import Scored, check_prompts, pack_groups
from streamrl_jax.pipeline.schedules import Schedule, StaleSampleError, VersionGate
from streamrl_jax.rewards.base import RewardResult


def _scored(group, member, score, version=0, length=3):
    sample = Sample(
        request_id=f"{group}/{member}",
        prompt=np.arange(1, 5, dtype=np.int32),
        response=np.full(length, 7, np.int32),
        logprobs=np.full(length, -0.5, np.float32),
        sampling_logprobs=np.full(length, -0.5, np.float32),
        finish_reason="stop",
        policy_version=version,
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
        tag=RequestTag(batch=0, group=group, member=member),
    )
    reward = RewardResult(score=score, correct=score >= 1, extracted_answer=None, format_ok=True)
    return Scored(sample, "text", reward)


def _pack(groups, gate, stats, shared_prompt=False, pack=False, seq_buckets=(16,), **kwargs):
    return pack_groups(
        2,
        groups,
        gate=gate,
        advantage="grpo",
        seq_buckets=seq_buckets,
        batch_buckets=(1, 8),
        shared_prompt=shared_prompt,
        pack=pack,
        loss_chunk=128,
        pad_id=0,
        stats=stats,
        **kwargs,
    )


def _sync_gate() -> VersionGate:
    return VersionGate(Schedule.from_config(PipelineSection(mode="stream_sync")), strict=False)


def _stats() -> dict[str, list]:
    return {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}


def _two_groups():
    """Group 0 rewards (1, 0); group 1 a tie (0.5, 0.5); all under W_2."""
    return [
        [_scored(0, 0, 1.0, version=2), _scored(0, 1, 0.0, version=2)],
        [_scored(1, 0, 0.5, version=2), _scored(1, 1, 0.5, version=2)],
    ]


def test_group_relative_advantages_and_stats():
    gate = _sync_gate()
    groups = _two_groups()
    stats = _stats()
    batch = _pack(groups, gate, stats)
    adv_per_row = batch.advantages.max(axis=1) + batch.advantages.min(axis=1)
    # Group 0: rewards (1, 0) -> advantages of equal size and opposite sign; group 1: tie -> 0.
    assert adv_per_row[0] > 0 > adv_per_row[1]
    np.testing.assert_allclose(adv_per_row[0], -adv_per_row[1], rtol=1e-5)
    np.testing.assert_allclose(adv_per_row[2:4], 0.0)
    assert batch.tokens.shape == (8, 16) and batch.loss_mask[:4].sum() == 12
    assert stats["reward"] == [1.0, 0.0, 0.5, 0.5] and stats["versions"] == [2, 2, 2, 2]


def test_stale_groups_are_dropped_and_counted():
    gate = _sync_gate()
    stats = _stats()
    stale = [[_scored(0, 0, 1.0, version=1), _scored(0, 1, 0.0, version=2)]]
    assert _pack(stale, gate, stats) is None
    assert gate.dropped == 1 and stats["reward"] == []


def test_shared_prompt_packed_groups_keep_the_advantages():
    # The trainer's default layout: each group's prompt once, both groups in one row.
    gate = _sync_gate()
    groups = _two_groups()
    stats = _stats()
    plain = _pack(groups, gate, dict(stats))
    packed = _pack(groups, gate, stats, shared_prompt=True, pack=True, seq_buckets=(16, 32))
    # Per group: (4 - 1) + 2 * (3 + 1) = 11 columns; both in one 32-column row.
    assert packed.tokens.shape == (1, 32) and packed.attention_mask.sum() == 22
    assert packed.loss_mask.sum() == plain.loss_mask.sum() == 12
    adv = packed.advantages[packed.loss_mask]
    np.testing.assert_array_equal(adv, plain.advantages[plain.loss_mask])
    np.testing.assert_array_equal(packed.group_ids[0, :22], [0] * 11 + [1] * 11)


def _spanning(group, member, versions, score):
    """A sample whose tokens came from several versions (in-flight weight updates)."""
    s = _scored(group, member, score, version=versions[0], length=len(versions))
    logprobs = -0.1 * np.arange(1, len(versions) + 1, dtype=np.float32)
    sample = dataclasses.replace(
        s.sample,
        logprobs=logprobs,
        last_policy_version=versions[-1],
        token_versions=np.asarray(versions, np.int32),
    )
    return Scored(sample, s.text, s.reward)


def test_lag_is_counted_from_the_oldest_token_and_bounded_by_max_lag():
    p = PipelineSection(mode="stream_async", staleness=1, max_lag=2, weight_update="inflight")
    gate = VersionGate(Schedule.from_config(p), strict=False)
    ok = [_spanning(0, 0, [0, 0, 1, 2], 1.0), _spanning(0, 1, [1, 2, 2, 2], 0.0)]
    too_old = [_spanning(1, 0, [-1, 0, 1, 2], 1.0), _spanning(1, 1, [2, 2, 2, 2], 0.0)]
    too_new = [_spanning(2, 0, [1, 2, 3, 3], 1.0), _spanning(2, 1, [2, 2, 2, 2], 0.0)]
    stats = collections.defaultdict(list)
    batch = _pack([ok, too_old, too_new], gate, stats)  # trained at step 2
    # Step 2 admits token versions 0..2: the group with a version -1 token (lag 3) and
    # the one with a version 3 token are dropped whole and counted per sample.
    assert gate.dropped == 2
    assert stats["versions"] == [0, 1] and stats["spans"] == [1.0, 1.0]
    # Each response token keeps the behaviour log-prob it was sampled with, whichever
    # version sampled it (the PPO/TIS ratio is per token).
    rows = batch.loss_mask.sum(axis=1) > 0
    np.testing.assert_allclose(
        batch.behaviour_logp[rows][batch.loss_mask[rows]],
        np.concatenate([s.sample.logprobs for s in ok]),
    )
    message = r"versions -1\.\.2; step 2 .* accepts versions 0\.\.2"
    with pytest.raises(StaleSampleError, match=message):
        _pack([too_old], VersionGate(Schedule.from_config(p), strict=True), stats)


def _of(batch, group, prompt_id):
    s = _scored(group, 0, 0.0)
    tag = RequestTag(batch=batch, group=group, member=0, prompt_id=prompt_id)
    return [Scored(dataclasses.replace(s.sample, tag=tag), s.text, s.reward)]


def test_check_prompts_checks_each_group_against_its_own_batch():
    # Several processes: the trainer's own draw of each batch. Partial rollout trains
    # groups of earlier batches at a step, so each is checked against its batch's draw.
    drawn = {2: ["a", "b"], 3: ["c", "d"]}
    check_prompts([_of(3, 1, "d"), _of(2, 0, "a"), _of(2, 1, "b")], drawn)
    with pytest.raises(RuntimeError, match=r"batch 2 group 1: generated for prompt d, .* drew b"):
        check_prompts([_of(2, 1, "d")], drawn)
    with pytest.raises(RuntimeError, match="batch 0 group 0: .* drew a batch it no longer keeps"):
        check_prompts([_of(0, 0, "a")], drawn)
