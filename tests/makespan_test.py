"""Tests of the scheduling bench's group-signal simulator (`streamrl_bench.makespan`)."""

from __future__ import annotations

import numpy as np

from streamrl_bench import makespan
from streamrl_jax.scheduling import dispatch


def test_static_plan_matches_the_simulator():
    """Without an update the makespan is the simulator's of the same plan (the cross-check
    the bench's numbers rely on)."""
    rng = np.random.default_rng(0)
    true = rng.integers(1, 100, size=40)
    ptl = dispatch.PTLProfile((1, 4, 8), (1e-4, 1.5e-4, 2.5e-4))
    slots = [8, 4, 4]
    plan = dispatch.DispatchPlan(
        rng.integers(0, 3, size=40).tolist(), rng.random(40).round(1).tolist()
    )
    got = makespan.dynamic_makespan(
        plan.instance_per_request,
        np.array(plan.priority_per_request),
        slots,
        [ptl(s) for s in slots],
        true,
    )
    assert np.isclose(got, makespan.simulated_makespan(plan, slots, ptl, true))


def test_update_reorders_queued_requests():
    # One instance, 2 slots; request 4 (long) is last by priority until its sibling 1
    # finishes and the update raises it.
    true = np.array([8, 1, 1, 1, 8])
    prio = np.array([9.0, 8, 2, 2, 1])
    group = ["a", "b", "c", "c", "b"]
    calls = []

    def update(i, p, queued):
        calls.append(i)
        for j in range(len(true)):
            if queued[j] and group[j] == group[i]:
                p[j] = 100.0

    inst = [0] * 5
    assert makespan.dynamic_makespan(inst, prio, [2], [1.0], true) == 11.0
    assert makespan.dynamic_makespan(inst, prio, [2], [1.0], true, update) == 10.0
    assert sorted(calls) == [0, 1, 2, 3, 4]


def test_shared_queue_late_binding():
    true = np.array([4, 4, 4, 4])
    bound = makespan.dynamic_makespan([0, 0, 0, 0], np.zeros(4), [1, 1], [1.0, 1.0], true)
    shared = makespan.dynamic_makespan([-1] * 4, np.zeros(4), [1, 1], [1.0, 1.0], true)
    assert (bound, shared) == (16.0, 8.0)
