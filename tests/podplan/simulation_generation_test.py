"""Tests for simulation/generation.py: continuous batching against hand-computed makespans."""

import numpy as np
import pytest

from streamrl_podplan.simulation import cost_model, generation, hardware
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.profiles import TableDecode

H100 = hardware.get_hardware("h100")
Q7 = hardware.get_model("qwen2.5-7b")


def _const(step_s):
    return TableDecode(batch_sizes=np.array([1.0]), per_token_s=np.array([step_s]))


@pytest.mark.parametrize("n, slots", [(4, 4), (4, 2), (5, 2), (1, 8)])
def test_constant_step_makespan_is_waves_times_length(n, slots):
    spec = generation.InstanceSpec(cost=_const(0.01), slots=slots)
    resp = np.full(n, 50)
    res = generation.simulate_batch(spec, [list(range(n))], np.full(n, 8), resp)
    waves = -(-n // slots)
    assert res.makespan == pytest.approx(waves * 50 * 0.01)


def test_shared_prefill_prefills_a_group_once_while_one_of_it_holds_a_slot():
    # Groups of 2 (samples 0-1, 2-3), 1 s per prompt token, decode steps nearly free.
    cost = TableDecode(
        batch_sizes=np.array([1.0]), per_token_s=np.array([1e-6]), prefill_s_per_token=1.0
    )
    prompt, resp = np.array([3, 3, 5, 5]), np.array([2, 2, 2, 2])

    def prefill_s(slots, share_group):
        spec = generation.InstanceSpec(cost=cost, slots=slots, share_group=share_group)
        res = generation.simulate_batch(spec, [[0, 1, 2, 3]], prompt, resp)
        return round(res.makespan)  # the decode steps add microseconds

    assert prefill_s(4, 1) == 16  # every sample prefills its prompt
    assert prefill_s(4, 2) == 8  # admitted together: each group prefills once (3 + 5)
    # One slot: a member is admitted only after the other finished, so nothing holds the
    # prompt any more and each prefills again.
    assert prefill_s(1, 2) == 16


def test_roofline_one_instance_fixed_lengths_equals_closed_form():
    p = CostParams()
    n, prompt, length = 8, 100, 300
    spec = generation.InstanceSpec(cost=generation.RooflineDecode(Q7, H100, 1, p), slots=16)
    res = generation.simulate_batch(spec, [list(range(n))], np.full(n, prompt), np.full(n, length))
    expected = n * cost_model.prefill_time(Q7, H100, 1, prompt, p) + sum(
        cost_model.decode_step_time(Q7, H100, 1, n, n * (prompt + j), p) for j in range(length)
    )
    assert res.makespan == pytest.approx(expected, rel=1e-9)
    np.testing.assert_allclose(res.done, res.makespan)


@pytest.mark.parametrize("batch, ctx0, steps", [(1, 100, 1000), (512, 50_000, 3000), (64, 0, 7)])
def test_segment_time_equals_step_by_step_sum(batch, ctx0, steps):
    p = CostParams()
    cost = generation.RooflineDecode(Q7, H100, 2, p)
    brute = sum(
        cost_model.decode_step_time(Q7, H100, 2, batch, ctx0 + batch * j, p) for j in range(steps)
    )
    assert cost.segment_time(batch, ctx0, steps) == pytest.approx(brute, rel=1e-9)


def test_continuous_batching_refills_freed_slots():
    # Slot frees after the short sample; the queued one starts then, not after the long one.
    spec = generation.InstanceSpec(cost=_const(1.0), slots=2)
    res = generation.simulate_batch(spec, [[0, 1, 2]], np.ones(3, int), np.array([10, 100, 10]))
    assert res.admit[2] == pytest.approx(10.0)
    assert res.done[2] == pytest.approx(20.0)
    assert res.makespan == pytest.approx(100.0)


def test_plan_must_cover_every_sample():
    spec = generation.InstanceSpec(cost=_const(1.0), slots=2)
    with pytest.raises(ValueError, match="every sample"):
        generation.simulate_batch(spec, [[0]], np.ones(2, int), np.ones(2, int))


def test_instance_spec_rejects_zero_slots():
    with pytest.raises(ValueError, match="InstanceSpec.slots"):
        generation.InstanceSpec(cost=_const(1.0), slots=0)
