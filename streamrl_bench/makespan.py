"""The makespan of a generation batch's dispatch plan on modelled instances.

The scheduling bench (`tools/bench_scheduling.py`) times plans on the real engine and
cross-checks them here: `dynamic_makespan` runs fixed-shape instances that admit their
highest-priority request whenever a slot frees, with an optional update when a request
finishes (the group signal, late binding); `simulated_makespan` is the simulator's
makespan of the same plan (`simulation.generation`) with a measured PTL profile.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from streamrl_jax.scheduling import dispatch
from streamrl_podplan.simulation import generation as sim_gen

# update(i, priority, queued) when request i finishes (`dynamic_makespan`)
Update = Callable[[int, np.ndarray, np.ndarray], None]


def dynamic_makespan(
    instance: list[int],
    priority: np.ndarray,
    slots: list[int],
    step_s: list[float],
    true: np.ndarray,
    update: Update | None = None,
) -> float:
    """Makespan of fixed-shape instances (a step costs step_s[k] whatever the batch) that
    admit their highest-priority queued request whenever a slot frees (ties: submission
    order), all instances running at once. `update(i, prio, queued)` is called when
    request i finishes, before the freed slot is refilled, and may change `prio` of
    queued requests (any instance): the group signal. instance[i] = -1: request i is not
    bound to an instance; the first instance with a free slot takes it (late binding, a
    queue shared by the instances)."""
    prio = np.asarray(priority, np.float64).copy()
    inst = np.asarray(instance)
    queued = np.ones(len(true), bool)
    free = list(slots)
    events: list[tuple[float, int, int]] = []

    def admit(k: int, t: float) -> None:
        while free[k]:
            mine = np.flatnonzero(queued & ((inst == k) | (inst < 0)))
            if not len(mine):
                return
            i = int(mine[np.argmax(prio[mine])])  # argmax: first of ties = submission order
            queued[i] = False
            free[k] -= 1
            heapq.heappush(events, (t + float(true[i]) * step_s[k], k, i))

    for k in range(len(slots)):
        admit(k, 0.0)
    t = 0.0
    while events:
        t, k, i = heapq.heappop(events)
        free[k] += 1
        if update is not None:
            update(i, prio, queued)
        admit(k, t)
    return t


def group_signal_plans(plans, scores, true, history, group_of, slots, ptl) -> dict[str, float]:
    """Makespans (fixed-shape instances, `dynamic_makespan`) of the batch's plans with and
    without the group signal: once samples of a prompt have finished, its queued samples'
    priority becomes the mean of their expected length (`dispatch.expected_lengths` of the
    ranker's score, counted as one observation) and the finished lengths (`signal`); with
    `probe`, each prompt's first sample is admitted before its others (so that some of
    every group finish early), longest expected first."""
    step_s = [ptl(s) for s in slots]
    est = dispatch.expected_lengths(scores, history)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)
    first = np.zeros(len(true), bool)
    first[[m[0] for m in members.values()]] = True

    def make_update():
        done: dict[str, list[float]] = {}

        def update(i, prio, queued):
            got = done.setdefault(group_of[i], [])
            got.append(float(true[i]))
            for j in members[group_of[i]]:
                if queued[j]:
                    prio[j] = (est[j] + sum(got)) / (1 + len(got))

        return update

    out = {}
    for name in ("random_fifo", "skew_lpt", "oracle_lpt"):
        plan = plans[name]
        inst = list(plan.instance_per_request)
        prio = np.asarray(plan.priority_per_request, np.float64)
        out[f"static_{name}"] = dynamic_makespan(inst, prio, slots, step_s, true)
    inst = list(plans["skew_lpt"].instance_per_request)
    out["signal_lpt"] = dynamic_makespan(inst, est, slots, step_s, true, make_update())
    probe = est + first * (est.max() + 1.0)
    out["probe_static_lpt"] = dynamic_makespan(inst, probe, slots, step_s, true)
    out["probe_signal_lpt"] = dynamic_makespan(inst, probe, slots, step_s, true, make_update())
    # Late binding (not what the service does: it binds each request when it is planned):
    # one queue, any free slot takes its highest priority request.
    shared = [-1] * len(true)
    out["shared_queue_lpt"] = dynamic_makespan(shared, est, slots, step_s, true)
    out["shared_queue_signal_lpt"] = dynamic_makespan(
        shared, est, slots, step_s, true, make_update()
    )
    out["shared_queue_oracle"] = dynamic_makespan(shared, true, slots, step_s, true)
    return out


def simulated_makespan(
    plan: dispatch.DispatchPlan,
    slots: Sequence[int],
    ptl: dispatch.PTLProfile,
    true: np.ndarray,
    buckets: Sequence[tuple[int, ...]] | None = None,
) -> float:
    """The simulator's makespan of `plan` with the measured PTL (the cross-check of a
    timed plan): a step costs PTL at its instance's decode batch bucket (`buckets[k]`,
    the engine's), or at the slot count (None: fixed-shape instances, as
    `dynamic_makespan` prices them)."""
    spans = []
    prompt = np.full(len(true), 12)
    for k, order in enumerate(plan.orders(len(slots))):
        if order:
            shapes = (slots[k],) if buckets is None else buckets[k]
            cost = sim_gen.InstanceSpec(cost=_PTLCost(ptl, shapes), slots=slots[k])
            spans.append(sim_gen.run_instance(cost, order, prompt, true)[2])
    return max(spans)


@dataclasses.dataclass(frozen=True)
class _PTLCost:
    ptl: dispatch.PTLProfile
    buckets: tuple[int, ...]  # the engine's decode batch buckets

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        return steps * self.ptl(next(b for b in self.buckets if b >= batch))

    def prefill_time(self, tokens: float) -> float:
        return 0.0
