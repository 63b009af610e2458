"""Explicit KV cache pytree with one slot per generation sequence.

Slot b holds the keys/values of positions 0 .. lengths[b]-1 of its sequence
(prompt, then generated tokens). Positions past `lengths[b]` may hold stale
values from an earlier occupant; attention masks them by position, so a slot
is reused without clearing it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from streamrl_jax.model.config import ModelConfig

# Logical axis names of the cache arrays (mapped by the generation rule table).
KV_AXES = ("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim")
LENGTHS_AXES = ("cache_batch",)


@struct.dataclass
class KVCache:
    """Per-slot keys and values of every layer.

    Attributes:
      k: keys, compute dtype [L, B, S, K, D] (B slots, S max total length).
      v: values, same shape as `k`.
      lengths: i32[B], tokens stored in each slot = position of its next token.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, num_slots: int, max_length: int) -> KVCache:
    """An all-zero cache; call under `jax.jit(..., out_shardings=...)` to place it."""
    if max_length > cfg.max_position_embeddings:
        raise ValueError(
            f"KV cache max_length {max_length} exceeds the model's context "
            f"(max_position_embeddings={cfg.max_position_embeddings})"
        )
    shape = (cfg.num_layers, num_slots, max_length, cfg.num_kv_heads, cfg.head_dim)
    # Two distinct buffers: k and v are donated (updated in place) separately.
    return KVCache(
        k=jnp.zeros(shape, cfg.jnp_dtype),
        v=jnp.zeros(shape, cfg.jnp_dtype),
        lengths=jnp.zeros((num_slots,), jnp.int32),
    )
