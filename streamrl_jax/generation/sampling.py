"""Per-slot token sampling: greedy, temperature, top-k and top-p, with behaviour log-probs.

Every slot carries its own sampling parameters and its own request key, so one
jitted decode step serves a batch of unrelated requests. Token t of a request
is drawn with `fold_in(request_key, t)`: the draw depends only on the
request's seed and the token index, never on the slot, the batch-mates or the
time of admission.

The draw is an inverse-CDF lookup with one uniform per row (two levels, blocks
of `_BLOCK` entries, so each float32 prefix sum adds at most a few hundred
terms). The Gumbel-max `jax.random.categorical` it replaced drew one threefry
number per vocabulary entry, a large share of a decode step at a 49k vocabulary on
CPU (measured: docs/generation.md, "Second pass (issue 16)"). Same distribution,
different tokens for a given seed.

Two log-probs are returned per token:

* `model_logp`: log_softmax(logits)[token], the *unmodified* model
  distribution (temperature 1, no filtering). This is the behaviour log-prob
  the trainer's importance ratio uses, because it is what
  `Llama.token_logprobs` recomputes for the same weights.
* `sampling_logp`: the log-prob under the distribution actually sampled from
  (after temperature and top-k/top-p); 0 for greedy rows.

`top_logprobs` gives each row's most likely tokens under the first of the two (what an
engine with `EngineConfig.top_logprobs` returns beside each token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_MASK = 0xFFFFFFFF


def request_key_data(seed: int) -> np.ndarray:
    """Threefry key data u32[2] of a request seed (= `jax.random.PRNGKey(seed)` for
    seeds below 2**32; 64-bit seeds keep their high word)."""
    seed = int(seed)
    return np.array([(seed >> 32) & _MASK, seed & _MASK], dtype=np.uint32)


_BLOCK = 256


def argmax(x_BxV: jax.Array) -> jax.Array:
    """First index of each row's maximum (as `jnp.argmax`; XLA:CPU's variadic-reduce
    argmax measured slower than this max + min over matching indices at 49k entries:
    docs/generation.md, "Second pass (issue 16)")."""
    v = x_BxV.shape[-1]
    is_max = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, jnp.arange(v, dtype=jnp.int32), v - 1), axis=-1)


def _last_positive(x_BxN: jax.Array) -> jax.Array:
    n = x_BxN.shape[-1]
    return jnp.max(jnp.where(x_BxN > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)


def inverse_cdf(logits_BxV: jax.Array, u_B: jax.Array) -> jax.Array:
    """The token whose probability interval holds `u_B` (in [0, 1)) under
    softmax(logits) per row; -inf logits are never picked.

    Two levels: the block (of `_BLOCK` entries) whose mass interval holds u, then
    the entry within it. Entries of zero probability have empty intervals (the
    `<=` counts skip them); a count that runs past the end through rounding is
    clamped to the last entry (block) of positive probability.
    """
    b, v = logits_BxV.shape
    nb = -(-v // _BLOCK)
    p = jnp.exp(logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
    block_mass = jnp.sum(p, axis=-1)
    block_cum = jnp.cumsum(block_mass, axis=-1)
    target = u_B * block_cum[:, -1]
    blk = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), _last_positive(block_mass))
    row = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]
    before = jnp.take_along_axis(block_cum - block_mass, blk[:, None], axis=1)[:, 0]
    within = jnp.cumsum(row, axis=-1)
    idx = jnp.minimum(jnp.sum(within <= (target - before)[:, None], axis=-1), _last_positive(row))
    return (blk * _BLOCK + idx).astype(jnp.int32)


def _filter(scaled_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then top-p, set to -inf."""
    v = scaled_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)  # descending
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)
    sorted_k = jnp.where(sorted_BxV >= kth_Bx1, sorted_BxV, -jnp.inf)
    probs = jax.nn.softmax(sorted_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p_B[:, None]) & jnp.isfinite(sorted_k)  # a prefix, >= 1 entry
    n_keep_B = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    thr_Bx1 = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)
    thr_Bx1 = jnp.maximum(thr_Bx1, kth_Bx1)
    return jnp.where(scaled_BxV >= thr_Bx1, scaled_BxV, -jnp.inf)


def sampling_logits(
    logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """The logits of the sampling distribution: filter(logits / temperature).

    Rows with temperature 0 (greedy) are only filtered, never divided. The sort
    behind top-k/top-p runs only when some row asks for a filter.
    """
    temp_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    scaled = logits_BxV.astype(jnp.float32) / temp_B[:, None]
    needs_filter = jnp.any((top_k_B > 0) | (top_p_B < 1.0))
    return jax.lax.cond(needs_filter, _filter, lambda s, k, p: s, scaled, top_k_B, top_p_B)


def sample_tokens(
    logits_BxV: jax.Array,
    key_data_Bx2: jax.Array,
    position_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
      logits_BxV: f32 next-token logits of the model.
      key_data_Bx2: u32 threefry key data of each row's request.
      position_B: i32 index of the token being drawn within its response.
      temperature_B: f32, 0 = greedy.
      top_k_B: i32, 0 = off.
      top_p_B: f32 in (0, 1], 1 = off.

    Returns:
      (tokens i32[B], model_logp f32[B], sampling_logp f32[B]); see the module
      docstring for the two log-probs.
    """
    logits = logits_BxV.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    argmax_B = argmax(logits)

    def uniform(key_data, position):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
        return jax.random.uniform(key)

    def sampled(logits):
        filtered_BxV = sampling_logits(logits, temperature_B, top_k_B, top_p_B)
        drawn_B = inverse_cdf(filtered_BxV, jax.vmap(uniform)(key_data_Bx2, position_B))
        tokens_B = jnp.where(greedy_B, argmax_B, drawn_B).astype(jnp.int32)
        slogp_B = _pick(jax.nn.log_softmax(filtered_BxV, axis=-1), tokens_B)
        return tokens_B, jnp.where(greedy_B, 0.0, slogp_B)

    def all_greedy(logits):
        return argmax_B, jnp.zeros(argmax_B.shape, jnp.float32)

    # The filtered softmax and the draw cost more than the argmax at batch 8+ on CPU;
    # an all-greedy batch skips them.
    tokens_B, sampling_logp_B = jax.lax.cond(jnp.all(greedy_B), all_greedy, sampled, logits)
    model_logp_B = _pick(jax.nn.log_softmax(logits, axis=-1), tokens_B)
    return tokens_B, model_logp_B, sampling_logp_B


def _pick(logp_BxV: jax.Array, tokens_B: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


def top_logprobs(logits_BxV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` most likely tokens of each row and their log-probs under the unmodified
    model distribution (as `sample_tokens`' `model_logp`: temperature 1, no filtering),
    most likely first (ties: the lower id first).

    Returns:
      (ids i32[B, k], logp f32[B, k]).
    """
    logp_BxK, ids_BxK = jax.lax.top_k(jax.nn.log_softmax(logits_BxV.astype(jnp.float32), -1), k)
    return ids_BxK.astype(jnp.int32), logp_BxK
