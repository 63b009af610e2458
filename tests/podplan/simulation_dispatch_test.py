"""Tests for simulation/dispatch.py: ranker recall and Algorithm 2 plans."""

import numpy as np
import pytest

from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import dispatch


def _resp(n=1024, seed=0):
    return lengths.sample_lengths(lengths.paper_trace(20_000), n, np.random.default_rng(seed))[1]


@pytest.mark.parametrize("recall", [1.0, 0.87, 0.76])
def test_ranker_hits_requested_recall(recall):
    resp = _resp()
    scores = dispatch.ranker_scores(resp, recall, 0.2, np.random.default_rng(0))
    assert dispatch.recall_at(resp, scores, 0.2) == pytest.approx(recall, abs=0.02)


def test_random_dispatch_is_a_partition_with_equal_counts():
    plan = dispatch.random_dispatch(100, 8, np.random.default_rng(0))
    flat = sorted(i for p in plan for i in p)
    assert flat == list(range(100))
    assert max(map(len, plan)) - min(map(len, plan)) <= 1


def test_skew_aware_plan_isolates_long_tail_in_lpt_order():
    resp = _resp()
    scores = np.log(resp.astype(float))  # perfect ranker
    plan = dispatch.skew_aware_dispatch(scores, resp, 16, 64, lambda bs, ctx: 0.01 + 1e-4 * bs)
    assert sorted(i for p in plan for i in p) == list(range(len(resp)))
    long_set = set(np.argsort(-resp)[: round(0.2 * len(resp))].tolist())
    n_long = next(k for k, p in enumerate(plan) if not set(p) <= long_set)
    assert 1 <= n_long < 16
    for p in plan:  # longest-predicted first inside each instance
        assert all(resp[a] >= resp[b] for a, b in zip(p, p[1:], strict=False))


def test_skew_aware_validation():
    with pytest.raises(ValueError, match="objective"):
        dispatch.skew_aware_dispatch(np.ones(4), np.ones(4), 2, 4, lambda b, c: 1.0, objective="x")
    with pytest.raises(ValueError, match="recall"):
        dispatch.ranker_scores(np.ones(4), 0.0, 0.2, np.random.default_rng(0))
