"""Packing complete groups into a trainer micro-batch: gate, group advantages, stats."""

import numpy as np

from streamrl_jax.config import PipelineSection
from streamrl_jax.generation.types import RequestTag, Sample, Timings
from streamrl_jax.pipeline.micro_batches import Scored, pack_groups
from streamrl_jax.pipeline.schedules import Schedule, VersionGate
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


def _pack(groups, gate, stats, shared_prompt=False, pack=False, seq_buckets=(16,)):
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
    )


def test_group_relative_advantages_and_stats():
    gate = VersionGate(Schedule.from_config(PipelineSection(mode="stream_sync")), strict=False)
    groups = [
        [_scored(0, 0, 1.0, version=2), _scored(0, 1, 0.0, version=2)],
        [_scored(1, 0, 0.5, version=2), _scored(1, 1, 0.5, version=2)],
    ]
    stats = {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}
    batch = _pack(groups, gate, stats)
    adv_per_row = batch.advantages.max(axis=1) + batch.advantages.min(axis=1)
    # Group 0: rewards (1, 0) -> advantages of equal size and opposite sign; group 1: tie -> 0.
    assert adv_per_row[0] > 0 > adv_per_row[1]
    np.testing.assert_allclose(adv_per_row[0], -adv_per_row[1], rtol=1e-5)
    np.testing.assert_allclose(adv_per_row[2:4], 0.0)
    assert batch.tokens.shape == (8, 16) and batch.loss_mask[:4].sum() == 12
    assert stats["reward"] == [1.0, 0.0, 0.5, 0.5] and stats["versions"] == [2, 2, 2, 2]


def test_stale_groups_are_dropped_and_counted():
    gate = VersionGate(Schedule.from_config(PipelineSection(mode="stream_sync")), strict=False)
    stats = {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}
    stale = [[_scored(0, 0, 1.0, version=1), _scored(0, 1, 0.0, version=2)]]
    assert _pack(stale, gate, stats) is None
    assert gate.dropped == 1 and stats["reward"] == []


def test_shared_prompt_packed_groups_keep_the_advantages():
    # The trainer's default layout: each group's prompt once, both groups in one row.
    gate = VersionGate(Schedule.from_config(PipelineSection(mode="stream_sync")), strict=False)
    groups = [
        [_scored(0, 0, 1.0, version=2), _scored(0, 1, 0.0, version=2)],
        [_scored(1, 0, 0.5, version=2), _scored(1, 1, 0.5, version=2)],
    ]
    stats = {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}
    plain = _pack(groups, gate, dict(stats))
    packed = _pack(groups, gate, stats, shared_prompt=True, pack=True, seq_buckets=(16, 32))
    # Per group: (4 - 1) + 2 * (3 + 1) = 11 columns; both in one 32-column row.
    assert packed.tokens.shape == (1, 32) and packed.attention_mask.sum() == 22
    assert packed.loss_mask.sum() == plain.loss_mask.sum() == 12
    adv = packed.advantages[packed.loss_mask]
    np.testing.assert_array_equal(adv, plain.advantages[plain.loss_mask])
    np.testing.assert_array_equal(packed.group_ids[0, :22], [0] * 11 + [1] * 11)
