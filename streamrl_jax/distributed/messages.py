"""The messages a generation process sends its training process besides samples.

Decode-chunk (`generation.types.ChunkReport`, the engine's own report, relabelled
with its process) and span reports let the trainer's trace and `gen_busy` see every
instance of every process; `RoundClosed` tells it that a partial-rollout round
closed (`pipeline/rollouts/partial.py`); `GenerationFailed` is a generation process's
last word before it exits with an error, so the trainer fails naming it.

Each is a msgspec `Struct` that is its own wire schema (`wire.py` encodes and
decodes it as it is): the `Annotated` bounds are checked when a frame is
decoded, unknown fields are refused, and the tag names the type on the wire.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from streamrl_jax.generation.types import ChunkReport  # its own wire schema (tag "chunk")

__all__ = ["ChunkReport", "GenerationFailed", "RoundClosed", "SpanReport", "WireStruct"]

MAX_STR = 4096  # characters of an id, name or key path
MAX_REASON = 64 * 1024  # characters of `GenerationFailed.reason`
MAX_SPAN_ARGS = 64
MAX_GROUPS = 1 << 20  # groups one round report may name

Str = Annotated[str, msgspec.Meta(max_length=MAX_STR)]


class WireStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Base of every wire schema: frozen, unknown fields refused."""


class SpanReport(WireStruct, tag="span"):
    """A span for the trainer's trace (wall times), e.g. a weight set's arrival."""

    track: Str
    name: Str
    t0: float
    t1: float
    args: Annotated[dict[Str, float], msgspec.Meta(max_length=MAX_SPAN_ARGS)]


_Count = Annotated[int, msgspec.Meta(ge=0)]


class RoundClosed(WireStruct, tag="round"):
    """Partial rollout: every segment of this process's round `round` returned (and its
    previous round closed); the groups whose last member finished in it, and the
    process's counts at that moment (`PartialRollout.in_flight`, `regenerated`,
    `dropped`)."""

    process: int
    round: _Count
    groups: Annotated[tuple[tuple[int, int], ...], msgspec.Meta(max_length=MAX_GROUPS)]
    paused: _Count
    waiting_members: _Count
    regenerated: _Count
    dropped: _Count


class GenerationFailed(WireStruct, tag="failed"):
    """A generation process's last message before it exits with an error."""

    process: int
    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
