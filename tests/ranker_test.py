"""Tests of the output-length ranker (scheduling/ranker.py) and its ranking metrics."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl_jax.scheduling import rank_metrics
from streamrl_jax.scheduling.ranker import Ranker, RankerConfig, encode_prompts

VOCAB = 64
LONG_IDS = np.array([3, 5, 7, 11])


def toy_data(n: int, seed: int) -> tuple[list[list[int]], np.ndarray]:
    """Random prompts; output length = 40 per LONG_IDS token + prompt length (learnable
    exactly, so held-out recall measures the ranker, not label noise)."""
    rng = np.random.default_rng(seed)
    prompts, lengths = [], []
    for _ in range(n):
        p = rng.integers(0, VOCAB, size=int(rng.integers(8, 33)))
        hits = np.isin(p, LONG_IDS).sum()
        lengths.append(int(40 * hits + len(p)))
        prompts.append(p.tolist())
    return prompts, np.asarray(lengths)


@pytest.fixture(scope="module")
def trained():
    ranker = Ranker(RankerConfig(vocab_size=VOCAB, max_tokens=32, seed=0))
    prompts, lengths = toy_data(1500, seed=0)
    losses = ranker.fit(prompts, lengths, steps=200)
    return ranker, losses


def test_ranker_learns_synthetic_length_function(trained):
    ranker, losses = trained
    prompts, lengths = toy_data(500, seed=1)  # held out
    report = rank_metrics.ranking_report(lengths, ranker.score(prompts))
    assert report["recall_at_20"] > 0.9, report
    assert report["kendall_tau"] > 0.6, report
    assert np.mean(losses[-20:]) < np.mean(losses[:20])


def test_untrained_ranker_is_near_chance():
    """Guards the test above: the recall comes from training, not from the data."""
    prompts, lengths = toy_data(500, seed=1)
    score = Ranker(RankerConfig(vocab_size=VOCAB, max_tokens=32, seed=0)).score(prompts)
    assert rank_metrics.recall_at(lengths, score, 0.2) < 0.6


def test_state_round_trip_restores_scores(trained):
    ranker, _ = trained
    prompts, _ = toy_data(50, seed=2)
    fresh = Ranker(RankerConfig(vocab_size=VOCAB, max_tokens=32, seed=7))
    assert not np.allclose(fresh.score(prompts), ranker.score(prompts))
    fresh.load_state(ranker.state())
    np.testing.assert_allclose(fresh.score(prompts), ranker.score(prompts), rtol=1e-6)
    assert fresh.steps == ranker.steps
    wrong = Ranker(RankerConfig(vocab_size=VOCAB, max_tokens=32, embed_dim=8))
    with pytest.raises(ValueError, match="structure or shape"):
        wrong.load_state(ranker.state())


def test_online_update_buffers_then_trains_and_tracks_drift():
    cfg = RankerConfig(vocab_size=VOCAB, max_tokens=32, min_buffer=64, steps_per_update=4)
    ranker = Ranker(cfg)
    prompts, lengths = toy_data(600, seed=3)
    assert ranker.update(list(zip(prompts[:10], lengths[:10], strict=True))) is None
    assert ranker.steps == 0
    # Drift: the length function flips (prompts with LONG_IDS are now the short ones).
    flipped = lengths.max() + 1 - lengths
    for lo in range(10, 600, 20):
        batch = list(zip(prompts[lo : lo + 20], flipped[lo : lo + 20], strict=True))
        ranker.update(batch)
    assert ranker.steps > 0 and ranker.buffer_size == 600
    test_p, test_len = toy_data(300, seed=4)
    tau = rank_metrics.kendall_tau(test_len.max() + 1 - test_len, ranker.score(test_p))
    assert tau > 0.3


def test_encode_keeps_last_tokens_and_hashes_ids():
    tokens, mask = encode_prompts([[1, 2, 3, 70]], max_tokens=2, vocab_size=64, pad_to=4)
    assert tokens.shape == (4, 2)
    np.testing.assert_array_equal(tokens[0], [3, 70 % 64])
    assert mask[0].all() and not mask[1:].any()
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        encode_prompts([[]], max_tokens=2, vocab_size=64)


def test_recall_at_hand_made():
    true = np.array([10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    assert rank_metrics.recall_at(true, true.astype(float), 0.2) == 1.0
    assert rank_metrics.recall_at(true, -true.astype(float), 0.2) == 0.0
    score = np.array([10, 0, 9, 0, 0, 0, 0, 0, 0, 0], float)  # finds 1 of the top 2
    assert rank_metrics.recall_at(true, score, 0.2) == 0.5
    tied = np.array([5, 3, 3, 3, 1])  # k = 2: one place for the three tied 3s
    assert rank_metrics.recall_at(tied, np.array([5.0, 0, 0, 4, 0]), 0.4) == 1.0
    assert rank_metrics.recall_at(tied, np.array([0.0, 4, 0, 5, 0]), 0.4) == 0.5


def test_kendall_tau_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=700)  # many ties, more rows than one chunk
    y = x + rng.integers(0, 15, size=700)
    want = stats.kendalltau(x, y).statistic
    assert rank_metrics.kendall_tau(x, y, chunk=128) == pytest.approx(want, abs=1e-12)
    assert rank_metrics.kendall_tau(x, -x) == pytest.approx(-1.0)
    assert np.isnan(rank_metrics.kendall_tau(np.ones(5), np.arange(5)))
