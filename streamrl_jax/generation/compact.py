"""Decode cost that follows the active batch: batch and length buckets for the decode chunk.

The engine keeps `num_slots` KV-cache rows of `max_total_length` positions.
Decoding all of them every step costs PTL(num_slots, max_total_length)
whatever is running. Before each chunk the host picks a *decode shape*
(`DecodeShapes.pick`):

* a batch bucket `rows` (powers of two below `num_slots`, then `num_slots`)
  that covers the running slots, padded with free slots;
* a length bucket `seq` (powers of two from `min_length`, then
  `max_total_length`) that covers every running slot's cache length plus
  the chunk's steps, so no write or attended position falls outside it;
  with every slot running, the whole cache (no copy at all: the shorter
  attention saved less than the prefix copy cost, measured).

`decode_compact` then gathers those rows' state and the first `seq` cache
positions, runs the ordinary decode chunk on that compact state (attention
reads only the `seq` prefix; matmuls run `rows` rows) and scatters the rows
back. The full shape (all slots, full length) skips the gather entirely and is
the engine's uncompacted chunk. Per-step cost then follows the active count
and the longest active sequence; the gather/scatter copy is paid once per
chunk. On XLA:CPU a row gather/scatter is far slower than a contiguous slice
(docs/generation.md, "Decode shapes"), so the copy is worth it when it cuts
rows, not when it only cuts positions of every row.

Padding rows are free slots: inactive, so they compute but do not advance,
and what they write lands in rows no sample owns. Positions are clamped inside
`seq` by `GenModel.decode`; finish codes use the full `max_total_length`.

Executables: one per shape used, at most `DecodeShapes.all()`: every length
bucket for each batch bucket below `num_slots`, and the full shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from streamrl_jax.generation import slots as slots_lib
from streamrl_jax.generation.decoder import GenModel, cache_prefix, set_cache_prefix


def doubling(start: int, stop: int) -> tuple[int, ...]:
    """start, 2 start, 4 start, ... below `stop`, then `stop` (start clipped to [1, stop]);
    a bucket above 3/4 of `stop` is left out (it would save under a quarter of a step and
    cost one more compilation)."""
    out, b = [], max(1, min(start, stop))
    while b < stop:
        if 4 * b <= 3 * stop:
            out.append(b)
        b *= 2
    return (*out, stop)


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    """The decode chunk's (batch, length) buckets of one engine.

    Attributes:
      num_slots: KV-cache rows.
      max_length: KV-cache positions (`max_total_length`).
      chunk_steps: decode steps per chunk (each may write one position).
      min_length: smallest length bucket.
      enabled: False = always the full shape (every slot, every position).
    """

    num_slots: int
    max_length: int
    chunk_steps: int
    min_length: int = 32
    enabled: bool = True

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return doubling(1, self.num_slots) if self.enabled else (self.num_slots,)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        return doubling(self.min_length, self.max_length) if self.enabled else (self.max_length,)

    def all(self) -> list[tuple[int, int]]:
        """Every (batch, length) shape `pick` can return (all slots: the whole cache)."""
        part = [(b, s) for b in self.batch_buckets[:-1] for s in self.length_buckets]
        return [*part, (self.num_slots, self.max_length)]

    def pick(self, running: Sequence[int], lengths: Sequence[int]) -> tuple[np.ndarray, int]:
        """Rows to decode (ascending slot ids, running slots padded with free ones) and the
        length bucket, for running slots `running` whose caches hold at most `lengths`
        positions each (an upper bound is fine)."""
        n = len(running)
        if n == 0:
            raise ValueError("DecodeShapes.pick: no running slot")
        rows = next(b for b in self.batch_buckets if b >= n)
        if rows == self.num_slots:  # no copy: see the module docstring
            return np.arange(rows, dtype=np.int32), self.max_length
        need = max(lengths) + self.chunk_steps
        seq = next((s for s in self.length_buckets if s >= need), self.max_length)
        taken = set(running)
        free = [i for i in range(self.num_slots) if i not in taken][: rows - n]
        return np.asarray(sorted([*running, *free]), np.int32), seq


def _take(x: jax.Array, rows: jax.Array, full: bool) -> jax.Array:
    return x if full else jnp.take(x, rows, axis=0, unique_indices=True, indices_are_sorted=True)


def _put(dst: jax.Array, rows: jax.Array, src: jax.Array, full: bool) -> jax.Array:
    if full:
        return jax.lax.dynamic_update_slice(dst, src, (0,) * dst.ndim)
    return dst.at[rows].set(src, unique_indices=True, indices_are_sorted=True)


def decode_compact(
    model: GenModel,
    state: slots_lib.SlotState,
    rows: jax.Array,
    steps: int,
    seq: int,
    top: int = 0,
) -> tuple[slots_lib.SlotState, slots_lib.ChunkOut]:
    """`slots.decode_chunk` on rows `rows` (i32[R], ascending, distinct) and the first
    `seq` cache positions (`top`: as there); returns the full state and the chunk's
    outputs for those rows (row i of the outputs is slot rows[i])."""
    cache = state.cache
    b, s = cache.num_slots, cache.max_length
    all_rows = rows.shape[0] == b  # ascending and distinct: rows == arange(b)
    if all_rows and seq == s:
        return slots_lib.decode_chunk(model, state, steps, top=top)
    ka = cache.k_seq_axis
    k = tuple(_take(cache_prefix(x, ka, seq), rows, all_rows) for x in cache.k)
    v = tuple(_take(cache_prefix(x, 2, seq), rows, all_rows) for x in cache.v)
    per_row = state.replace(cache=None)
    small = jax.tree.map(lambda x: _take(x, rows, all_rows), per_row)
    small = small.replace(
        cache=cache.replace(k=k, v=v, lengths=_take(cache.lengths, rows, all_rows))
    )
    small, out = slots_lib.decode_chunk(model, small, steps, max_total=s, top=top)

    def back(full_x: jax.Array, small_x: jax.Array, seq_axis: int) -> jax.Array:  # k or v
        if all_rows:
            return jax.lax.dynamic_update_slice(full_x, small_x, (0, 0, 0, 0))
        return set_cache_prefix(
            full_x, rows, small_x, seq_axis, unique_indices=True, indices_are_sorted=True
        )

    new_cache = cache.replace(
        k=tuple(back(f, x, ka) for f, x in zip(cache.k, small.cache.k, strict=True)),
        v=tuple(back(f, x, 2) for f, x in zip(cache.v, small.cache.v, strict=True)),
        lengths=_put(cache.lengths, rows, small.cache.lengths, all_rows),
    )
    rest = jax.tree.map(lambda f, x: _put(f, rows, x, all_rows), per_row, small.replace(cache=None))
    return rest.replace(cache=new_cache), out
