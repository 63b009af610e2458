"""The messages a generation process sends its training process besides samples.

Decode-chunk and span reports let the trainer's trace and `gen_busy` see every
instance of every process; `GenerationFailed` is a generation process's last
word before it exits with an error, so the trainer fails naming it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChunkReport:
    """One decode chunk of a generation instance (wall times), for `gen_busy` and the trace."""

    instance: str  # "p<process>.<instance>"
    t0: float
    t1: float
    tokens: int
    running: int
    steps: int
    prefilled: int


@dataclasses.dataclass(frozen=True)
class SpanReport:
    """A span for the trainer's trace (wall times), e.g. a weight set's arrival."""

    track: str
    name: str
    t0: float
    t1: float
    args: dict[str, float]


@dataclasses.dataclass(frozen=True)
class GenerationFailed:
    """A generation process's last message before it exits with an error."""

    process: int
    reason: str
