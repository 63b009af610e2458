"""Output-length distributions: the paper-shaped traces of the StreamRL length-replay setting.

Live length-replay runs (`data.py`) force each response to a drawn length; the simulator
(`streamrl_podplan.simulation`) draws its global batches from the same traces.

PAPER.md describes the "20K" trace: median ~3.2K, mean ~4.9K, P90 ~12-13K, P99 ~19K,
max 20K tokens; the "10K" and "5K" settings divide every length by 2 and 4. A lognormal
truncated at the maximum (draws above it are redrawn, not clipped, so there is no spike at
the maximum and P99 stays below it) fits all four statistics:

    L ~ LogNormal(mu = ln(4170 * scale), sigma = 1.48), truncated to [min_len, max_len]

At scale 1 / max 20K a large sample has median 3.19K, mean 4.92K, P90 12.4K, P99 18.9K
(least-squares fit of (mu, sigma) to the four statistics; see docs/podplan.md).

Prompt lengths: "mostly under 1K tokens"; a lognormal with median 400 clipped to [32, 1024].
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAPER_MEDIAN_20K = 4170.0  # exp(mu) of the untruncated lognormal at the 20K setting
PAPER_SIGMA = 1.48


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthTrace:
    """Distribution of output (response) and prompt lengths.

    Attributes:
      max_len: largest response length in tokens (the setting's "5K", "10K", "20K").
      median_param: exp(mu) of the untruncated response lognormal.
      sigma: log-space standard deviation of the response lognormal.
      min_len: smallest response length.
      prompt_median: median prompt length.
      prompt_max: largest prompt length.
      fixed_len: if set, every response has exactly this length (hand-checkable cases).
    """

    max_len: int
    median_param: float
    sigma: float = PAPER_SIGMA
    min_len: int = 16
    prompt_median: float = 400.0
    prompt_max: int = 1024
    fixed_len: int | None = None

    def __post_init__(self):
        if self.max_len < 1:
            raise ValueError(f"LengthTrace.max_len must be >= 1, got {self.max_len}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"LengthTrace.min_len must be in [1, max_len={self.max_len}], got {self.min_len}"
            )
        if self.median_param <= 0 or self.sigma < 0:
            raise ValueError("LengthTrace.median_param must be > 0 and sigma >= 0")
        if self.prompt_max < 1 or self.prompt_median <= 0:
            raise ValueError("LengthTrace.prompt_max and prompt_median must be > 0")
        if self.fixed_len is not None and not 1 <= self.fixed_len <= self.max_len:
            raise ValueError(
                f"LengthTrace.fixed_len must be in [1, max_len={self.max_len}], "
                f"got {self.fixed_len}"
            )

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + response: what one KV-cache slot must hold."""
        return self.prompt_max + self.max_len


def paper_trace(max_len: int, min_len: int | None = None) -> LengthTrace:
    """The paper's trace at its "5K" / "10K" / "20K" setting (any max_len scales it);
    `min_len` replaces the trace's default shortest response."""
    scale = max_len / 20_000
    extra = {} if min_len is None else {"min_len": min_len}
    return LengthTrace(max_len=max_len, median_param=PAPER_MEDIAN_20K * scale, **extra)


def fixed_trace(length: int, prompt_len: int = 128) -> LengthTrace:
    """Every response `length` tokens and every prompt `prompt_len` tokens."""
    return LengthTrace(
        max_len=length,
        median_param=float(length),
        sigma=0.0,
        min_len=1,
        prompt_median=float(prompt_len),
        prompt_max=prompt_len,
        fixed_len=length,
    )


def sample_lengths(
    trace: LengthTrace, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draws `n` (prompt_len, response_len) pairs, int64 arrays of shape [n].

    Deterministic for a given generator state.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if trace.fixed_len is not None:
        return (
            np.full(n, trace.prompt_max, dtype=np.int64),
            np.full(n, trace.fixed_len, dtype=np.int64),
        )
    if not trace.min_len < trace.max_len:
        # The draws are continuous: an empty or one-point window would never fill.
        raise ValueError(
            f"length trace: min_len {trace.min_len} must be below max_len {trace.max_len}"
        )
    out = np.empty(0)
    while out.size < n:
        # Redraw (truncate) rather than clip, so the maximum carries no probability mass.
        draw = np.exp(np.log(trace.median_param) + trace.sigma * rng.standard_normal(2 * n))
        draw = draw[(draw >= trace.min_len) & (draw <= trace.max_len)]
        out = np.concatenate([out, draw])
    resp = np.round(out[:n]).astype(np.int64)
    prompt = np.exp(np.log(trace.prompt_median) + 0.6 * rng.standard_normal(n))
    prompt = np.clip(np.round(prompt), min(32, trace.prompt_max), trace.prompt_max).astype(np.int64)
    return prompt, resp
