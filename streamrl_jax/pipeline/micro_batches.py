"""Micro-batches: complete groups taken from the stream, packed for the device.

* `Scored`: a finished sample with its text and reward; a `Group` is the scored
  samples of one GRPO group.
* `GroupTaker`: the ways a rollout (`rollouts/`) takes complete groups from the
  sample stream: the next ones of a batch, exactly the indexed ones, or by key,
  parking what it took early (stream_async may deliver a later batch's groups
  first). Which groups a step's micro-batches hold is the rollout's decision.
* `pack_groups` gates the groups (version contract), computes group-relative
  advantages over each complete group (so arrival order cannot change them;
  with `advantage="gae"` the critic fills them on the device instead) and
  packs the samples into a bucket-padded `TrainBatch` in the trainer's layout
  (`trainer.shared_prompt`: a group's prompt once, then its responses;
  `trainer.pack`: several groups per row), collecting the step's per-sample
  statistics. The layout changes no gradient (trainer/batch.py), and a group
  never splits across micro-batches, so streaming stays exact.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from streamrl_jax import algorithms
from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.generation.types import Sample
from streamrl_jax.model import routes as routes_lib
from streamrl_jax.pipeline.schedules import VersionGate
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.stream.sample_stream import SampleStream, StreamTimeout
from streamrl_jax.trainer.batch import TrainBatch, make_batch


@dataclasses.dataclass(frozen=True)
class Scored:
    """A finished sample with its decoded text and reward."""

    sample: Sample
    text: str
    reward: RewardResult


Group = list[Scored]


def group_key(s: Scored) -> tuple[int, int]:
    """The sample stream's grouping: (batch, group) of the sample's tag."""
    return s.sample.tag.batch, s.sample.tag.group


def group_advantages(
    advantage: str, rewards_B: np.ndarray, group_ids_B: np.ndarray, num_groups: int
) -> np.ndarray:
    """Per-sequence advantages f32[B] from the `algorithms.ADVANTAGES` entry `advantage`."""
    fn = algorithms.ADVANTAGES[advantage]
    put = jax.device_put  # explicit transfers: the loop runs under a transfer guard in tests
    mask = put(np.ones((len(rewards_B), 1), np.float32))
    adv = fn(put(rewards_B), mask, put(group_ids_B), num_groups=num_groups)
    return np.asarray(jax.device_get(adv))[:, 0]


def length_penalties(samples: list[Scored], overlong: OverlongPenalty | None) -> np.ndarray:
    """Each sample's soft overlong penalty f32[B] (zeros when it is off)."""
    if overlong is None:
        return np.zeros(len(samples), np.float32)
    lengths = [len(s.sample.response) for s in samples]
    return overlong(lengths, [s.sample.finish_reason != "stop" for s in samples])


def shaped_rewards(samples: list[Scored], overlong: OverlongPenalty | None) -> np.ndarray:
    """The rewards the advantages see, f32[B]: outcome score plus the overlong penalty."""
    scores = np.asarray([s.reward.score for s in samples], np.float32)
    return scores + length_penalties(samples, overlong)


def pack_groups(
    step: int,
    groups: list[Group],
    *,
    gate: VersionGate,
    advantage: str,
    seq_buckets: tuple[int, ...],
    batch_buckets: tuple[int, ...],
    shared_prompt: bool,
    pack: bool,
    loss_chunk: int,
    pad_id: int,
    stats: dict[str, list],
    overlong: OverlongPenalty | None = None,
    routing_replay: routes_lib.Spec | None = None,
) -> TrainBatch | None:
    """Host TrainBatch of the admitted groups (None if the gate dropped them all).

    The buckets, `shared_prompt`, `pack`, `loss_chunk` and `routing_replay` (the
    samples' routes go into the batch, checked) are the trainer's
    (`TrainerConfig.layout`).
    Appends to `stats` lists: reward, correct, format_ok, length, truncated, versions (each
    sample's oldest token version) and spans (1 for a sample whose tokens span versions).
    `advantage="gae"` leaves the advantages at 0 (the critic fills them on device).
    `overlong` (DAPO's soft overlong punishment) is added to each outcome score before
    the advantages (`shaped_rewards`); `stats["overlong_penalty"]` gets each sample's term.
    A masked sample (a judge's failure: `RewardResult.masked`) is dropped from its group
    after the gate; a group left empty is dropped. A multi-agent group is one group per
    role (`by_role`).
    """

    def admit(s: Scored) -> bool:
        x = s.sample
        if x.finish_reason == "paused":  # partial rollout: past max_lag, lag_policy="drop"
            return gate.refuse(step, x.oldest_version, x.request_id, "a paused partial sample")
        return gate.admit(step, x.oldest_version, x.request_id, x.newest_version)

    kept = [g for g in groups if all([admit(s) for s in g])]
    # A sample a reward model could not score (`RewardResult.masked`) is left out of its
    # group's statistics and the loss, as if it had never been generated.
    kept = [g2 for g in kept if (g2 := [s for s in g if s.reward.masked is None])]
    # A multi-agent group holds a seat of each role per episode: each role's samples are
    # compared among themselves (`by_role`).
    kept = [sub for g in kept for sub in by_role(g)]
    if not kept:
        return None
    samples = [s for g in kept for s in g]
    scores = np.asarray([s.reward.score for s in samples], np.float32)
    penalties = length_penalties(samples, overlong)
    rewards = scores + penalties
    if advantage == "gae":
        adv = np.zeros_like(rewards)
    else:
        local = np.concatenate([np.full(len(g), i, np.int32) for i, g in enumerate(kept)])
        adv = group_advantages(advantage, rewards, local, len(kept))
    stats["reward"] += list(scores)  # the outcome score; the penalty has its own metric
    stats.setdefault("overlong_penalty", []).extend(penalties.tolist())
    stats["correct"] += [float(s.reward.correct) for s in samples]
    stats["format_ok"] += [float(s.reward.format_ok) for s in samples]
    stats["length"] += [len(s.sample.response) for s in samples]
    stats["truncated"] += [float(s.sample.finish_reason != "stop") for s in samples]
    # The oldest token's version: staleness = lag = step - this (DESIGN.md §2, §6).
    stats["versions"] += [s.sample.oldest_version for s in samples]
    spans = [float(s.sample.newest_version > s.sample.oldest_version) for s in samples]
    stats.setdefault("spans", []).extend(spans)
    return make_batch(
        [s.sample.prompt for s in samples],
        [s.sample.response for s in samples],
        behaviour_logp=[s.sample.logprobs for s in samples],
        advantages=adv,
        rewards=rewards,
        group_ids=_group_ids(kept),
        policy_masks=[s.sample.policy_mask for s in samples],
        routes=None if routing_replay is None else [s.sample.routes for s in samples],
        routing_replay=routing_replay,
        seq_buckets=seq_buckets,
        batch_buckets=batch_buckets,
        shared_prompt=shared_prompt,
        pack=pack,
        loss_chunk=loss_chunk,
        pad_id=pad_id,
    )


def by_role(group: Group) -> list[Group]:
    """A group as one group per role of a multi-agent episode (`metadata["role"]`,
    `rollouts/multi_agent.py`), each in member order, roles in first-seen order; a group
    without roles as itself."""
    roles: dict[Any, Group] = {}
    for s in group:
        roles.setdefault(s.sample.metadata.get("role"), []).append(s)
    return list(roles.values())


def _group_ids(groups: list[Group]) -> list[int]:
    """Per sample, its group's id, unique in the micro-batch: the group index in its
    batch, or with partial rollout (groups of several batches) the index in the list."""
    if len({g[0].sample.tag.batch for g in groups}) <= 1:
        return [s.sample.tag.group for g in groups for s in g]
    return [i for i, g in enumerate(groups) for _ in g]


class GroupTaker:
    """Takes complete groups from the sample stream for the rollouts' micro-batches,
    parking groups taken early (of a later batch, or not wanted yet) for later.

    Every take waits at most `timeout` for the stream (raising `StreamTimeout` naming
    it), and raises the stream's `StreamError` once the run failed."""

    def __init__(self, stream: SampleStream[Scored], timeout: float):
        self.stream, self.timeout = stream, timeout
        self._parked: dict[int, list[Group]] = {}  # batch -> groups taken early
        self._by_key: dict[tuple[int, int], Group] = {}  # groups taken early, by key

    def take(self, batch: int, min_groups: int, max_groups: int) -> list[Group]:
        """At least `min_groups` (at most `max_groups`) complete groups of `batch`, in
        the order they completed."""
        out = self._parked.pop(batch, [])
        while len(out) < min_groups:
            got = self.stream.get_groups(min_groups=1, max_groups=max_groups, timeout=self.timeout)
            self._file(got, batch, out)
        return self._trim(batch, out, max_groups)

    def park(self, batch: int, group: Group) -> None:
        """A complete group of `batch` handed to this taker directly (not through the
        stream): the next take of that batch returns it (the trainer's thread only)."""
        self._parked.setdefault(batch, []).append(group)

    def take_until(
        self, batch: int, min_groups: int, max_groups: int, done: Callable[[], bool]
    ) -> list[Group]:
        """Like `take`, for a batch that may end with fewer groups: polls, and returns
        what it has (possibly nothing) once `done()`."""
        out = self._parked.pop(batch, [])
        deadline = time.monotonic() + self.timeout
        while len(out) < min_groups and not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"trainer: batch {batch}: {len(out)} of {min_groups} groups after "
                    f"{self.timeout:.0f} s (generation or reward stalled?)"
                )
            try:
                got = self.stream.get_groups(
                    min_groups=1, max_groups=max_groups, timeout=min(left, 0.5)
                )
            except StreamTimeout:
                continue
            self._file(got, batch, out)
        return self._trim(batch, out, max_groups)

    def take_indexed(self, batch: int, want: list[int]) -> list[Group]:
        """Exactly the groups `want` of `batch`, in that order, members in member order."""
        have = {g[0].sample.tag.group: g for g in self._parked.pop(batch, [])}
        while not all(i in have for i in want):
            for group in self.stream.get_groups(min_groups=1, max_groups=1, timeout=self.timeout):
                tag = group[0].sample.tag
                if tag.batch == batch:
                    have[tag.group] = group
                else:
                    self._parked.setdefault(tag.batch, []).append(group)
        out = [by_member(have.pop(i)) for i in want]
        if have:
            self._parked[batch] = list(have.values())
        return out

    def ready(self, want: list[tuple[int, int]], at_least: int) -> list[tuple[int, int]]:
        """The keys of `want` whose groups are taken, once at least `at_least` are."""
        while sum(k in self._by_key for k in want) < at_least:
            self._take_one()
        return [k for k in want if k in self._by_key]

    def key(self, key: tuple[int, int]) -> Group:
        """The group `key` (batch, group index), members in member order."""
        while key not in self._by_key:
            self._take_one()
        return by_member(self._by_key.pop(key))

    def _take_one(self) -> None:
        for group in self.stream.get_groups(min_groups=1, max_groups=1, timeout=self.timeout):
            self._by_key[group_key(group[0])] = group

    def _file(self, groups: list[Group], batch: int, out: list[Group]) -> None:
        """Groups of `batch` into `out`, those of later batches parked."""
        for group in groups:
            b = group[0].sample.tag.batch
            (out if b == batch else self._parked.setdefault(b, [])).append(group)

    def _trim(self, batch: int, out: list[Group], max_groups: int) -> list[Group]:
        """At most `max_groups` of `out`; the rest parked for the next micro-batch."""
        if len(out) > max_groups:
            self._parked[batch] = out[max_groups:]
            out = out[:max_groups]
        return out


def by_member(group: Group) -> Group:
    """A group's members in member order (a fixed summation order)."""
    return sorted(group, key=lambda s: s.sample.tag.member)
