"""Packing complete groups into a trainer micro-batch: gate, group advantages, stats."""

import collections
import dataclasses

import numpy as np
import pytest
from support import pack_small, scored_sample, sync_gate

from streamrl_jax.config import PipelineSection
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.schedules import Schedule, StaleSampleError, VersionGate


def _stats() -> dict[str, list]:
    return {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}


def _two_groups():
    """Group 0 rewards (1, 0); group 1 a tie (0.5, 0.5); all under W_2."""
    return [
        [scored_sample(0, 0, 1.0, version=2), scored_sample(0, 1, 0.0, version=2)],
        [scored_sample(1, 0, 0.5, version=2), scored_sample(1, 1, 0.5, version=2)],
    ]


def test_group_relative_advantages_and_stats():
    gate = sync_gate()
    groups = _two_groups()
    stats = _stats()
    batch = pack_small(groups, gate, stats)
    adv_per_row = batch.advantages.max(axis=1) + batch.advantages.min(axis=1)
    # Group 0: rewards (1, 0) -> advantages of equal size and opposite sign; group 1: tie -> 0.
    assert adv_per_row[0] > 0 > adv_per_row[1]
    np.testing.assert_allclose(adv_per_row[0], -adv_per_row[1], rtol=1e-5)
    np.testing.assert_allclose(adv_per_row[2:4], 0.0)
    assert batch.tokens.shape == (8, 16) and batch.loss_mask[:4].sum() == 12
    assert stats["reward"] == [1.0, 0.0, 0.5, 0.5] and stats["versions"] == [2, 2, 2, 2]


def test_stale_groups_are_dropped_and_counted():
    gate = sync_gate()
    stats = _stats()
    stale = [[scored_sample(0, 0, 1.0, version=1), scored_sample(0, 1, 0.0, version=2)]]
    assert pack_small(stale, gate, stats) is None
    assert gate.dropped == 1 and stats["reward"] == []


def test_shared_prompt_packed_groups_keep_the_advantages():
    # The trainer's default layout: each group's prompt once, both groups in one row.
    gate = sync_gate()
    groups = _two_groups()
    stats = _stats()
    plain = pack_small(groups, gate, dict(stats))
    packed = pack_small(groups, gate, stats, shared_prompt=True, pack=True, seq_buckets=(16, 32))
    # Per group: (4 - 1) + 2 * (3 + 1) = 11 columns; both in one 32-column row.
    assert packed.tokens.shape == (1, 32) and packed.attention_mask.sum() == 22
    assert packed.loss_mask.sum() == plain.loss_mask.sum() == 12
    adv = packed.advantages[packed.loss_mask]
    np.testing.assert_array_equal(adv, plain.advantages[plain.loss_mask])
    np.testing.assert_array_equal(packed.group_ids[0, :22], [0] * 11 + [1] * 11)


def _spanning(group, member, versions, score):
    """A sample whose tokens came from several versions (in-flight weight updates)."""
    s = scored_sample(group, member, score, version=versions[0], length=len(versions))
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
    batch = pack_small([ok, too_old, too_new], gate, stats)  # trained at step 2
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
        pack_small([too_old], VersionGate(Schedule.from_config(p), strict=True), stats)
