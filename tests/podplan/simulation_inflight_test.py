"""Tests for simulation/inflight.py: the in-flight mode against stream_async."""

import numpy as np
import pytest
from sim_schedules import G_STEP, L, N, run_sim_schedule, sim_costs

from streamrl_podplan.simulation.inflight import run_inflight


def _inflight(resp, budget, iterations=4, warmup=1, group_size=1):
    prompt = np.zeros(len(resp), dtype=np.int64)
    return run_inflight(
        costs=sim_costs(), batches=[(prompt, resp)] * iterations, gen_devices=1,
        train_devices=1, tp=1, budget=budget, warmup=warmup, group_size=group_size,
    )  # fmt: skip


def test_without_a_tail_or_a_pause_it_is_stream_async():
    # Equal lengths within the budget: nothing pauses, nothing runs past its batch, so the
    # schedule is stream_async's (same steady-state iteration).
    want = run_sim_schedule("stream_async", iterations=9, warmup=3).iteration_s
    assert _inflight(np.full(N, L), budget=L, iterations=9, warmup=3).iteration_s == (
        pytest.approx(want)
    )


@pytest.mark.parametrize("group_size", [1, 2])
def test_a_long_tail_no_longer_gates_the_step(group_size):
    # One sample per batch 8x longer than the rest: stream_async's step waits for it;
    # in flight it is paused at the budget and carried, and the next batch fills the slots.
    resp = np.full(N, L // 4)
    resp[0] = 2 * L
    base = run_sim_schedule("stream_async", resp=resp, iterations=8, warmup=3)
    fast = _inflight(resp, budget=L // 2, iterations=8, warmup=3, group_size=group_size)
    assert fast.samples_per_s > 1.2 * base.samples_per_s
    assert fast.iteration_s < base.iteration_s
    assert 0.0 < fast.busy["generation"] <= 1.0


def test_generation_time_alone_matches_closed_form():
    # No training to wait for (a huge budget, one batch): one round of N samples of L
    # tokens in N slots takes L decode steps.
    res = _inflight(np.full(N, L), budget=10 * L, iterations=1, warmup=0)
    gen = L * G_STEP
    assert res.iteration_s == pytest.approx(gen + N * L * 1e-3 + 0.05, rel=1e-6)


def test_bad_settings_name_them():
    with pytest.raises(ValueError, match="budget 0"):
        _inflight(np.full(N, L), budget=0)
