"""Several sequences in one row: explicit RoPE positions and the shared-prefix attention rule.

A training row may hold several *units* one after another (sequence packing),
and a unit may hold one prefix followed by several continuations of it
(shared-prompt GRPO rows: the prompt once, then the G responses). Three
per-column arrays describe a row:

* `positions[b, t]`: the RoPE position of column t, its index in its own
  sequence. A continuation's positions go on from the end of its prefix, as if
  it followed the prefix directly; every continuation restarts there.
* `prefix_ids[b, t]`: which unit of row b the column belongs to (any ids that
  differ between the units of a row), -1 on padding.
* `segment_ids[b, t]`: 0 on the unit's shared prefix, k >= 1 on the columns of
  one continuation; continuation ids are unique within a row.

Attention rule: query column q sees key column k iff

    k <= q  and  prefix[k] == prefix[q] >= 0  and  segment[k] in {0, segment[q]},

that is causal attention inside the unit, where every continuation sees the
shared prefix and its own earlier tokens and never another continuation's or
another unit's. It relies on the layout putting a unit's prefix before its
continuations (`trainer/packing.py` does). A row holding one sequence (prefix 0
and segment 0 on every real column, positions 0, 1, ...) is plain causal
attention; a padding query sees no key (its output is meaningless and finite).

So a continuation's hidden states equal those of a row holding only its prefix
and itself, whatever else is packed in the row: packing changes no value and
no gradient beyond float summation order.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Segments:
    """Positions and attention structure of packed rows (module docstring).

    Attributes:
      positions: i32[B, T] RoPE position of each column.
      prefix_ids: i32[B, T] the column's unit within its row, -1 on padding.
      segment_ids: i32[B, T] 0 on a unit's shared prefix, k >= 1 on continuation k.
    """

    positions: jax.Array
    prefix_ids: jax.Array
    segment_ids: jax.Array

    def attention_mask(self) -> jax.Array:
        """bool[B, T, T], True where query t may see key s (the module's rule)."""
        t = self.positions.shape[1]
        causal_TxT = jnp.tril(jnp.ones((t, t), bool))
        unit_BxT, seg_BxT = self.prefix_ids, self.segment_ids
        same_unit = (unit_BxT[:, :, None] == unit_BxT[:, None, :]) & (unit_BxT[:, None, :] >= 0)
        visible = (seg_BxT[:, None, :] == 0) | (seg_BxT[:, None, :] == seg_BxT[:, :, None])
        return causal_TxT[None] & same_unit & visible
