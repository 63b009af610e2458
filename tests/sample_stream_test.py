"""Tests of the bounded, grouping sample stream (host only, no devices)."""

import threading
import time

import pytest

from streamrl_jax.stream.sample_stream import SampleStream, StreamError, StreamTimeout, flatten


def _stream(group_size=2, capacity=4):
    return SampleStream(group_size=group_size, group_key=lambda s: s[0], capacity=capacity)


def test_groups_released_only_when_complete_in_completion_order():
    s = _stream(group_size=2, capacity=8)
    s.put(("a", 0), timeout=1)
    s.put(("b", 0), timeout=1)
    assert s.depth() == {"ready_groups": 0, "ready_samples": 0, "partial_samples": 2}
    s.put(("b", 1), timeout=1)  # b completes first
    s.put(("a", 1), timeout=1)
    groups = s.get_groups(min_groups=2, timeout=1)
    assert [g[0][0] for g in groups] == ["b", "a"]
    assert flatten(groups) == [("b", 0), ("b", 1), ("a", 0), ("a", 1)]
    assert s.metrics.samples_out == 4


def test_max_groups_limits_what_is_taken():
    s = _stream(group_size=1, capacity=8)
    for i in range(3):
        s.put((i,), timeout=1)
    assert len(s.get_groups(min_groups=1, max_groups=2, timeout=1)) == 2
    assert len(s.get_groups(min_groups=1, timeout=1)) == 1


def test_consumer_timeout_names_the_stream():
    s = _stream()
    s.put(("a", 0), timeout=1)
    with pytest.raises(StreamTimeout, match="sample_stream.*1 incomplete"):
        s.get_groups(min_groups=1, timeout=0.05)


def test_back_pressure_blocks_then_times_out():
    s = _stream(group_size=2, capacity=2)
    s.put(("a", 0), timeout=1)
    s.put(("a", 1), timeout=1)  # ready: 2 of capacity 2
    s.put(("b", 0), timeout=1)  # incomplete groups do not count
    with pytest.raises(StreamTimeout, match="back-pressure"):
        s.put(("b", 1), timeout=0.05)


def test_back_pressure_released_by_consumer():
    s = _stream(group_size=1, capacity=1)
    s.put(("a",), timeout=1)
    done = threading.Event()

    def producer():
        s.put(("b",), timeout=5)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    s.get_groups(min_groups=1, timeout=1)
    t.join(timeout=5)
    assert done.is_set()
    assert s.get_groups(min_groups=1, timeout=1) == [[("b",)]]


def test_producer_failure_wakes_a_waiting_consumer():
    s = _stream()
    err = ValueError("boom")
    threading.Timer(0.05, lambda: s.fail(err, "generation instance 3")).start()
    # Woke on the failure, not the timeout: the wait's bound is past pytest's own (420 s),
    # so only the failure can end it in the test (a consumer that slept through the
    # failure fails the test at pytest's timeout); no wall clock is read
    with pytest.raises(StreamError, match="generation instance 3 failed") as info:
        s.get_groups(min_groups=1, timeout=3600)
    assert info.value.__cause__ is err


def test_close_drains_ready_and_rejects_puts():
    s = _stream(group_size=1)
    s.put(("a",), timeout=1)
    s.close()
    assert s.get_groups(min_groups=3, timeout=1) == [[("a",)]]
    assert s.get_groups(min_groups=1, timeout=1) == []
    with pytest.raises(StreamError, match="put after close"):
        s.put(("b",), timeout=1)


def test_bad_sizes_rejected():
    s = _stream(group_size=1, capacity=4)
    with pytest.raises(ValueError, match="capacity"):
        SampleStream(group_size=4, group_key=lambda x: x, capacity=2)
    with pytest.raises(ValueError, match="min_groups"):
        s.get_groups(min_groups=0, timeout=1)
