"""Mode schedules: g(b), min groups, the version gate and the weight board."""

import threading

import pytest

from streamrl_jax.config import PipelineSection
from streamrl_jax.pipeline.schedules import Schedule, StaleSampleError, VersionGate, WeightBoard


def _sched(mode, s=1):
    return Schedule.from_config(PipelineSection(mode=mode, staleness=s))


@pytest.mark.parametrize("mode", ["colocated", "disaggregated_batch", "stream_sync"])
def test_synchronous_modes_are_on_policy(mode):
    sched = _sched(mode, s=3)
    assert sched.staleness == 0
    assert [sched.generation_version(b) for b in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("s,expected", [(1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])])
def test_async_generation_version(s, expected):
    sched = _sched("stream_async", s)
    assert [sched.generation_version(b) for b in range(5)] == expected


def test_min_groups_streaming_vs_batch():
    p = PipelineSection(mode="stream_sync", min_groups=2, prompts_per_step=8)
    assert Schedule.from_config(p).min_groups(p, remaining=8) == 2
    assert Schedule.from_config(p).min_groups(p, remaining=1) == 1
    batch = PipelineSection(mode="disaggregated_batch", min_groups=2, prompts_per_step=8)
    assert Schedule.from_config(batch).min_groups(batch, remaining=8) == 8


def test_version_gate_counts_or_raises():
    gate = VersionGate(_sched("stream_async", 1), strict=False)
    assert gate.admit(step=3, version=2, sample_id="a")
    assert gate.admit(step=3, version=3, sample_id="b")
    assert not gate.admit(step=3, version=1, sample_id="c")
    assert not gate.admit(step=3, version=4, sample_id="future")
    assert gate.dropped == 2
    strict = VersionGate(_sched("stream_sync"), strict=True)
    assert strict.admit(step=2, version=2, sample_id="x")
    with pytest.raises(StaleSampleError, match="sample y has policy version 1"):
        strict.admit(step=2, version=1, sample_id="y")


def test_weight_board_keeps_versions_until_discarded():
    board = WeightBoard()
    board.publish(0, "w0")
    assert board.wait_for(0, timeout=1) == "w0"
    threading.Timer(0.05, lambda: board.publish(1, "w1")).start()
    assert board.wait_for(1, timeout=10) == "w1"
    board.publish(2, "w2")
    assert board.wait_for(1, timeout=1) == "w1"  # an older version is still exact
    board.discard_below(2)
    with pytest.raises(KeyError, match="version 1 was already discarded"):
        board.wait_for(1, timeout=1)
    with pytest.raises(TimeoutError, match="policy version 3.*trainer"):
        board.wait_for(3, timeout=0.05)
    with pytest.raises(ValueError, match="version 1 after 2"):
        board.publish(1, "again")
    board.fail(RuntimeError("trainer died"))
    with pytest.raises(RuntimeError, match="trainer died"):
        board.wait_for(5, timeout=10)
