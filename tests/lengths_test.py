"""Tests for scheduling/lengths.py: the paper's length-trace shape."""

import numpy as np
import pytest

from streamrl_jax.scheduling import lengths


def _summary(x: np.ndarray) -> dict[str, float]:
    """Median, mean, P90, P99 and max of a length array."""
    x = np.asarray(x, dtype=np.float64)
    return {
        "median": float(np.median(x)),
        "mean": float(x.mean()),
        "p90": float(np.quantile(x, 0.9)),
        "p99": float(np.quantile(x, 0.99)),
        "max": float(x.max()),
    }


def test_paper_trace_20k_shape():
    _, resp = lengths.sample_lengths(lengths.paper_trace(20_000), 50_000, np.random.default_rng(0))
    s = _summary(resp)
    assert s["median"] == pytest.approx(3200, rel=0.08)
    assert s["mean"] == pytest.approx(4900, rel=0.08)
    assert 11_500 <= s["p90"] <= 13_500
    assert s["p99"] == pytest.approx(19_000, rel=0.05)
    assert s["max"] <= 20_000


@pytest.mark.parametrize("max_len, div", [(10_000, 2), (5_000, 4)])
def test_smaller_settings_divide_lengths(max_len, div):
    _, resp = lengths.sample_lengths(lengths.paper_trace(max_len), 50_000, np.random.default_rng(1))
    s = _summary(resp)
    assert s["median"] == pytest.approx(3200 / div, rel=0.08)
    assert s["max"] <= max_len


def test_prompts_mostly_under_1k_and_deterministic():
    tr = lengths.paper_trace(20_000)
    p1, r1 = lengths.sample_lengths(tr, 1000, np.random.default_rng(7))
    p2, r2 = lengths.sample_lengths(tr, 1000, np.random.default_rng(7))
    np.testing.assert_array_equal(r1, r2)
    np.testing.assert_array_equal(p1, p2)
    assert p1.max() <= 1024 and np.median(p1) < 600


def test_fixed_trace():
    p, r = lengths.sample_lengths(lengths.fixed_trace(100, 16), 5, np.random.default_rng(0))
    assert r.tolist() == [100] * 5 and p.tolist() == [16] * 5


def test_invalid_trace_names_field():
    with pytest.raises(ValueError, match="LengthTrace.max_len"):
        lengths.LengthTrace(max_len=0, median_param=10.0)
    with pytest.raises(ValueError, match="LengthTrace.fixed_len"):
        lengths.LengthTrace(max_len=100, median_param=10.0, fixed_len=101)
