"""Tests for simulation/calibrate.py (the full 9-setting run lives in streamrl_podplan.simulate)."""

import dataclasses

import pytest

from streamrl_podplan.simulation import calibrate, compiled, cost_model
from streamrl_podplan.simulation.cost_model import CostParams


def test_paper_table_has_nine_settings_with_streamrl_faster():
    assert len(calibrate.PAPER_FIG8) == 9
    for col, sync, asyn in calibrate.PAPER_FIG8.values():
        assert col < sync < asyn


def test_summary_counts_ratios_within_tolerance():
    row = calibrate.Row(
        max_len=5_000,
        model="qwen2.5-7b",
        devices=32,
        gen_devices=16,
        sim={"colocated": 10.0, "stream_sync": 12.0, "stream_async": 20.0},
        paper=(10.0, 12.5, 15.0),
        instance="2 x 64",
    )
    s = calibrate.summary([row])
    assert s["n_ratios"] == 2
    assert s["within_15pct"] == 1  # sync -4% in, async +33% out
    assert s["max_rel_error"] == pytest.approx(20 / 15 - 1)
    assert "| 5K, 7B/32 | 2 x 64 | 16/16 |" in calibrate.table([row])


def test_a_compiled_instance_sets_a_settings_tp_slots_and_costs():
    # `simulate.py --calibrate --compiled=...`: a model's instance as plan_pod compiled it
    # (TP 2, 64 slots of 10,752 positions); at a 5K trace the cache holds about twice the
    # slots (within the simulator's KV count); its compiled costs scale every setting.
    sc = calibrate.setting_scenario(5_000, "qwen2.5-7b", 32, CostParams(), hw="tpu_v5p")
    inst = calibrate.Instance(hw="tpu_v5p", instance_tp=2, slots=64, max_len=10_752)
    got, costs = calibrate.with_instance(sc, inst)
    cap = cost_model.max_slots(got.model, got.hw, 2, got.trace.max_seq_len, got.params,
                               got.resident_per_device)  # fmt: skip
    assert costs is None and got.tp == 2
    assert got.slots == min(cap, 64 * 10_752 // got.trace.max_seq_len) > 64
    point = compiled.Compiled(
        decode_flops=1e12, decode_bytes=4e11, prefill_flops=1e14, prefill_bytes=1e11,
        train_flops=1e15, train_bytes=1e12, apply_bytes=1e10, instance_tp=2, slots=64,
        max_len=10_752, prefill_batch=8, max_prompt=512, train_devices=16, rows=16,
        seq=10_752,
    )  # fmt: skip
    _, costs = calibrate.with_instance(sc, dataclasses.replace(inst, compiled=point))
    assert costs.base.slots == got.slots and costs.decode_scale > 0
    slower = dataclasses.replace(point, decode_bytes=3 * point.decode_bytes)
    _, slow = calibrate.with_instance(sc, dataclasses.replace(inst, compiled=slower))
    assert slow.decode_scale > costs.decode_scale and slow.train_scale == costs.train_scale
    with pytest.raises(ValueError, match=r"no \d+-token sequence fits"):
        tiny = dataclasses.replace(inst, slots=1, max_len=512)
        calibrate.with_instance(sc, tiny)


def test_a_model_wider_than_a_node_takes_its_instances_tp():
    # 72B in bf16 does not fit one v5p host's 4 chips by the simulator's own TP rule; the
    # plan's TP 8 instance (two hosts) is what its settings run with.
    with pytest.raises(ValueError, match="does not fit one node of tpu_v5p"):
        calibrate.setting_scenario(10_000, "qwen2.5-72b", 128, CostParams(), hw="tpu_v5p")
    sc = calibrate.setting_scenario(10_000, "qwen2.5-72b", 128, CostParams(), "tpu_v5p", gen_tp=8)
    inst = calibrate.Instance(hw="tpu_v5p", instance_tp=8, slots=128, max_len=10_752)
    got, _ = calibrate.with_instance(sc, inst)
    assert got.tp == 8 and got.slots >= 1
