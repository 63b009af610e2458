"""Stage balance (Algorithm 1) and the elastic rule for generation instances.

Profiles are plain callables, devices -> seconds per global batch: P_gen(x) (generation of
one global batch on x devices, for the current output-length distribution) and
P_train(y) (training it on y devices). Return `math.inf` where a size is infeasible (the
training state does not fit). Measured tables give them (`table_profile`), and so does the
simulator's cost model (`streamrl_podplan.simulation.stages.simulator_profiles`; it imports
this module, never the reverse).

* **Single pool** of n devices (`split_single_pool`): enumerate x generation devices (a
  multiple of the instance size) and y training devices (a multiple of the training unit)
  with x + y <= n, and pick the pair minimising max(T_gen(x), T_train(y)); ties go to the
  pair using fewer devices, then to the smaller sum of the two times.
* **Three stages** (`split_three_stages`): the same over generation, scoring (a reward
  model's forward over every sample: a judge or a process reward model, issue 55) and
  training, x + z + y <= n, minimising max(T_gen(x), T_score(z), T_train(y)).
* **Two pools** (`shrink_two_pools`): m devices can only generate, n can only train. The
  faster stage is shrunk to the k that brings its time closest to the slower stage's
  without exceeding it (so the step time is unchanged), and the rest is freed. "Closest"
  in the paper could also mean from above; from above would slow every step, so we never
  choose it.
* **Elastic rule** (`ElasticController`): after each step, delta = T_gen - T_train (how
  long the trainer waited for generation) and delta' = the generation time one more
  data-parallel instance is predicted to save; add one instance (from reserved devices)
  exactly when delta >= delta' and a reserved instance is left (and delta' > 0: an
  instance predicted to save nothing is never added). The trainer is never resized. Pure
  logic with a decision log: the pipeline activates the instance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

Profile = Callable[[int], float]  # devices -> seconds per global batch


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """A device split and its predicted stage times (seconds per global batch).

    Attributes:
      gen_devices: devices generating.
      train_devices: devices training.
      t_gen: P_gen(gen_devices).
      t_train: P_train(train_devices).
      freed: devices left idle (two pools: released by the shrink; one pool: n - x - y).
    """

    gen_devices: int
    train_devices: int
    t_gen: float
    t_train: float
    freed: int = 0

    @property
    def step_time(self) -> float:
        """max(T_gen, T_train): the step time when the two stages fully overlap."""
        return max(self.t_gen, self.t_train)

    @property
    def used(self) -> int:
        return self.gen_devices + self.train_devices

    @property
    def total(self) -> float:
        return self.t_gen + self.t_train


def split_single_pool(
    devices: int,
    p_gen: Profile,
    p_train: Profile,
    *,
    gen_unit: int = 1,
    train_unit: int = 1,
) -> tuple[StageSplit, list[StageSplit]]:
    """Algorithm 1 on one pool: the split minimising max(T_gen, T_train), and every candidate.

    Args:
      devices: n, the pool size.
      p_gen: generation profile (devices -> seconds).
      p_train: training profile (devices -> seconds).
      gen_unit: devices per generation instance (x is a multiple of it).
      train_unit: training granularity (y is a multiple of it).

    Raises:
      ValueError: no feasible (finite-time) split exists.
    """
    if gen_unit < 1 or train_unit < 1:
        raise ValueError("split_single_pool: gen_unit and train_unit must be >= 1")
    candidates = []
    for x in range(gen_unit, devices, gen_unit):
        t_gen = p_gen(x)
        for y in range(train_unit, devices - x + 1, train_unit):
            candidates.append(StageSplit(x, y, t_gen, p_train(y), devices - x - y))
    best = _best(
        candidates,
        f"split_single_pool: no split of {devices} devices (gen unit {gen_unit}, train "
        f"unit {train_unit}) gives both stages a finite time",
    )
    return best, candidates


def _best(candidates: list, none_feasible: str):
    """The candidate with the least step time; ties to fewer devices, then the smaller
    sum of the stage times. Raises ValueError(`none_feasible`) when none is finite."""
    feasible = [c for c in candidates if math.isfinite(c.step_time)]
    if not feasible:
        raise ValueError(none_feasible)
    return min(feasible, key=lambda c: (c.step_time, c.used, c.total))


@dataclasses.dataclass(frozen=True)
class ThreeStageSplit:
    """A split of one pool between generation, scoring (a reward model) and training,
    with each stage's predicted seconds per global batch (`split_three_stages`)."""

    gen_devices: int
    score_devices: int
    train_devices: int
    t_gen: float
    t_score: float
    t_train: float
    freed: int = 0

    @property
    def step_time(self) -> float:
        """max(T_gen, T_score, T_train): the step time when the three stages overlap."""
        return max(self.t_gen, self.t_score, self.t_train)

    @property
    def used(self) -> int:
        return self.gen_devices + self.score_devices + self.train_devices

    @property
    def total(self) -> float:
        return self.t_gen + self.t_score + self.t_train

    @property
    def bottleneck(self) -> str:
        """The slowest stage: "generation", "scoring" or "training"."""
        times = {"generation": self.t_gen, "scoring": self.t_score, "training": self.t_train}
        return max(times, key=times.__getitem__)


def split_three_stages(
    devices: int,
    p_gen: Profile,
    p_score: Profile,
    p_train: Profile,
    *,
    gen_unit: int = 1,
    score_unit: int = 1,
    train_unit: int = 1,
) -> tuple[ThreeStageSplit, list[ThreeStageSplit]]:
    """Algorithm 1 over three stages (generation -> scoring -> training, DESIGN.md §8):
    x + z + y <= n devices, each a multiple of its stage's unit, minimising
    max(T_gen(x), T_score(z), T_train(y)); ties go to fewer devices, then to the smaller
    sum of the three times. Returns the best split and every candidate.

    Raises:
      ValueError: no split gives all three stages a finite time.
    """
    if min(gen_unit, score_unit, train_unit) < 1:
        raise ValueError("split_three_stages: every unit must be >= 1")
    candidates = []
    for x in range(gen_unit, devices, gen_unit):
        t_gen = p_gen(x)
        for z in range(score_unit, devices - x, score_unit):
            t_score = p_score(z)
            for y in range(train_unit, devices - x - z + 1, train_unit):
                candidates.append(
                    ThreeStageSplit(x, z, y, t_gen, t_score, p_train(y), devices - x - y - z)
                )
    best = _best(
        candidates,
        f"split_three_stages: no split of {devices} devices (units {gen_unit}, "
        f"{score_unit}, {train_unit}) gives the three stages finite times",
    )
    return best, candidates


def rebalance_three_stages(
    sizes: tuple[int, int, int],
    seconds: tuple[float, float, float],
    units: tuple[int, int, int] = (1, 1, 1),
) -> ThreeStageSplit:
    """Algorithm 1 over three stages at run time: each stage's measured seconds for one
    global batch at its current devices (`sizes`: generation, scoring, training),
    extrapolated as ideal data parallelism, T(n) = T * n0 / n (what the elastic rule
    assumes by default), and the split of the same devices that minimises the step
    (`split_three_stages`). Its prediction at the current sizes is the measured step.

    Raises:
      ValueError: a size or unit below 1, or a size not a multiple of its unit.
    """
    for name, n, u in zip(("generation", "scoring", "training"), sizes, units, strict=True):
        if u < 1 or n < u or n % u:
            raise ValueError(f"rebalance_three_stages: {name} has {n} devices in units of {u}")
    p_gen, p_score, p_train = (
        (lambda n, t=t, n0=n0: t * n0 / n) for t, n0 in zip(seconds, sizes, strict=True)
    )
    best, _ = split_three_stages(
        sum(sizes), p_gen, p_score, p_train,
        gen_unit=units[0], score_unit=units[1], train_unit=units[2],
    )  # fmt: skip
    return best


def _shrink(limit: int, unit: int, profile: Profile, target: float) -> int:
    """Fewest devices (multiple of unit, <= limit) whose time is <= target; else limit."""
    for k in range(unit, limit + 1, unit):
        if profile(k) <= target:
            return k
    return limit


def shrink_two_pools(
    gen_pool: int,
    train_pool: int,
    p_gen: Profile,
    p_train: Profile,
    *,
    gen_unit: int = 1,
    train_unit: int = 1,
) -> StageSplit:
    """Algorithm 1 on two pools: shrink the faster stage to match the slower one.

    Args:
      gen_pool: m, devices that can generate (all used by the slower stage).
      train_pool: n, devices that can train.
      p_gen, p_train: profiles (devices -> seconds).
      gen_unit, train_unit: granularity of each stage.
    """
    x = gen_pool - gen_pool % gen_unit
    y = train_pool - train_pool % train_unit
    if x < gen_unit or y < train_unit:
        raise ValueError(
            f"shrink_two_pools: pools ({gen_pool}, {train_pool}) smaller than one unit "
            f"({gen_unit}, {train_unit})"
        )
    t_gen, t_train = p_gen(x), p_train(y)
    if t_gen < t_train:
        x = _shrink(x, gen_unit, p_gen, t_train)
    elif t_train < t_gen:
        y = _shrink(y, train_unit, p_train, t_gen)
    freed = gen_pool - x + train_pool - y
    return StageSplit(x, y, p_gen(x), p_train(y), freed)


def table_profile(devices: Sequence[int], seconds: Sequence[float]) -> Profile:
    """A profile from measured (devices, seconds) points: exact at them, interpolated in
    1 / devices between them (time ~ work / devices), inf below the smallest."""
    d = np.asarray(devices, np.float64)
    s = np.asarray(seconds, np.float64)
    if len(d) < 1 or len(d) != len(s) or (np.diff(d) <= 0).any():
        raise ValueError("table_profile: devices must be ascending and match seconds")

    def profile(n: int) -> float:
        if n < d[0]:
            return math.inf
        if n >= d[-1]:
            return float(s[-1] * d[-1] / n)
        return float(np.interp(1.0 / n, 1.0 / d[::-1], s[::-1]))

    return profile


@dataclasses.dataclass(frozen=True)
class ElasticDecision:
    """One step of the elastic rule (also a line of the decision log).

    Attributes:
      step: training step.
      t_gen, t_train: measured stage seconds of the step.
      delta: t_gen - t_train.
      delta_prime: predicted generation seconds saved by one more instance.
      instances: generation instances during the step.
      add: whether one instance is added for the next step.
      reason: why (or why not).
    """

    step: int
    t_gen: float
    t_train: float
    delta: float
    delta_prime: float
    instances: int
    add: bool
    reason: str


def ideal_saving(instances: int, t_gen: float) -> float:
    """delta' under perfect data parallelism: T(k) = W / k, so T(k) - T(k + 1) = T / (k+1)."""
    return t_gen / (instances + 1)


def profile_saving(p_gen_instances: Profile) -> Callable[[int, float], float]:
    """delta' from a profile of instances -> seconds, scaled to the measured T_gen:
    t_gen * (1 - P(k + 1) / P(k)) (the profile gives the ratio, the run gives the scale)."""

    def saving(instances: int, t_gen: float) -> float:
        now, more = p_gen_instances(instances), p_gen_instances(instances + 1)
        if not (math.isfinite(now) and now > 0):
            return math.inf
        return t_gen * max(0.0, 1.0 - more / now)

    return saving


class ElasticController:
    """The elastic rule: add one generation instance exactly when delta >= delta'.

    Args:
      instances: generation instances running now.
      max_instances: instances possible with the reserved devices.
      saving: (instances, measured t_gen) -> delta'; `ideal_saving` by default.
    """

    def __init__(
        self,
        instances: int,
        max_instances: int,
        saving: Callable[[int, float], float] = ideal_saving,
    ):
        if not 1 <= instances <= max_instances:
            raise ValueError(
                f"ElasticController: need 1 <= instances ({instances}) <= max_instances "
                f"({max_instances})"
            )
        self.instances, self.max_instances, self.saving = instances, max_instances, saving
        self.log: list[ElasticDecision] = []

    def observe(self, step: int, t_gen: float, t_train: float) -> ElasticDecision:
        """Records one step's stage times; returns (and logs) the decision for the next step.

        When the decision adds an instance, `instances` is already incremented: the caller
        activates the instance before the next step's dispatch.
        """
        delta = t_gen - t_train
        delta_prime = float(self.saving(self.instances, t_gen))
        if self.instances >= self.max_instances:
            add, reason = False, "no reserved instance left"
        elif delta_prime <= 0:
            # An instance predicted to save nothing (the longest sample alone bounds the
            # makespan) would idle on reserved devices; the literal rule would add it
            # whenever delta >= 0.
            add, reason = False, "no predicted saving (delta' <= 0)"
        elif delta >= delta_prime:
            add, reason = True, "delta >= delta'"
        else:
            add, reason = False, "delta < delta'"
        decision = ElasticDecision(
            step, t_gen, t_train, delta, delta_prime, self.instances, add, reason
        )
        self.log.append(decision)
        logging.info(
            "elastic step %d: T_gen %.3f T_train %.3f delta %.3f delta' %.3f instances %d: %s",
            step, t_gen, t_train, delta, delta_prime, self.instances,
            "add one instance" if add else reason,
        )  # fmt: skip
        if add:
            self.instances += 1
        return decision
