"""Complete groups of scored samples → one trainer micro-batch (host side).

The trainer loop hands each set of complete GRPO groups here: the version gate
drops groups with a too-old sample, group-relative advantages are computed
over each complete group (so streaming arrival cannot change them), and the
samples are packed into a bucket-padded `TrainBatch`. Per-sample statistics
(reward, correctness, lengths, versions) are collected for the step's metrics.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from streamrl_jax import algorithms
from streamrl_jax.generation.types import Sample
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.schedule import VersionGate
from streamrl_jax.trainer.batch import TrainBatch, make_batch


@dataclasses.dataclass(frozen=True)
class Scored:
    """A finished sample with its decoded text and reward."""

    sample: Sample
    text: str
    reward: RewardResult


def group_advantages(
    advantage: str, rewards_B: np.ndarray, group_ids_B: np.ndarray, num_groups: int
) -> np.ndarray:
    """Per-sequence advantages f32[B] from the `algorithms.ADVANTAGES` entry `advantage`."""
    fn = algorithms.ADVANTAGES[advantage]
    put = jax.device_put  # explicit transfers: the loop runs under a transfer guard in tests
    mask = put(np.ones((len(rewards_B), 1), np.float32))
    adv = fn(put(rewards_B), mask, put(group_ids_B), num_groups=num_groups)
    return np.asarray(jax.device_get(adv))[:, 0]


def pack_groups(
    step: int,
    groups: list[list[Scored]],
    *,
    gate: VersionGate,
    advantage: str,
    seq_buckets: tuple[int, ...],
    batch_buckets: tuple[int, ...],
    pad_id: int,
    stats: dict[str, list],
) -> TrainBatch | None:
    """Host TrainBatch of the admitted groups (None if the gate dropped them all).

    Appends to `stats` lists: reward, correct, format_ok, length, truncated, versions.
    """
    kept = [
        g
        for g in groups
        if all([gate.admit(step, s.sample.policy_version, s.sample.request_id) for s in g])
    ]
    if not kept:
        return None
    samples = [s for g in kept for s in g]
    rewards = np.asarray([s.reward.score for s in samples], np.float32)
    group_ids = np.concatenate([np.full(len(g), i, np.int32) for i, g in enumerate(kept)])
    adv = group_advantages(advantage, rewards, group_ids, len(kept))
    stats["reward"] += list(rewards)
    stats["correct"] += [float(s.reward.correct) for s in samples]
    stats["format_ok"] += [float(s.reward.format_ok) for s in samples]
    stats["length"] += [len(s.sample.response) for s in samples]
    stats["truncated"] += [float(s.sample.finish_reason != "stop") for s in samples]
    stats["versions"] += [s.sample.policy_version for s in samples]
    return make_batch(
        [s.sample.prompt for s in samples],
        [s.sample.response for s in samples],
        behaviour_logp=[s.sample.logprobs for s in samples],
        advantages=adv,
        rewards=rewards,
        seq_buckets=seq_buckets,
        batch_buckets=batch_buckets,
        pad_id=pad_id,
    )
