"""Tests for simulation/calibrate.py (the full 9-setting run lives in tools/simulate.py)."""

import pytest

from streamrl_jax.simulation import calibrate


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
    )
    s = calibrate.summary([row])
    assert s["n_ratios"] == 2
    assert s["within_15pct"] == 1  # sync -4% in, async +33% out
    assert s["max_rel_error"] == pytest.approx(20 / 15 - 1)
    assert "| 5K, 7B/32 | 16/16 |" in calibrate.table([row])
