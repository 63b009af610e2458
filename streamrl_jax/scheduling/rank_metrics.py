"""Ranking quality of an output-length predictor: recall of the longest share, Kendall tau.

Pure numpy (no JAX), so the simulator and the dispatcher can use it without devices.

* `recall_at(true, score, frac)`: with k = round(frac * n), the share of the true k
  longest samples that are among the k highest scores. The paper reports it at
  20 / 10 / 5 % (0.87 / 0.82 / 0.76 for its 7B ranker). Ties in the true lengths at the
  cut are counted fairly: with t the k-th largest true length, a predicted-top sample with
  length > t is a hit, and those with length == t are hits up to the number of cut places
  left for ties (otherwise an arbitrary index tie-break would cap recall below 1 for a
  perfect ranker of integer lengths).
* `kendall_tau(x, y)`: Kendall's tau-b, (C - D) / sqrt((C + D + T_x)(C + D + T_y)), with
  C / D the concordant / discordant pairs and T_x / T_y the pairs tied only in x / y.
"""

from __future__ import annotations

import numpy as np


def recall_at(true_len: np.ndarray, score: np.ndarray, frac: float) -> float:
    """Share of the true longest `frac` of samples among the `frac` highest scores."""
    true_len, score = np.asarray(true_len), np.asarray(score)
    if true_len.shape != score.shape or true_len.ndim != 1 or not len(true_len):
        raise ValueError(
            f"recall_at: need two equal-length 1-D arrays, got {true_len.shape} and {score.shape}"
        )
    if not 0 < frac <= 1:
        raise ValueError(f"recall_at: frac must be in (0, 1], got {frac}")
    k = max(1, int(round(frac * len(true_len))))
    cut = np.sort(true_len)[::-1][k - 1]
    tie_places = k - int((true_len > cut).sum())
    picked = true_len[np.argsort(-score, kind="stable")[:k]]
    hits = int((picked > cut).sum()) + min(int((picked == cut).sum()), tie_places)
    return hits / k


def kendall_tau(x: np.ndarray, y: np.ndarray, *, chunk: int = 512) -> float:
    """Kendall's tau-b between two 1-D arrays (O(n^2) in row chunks of `chunk`).

    Returns NaN when either array is constant (tau-b is undefined there).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"kendall_tau: need two equal-length 1-D arrays (n >= 2), got {x.shape}")
    s = t_x = t_y = 0.0  # sum of sign products, pairs untied in x, pairs untied in y
    n = len(x)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        # Only pairs (i, j) with j > i, each counted once.
        j = np.arange(n)[None, :]
        i = np.arange(lo, hi)[:, None]
        upper = j > i
        dx = np.sign(x[None, :] - x[lo:hi, None]) * upper
        dy = np.sign(y[None, :] - y[lo:hi, None]) * upper
        s += float((dx * dy).sum())
        t_x += float(np.abs(dx).sum())
        t_y += float(np.abs(dy).sum())
    if t_x == 0 or t_y == 0:
        return float("nan")
    return s / np.sqrt(t_x * t_y)


def ranking_report(true_len: np.ndarray, score: np.ndarray) -> dict[str, float]:
    """recall@20/10/5 % and Kendall tau-b, as the benchmarks and train_ranker report them."""
    return {
        "recall_at_20": recall_at(true_len, score, 0.20),
        "recall_at_10": recall_at(true_len, score, 0.10),
        "recall_at_5": recall_at(true_len, score, 0.05),
        "kendall_tau": kendall_tau(true_len, score),
        "n": float(len(true_len)),
    }
