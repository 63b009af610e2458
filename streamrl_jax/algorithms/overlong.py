"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): a length-aware reward term.

With response cap `L_max` (`generation.max_new_tokens`), buffer `L_buf`
(`algorithm.overlong_buffer`) and maximum penalty `p` (`algorithm.overlong_penalty`),
a response of `L` tokens gets

    R_len(L) = 0                                  if L <= L_max - L_buf
             = -(L - (L_max - L_buf)) / L_buf * p  if L_max - L_buf < L < L_max
             = -p                                 if L >= L_max, or the response was cut
                                                  at the cap (truncated)

added to its outcome reward before the advantage (`pipeline/micro_batches.py`
`pack_groups`; dynamic sampling judges a group's variance on the same sum).
Host-side numpy: rewards are scored on the host as samples arrive.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.config import AlgorithmSection


def soft_overlong_penalty(
    lengths_B: np.ndarray, truncated_B: np.ndarray, *, max_len: int, buffer: int, penalty: float
) -> np.ndarray:
    """R_len per sample, f32[B] in [-penalty, 0] (the module docstring's eq. 13).

    Args:
      lengths_B: response lengths in tokens.
      truncated_B: True for a response cut at the cap (no end-of-sequence token).
      max_len: the response cap L_max.
      buffer: L_buf, 1 <= buffer <= max_len.
      penalty: the maximum penalty p >= 0.
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer must be in [1, {max_len}] (the cap), got {buffer}")
    lengths = np.asarray(lengths_B, np.float32)
    over = np.clip((lengths - (max_len - buffer)) / buffer, 0.0, 1.0)
    over = np.where(np.asarray(truncated_B, bool), 1.0, over)
    return (-penalty * over).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """`soft_overlong_penalty` bound to a run's cap, buffer and maximum penalty."""

    max_len: int
    buffer: int
    penalty: float

    def __call__(self, lengths_B: np.ndarray, truncated_B: np.ndarray) -> np.ndarray:
        return soft_overlong_penalty(
            lengths_B, truncated_B, max_len=self.max_len, buffer=self.buffer, penalty=self.penalty
        )

    @classmethod
    def from_config(cls, a: AlgorithmSection, max_new_tokens: int) -> OverlongPenalty | None:
        """The run's penalty (`algorithm.overlong_buffer` > 0; responses capped at
        `generation.max_new_tokens`), else None."""
        if a.overlong_buffer == 0:
            return None
        return cls(max_new_tokens, a.overlong_buffer, a.overlong_penalty)
