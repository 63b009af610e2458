"""Target log-probs and entropies over the vocabulary in blocks (the trainer's head).

`token_logprobs_entropy(h, w, targets)` is what `jax.nn.log_softmax` at the
targets and the softmax entropy compute from `logits = h @ w.T`, without ever
holding a row of logits: the projection runs over `block` vocabulary entries at
a time (a [N, block] tile that stays in cache), keeping an online max, sum of
exponentials and exponential-weighted logit sum per position (the log-sum-exp
trick, streamed), and the custom backward recomputes each tile from `h` and the
saved log-sum-exp instead of storing [N, V]. This is the "cut cross-entropy"
idea (Wijmans et al., 2024) in plain JAX.

Why: with the whole [C, V] logits of a sequence chunk materialised, the log-softmax,
the entropy and their backward are passes over a buffer far larger than the caches
(C = 128, V = 49,152: 25 MB), so a narrow model's head is memory-bound. Blocked, the
head's fwd + bwd is faster at both the `tiny` model's width and SmolLM2's; measured in
docs/trainer.md, "Vocabulary head".

Gradients, with p = softmax(l), E = sum_j p_j l_j, for cotangents g (log-prob) and
k (entropy) of one position: d logp / d l_j = [j = target] - p_j and
d entropy / d l_j = -p_j (l_j - E), so dl_j = g ([j = target] - p_j) - k p_j (l_j - E);
then dh = dl @ w and dw = dl^T @ h, tile by tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 2048  # vocabulary entries per tile: [128, 2048] f32 = 1 MB (1024-8192 tried)
_PAD_LOGIT = -1e30  # padded vocabulary entries: exp() underflows to 0, finite products


def token_logprobs_entropy(
    h_NxE: jax.Array,
    w_VxE: jax.Array,
    targets_N: jax.Array,
    *,
    chunk: int = 128,
    block: int = BLOCK,
) -> tuple[jax.Array, jax.Array]:
    """(log softmax(h @ w.T)[target], entropy of softmax(h @ w.T)), both f32[N].

    Args:
      h_NxE: hidden states after the final norm (any float dtype: the matmuls run in
        it, the logits in float32, as `Llama.logits` computes them).
      w_VxE: the output projection, vocabulary-major (the tied embedding, or the
        transposed `lm_head`), cast to `h`'s dtype by the caller.
      targets_N: i32 token ids in [0, V).
      chunk: positions per tile (N need not be a multiple: padded, then dropped).
      block: vocabulary entries per tile (V need not be a multiple: the last tile is
        padded and masked).
    """
    n = h_NxE.shape[0]
    chunk = max(1, min(chunk, n))
    block = max(1, min(block, w_VxE.shape[0]))
    pad = (-n) % chunk
    h = jnp.pad(h_NxE, ((0, pad), (0, 0))).reshape(-1, chunk, h_NxE.shape[1])
    targets = jnp.pad(targets_N, (0, pad)).reshape(-1, chunk)
    logp, entropy = _head(h, w_VxE, targets, block)
    return logp.reshape(-1)[:n], entropy.reshape(-1)[:n]


def _tiles(w_VxE: jax.Array, block: int) -> jax.Array:
    v, e = w_VxE.shape
    pad = (-v) % block
    if pad:
        w_VxE = jnp.pad(w_VxE, ((0, pad), (0, 0)))
    return w_VxE.reshape(-1, block, e)


def _tile_logits(h_CxE, w_BxE, i, block, vocab):
    logits = jnp.einsum("ce,be->cb", h_CxE, w_BxE).astype(jnp.float32)
    if vocab % block:  # only the last tile has padding
        ids = i * block + jnp.arange(block)
        logits = jnp.where(ids[None, :] < vocab, logits, _PAD_LOGIT)
    return logits


# The loops: vocabulary tiles outside, position chunks inside, so one tile of `w` is
# reused by every chunk while it is in cache, and only [chunk, block] logits exist.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head(h_KxCxE, w_VxE, targets_KxC, block):
    return _forward(h_KxCxE, w_VxE, targets_KxC, block)[0]


def _forward(h_KxCxE, w_VxE, targets_KxC, block):
    vocab = w_VxE.shape[0]
    tiles = _tiles(w_VxE, block)

    def tile(carry, xs):
        w_BxE, i = xs

        def chunk(_, ys):
            h_CxE, tg_C, m_C, s_C, u_C, t_C = ys  # running max, sum e^(l-m), sum e^(l-m) l
            l_CxB = _tile_logits(h_CxE, w_BxE, i, block, vocab)
            m_new = jnp.maximum(m_C, l_CxB.max(axis=-1))
            scale = jnp.exp(m_C - m_new)
            e_CxB = jnp.exp(l_CxB - m_new[:, None])
            s_C = s_C * scale + e_CxB.sum(axis=-1)
            u_C = u_C * scale + (e_CxB * l_CxB).sum(axis=-1)
            local = tg_C - i * block
            here = (local >= 0) & (local < block)
            picked = jnp.take_along_axis(l_CxB, jnp.clip(local, 0, block - 1)[:, None], axis=-1)
            t_C = t_C + jnp.where(here, picked[:, 0], 0.0)
            return None, (m_new, s_C, u_C, t_C)

        _, carry = jax.lax.scan(chunk, None, (h_KxCxE, targets_KxC, *carry))
        return carry, None

    zero = jnp.zeros(targets_KxC.shape, jnp.float32)
    init = (jnp.full(targets_KxC.shape, -jnp.inf, jnp.float32), zero, zero, zero)
    (m, s, u, t), _ = jax.lax.scan(tile, init, (tiles, jnp.arange(tiles.shape[0])))
    lse = m + jnp.log(s)
    mean = u / s  # E_p[logit]
    return (t - lse, lse - mean), (h_KxCxE, w_VxE, targets_KxC, lse, mean)


def _backward(block, res, cotangents):
    h_KxCxE, w_VxE, targets_KxC, lse_KxC, mean_KxC = res
    g_KxC, k_KxC = cotangents
    vocab = w_VxE.shape[0]
    tiles = _tiles(w_VxE, block)

    def tile(dh_KxCxE, xs):
        w_BxE, i = xs

        def chunk(dw_BxE, ys):
            h_CxE, tg_C, lse_C, mean_C, g_C, k_C, dh_CxE = ys
            l_CxB = _tile_logits(h_CxE, w_BxE, i, block, vocab)
            p_CxB = jnp.exp(l_CxB - lse_C[:, None])
            onehot = jnp.arange(block)[None, :] == (tg_C - i * block)[:, None]
            dl_CxB = g_C[:, None] * (onehot - p_CxB) - k_C[:, None] * p_CxB * (
                l_CxB - mean_C[:, None]
            )
            dl_CxB = dl_CxB.astype(h_CxE.dtype)
            dh_CxE = dh_CxE + jnp.einsum("cb,be->ce", dl_CxB, w_BxE)
            return dw_BxE + jnp.einsum("cb,ce->be", dl_CxB, h_CxE), dh_CxE

        ys = (h_KxCxE, targets_KxC, lse_KxC, mean_KxC, g_KxC, k_KxC, dh_KxCxE)
        dw_BxE, dh_KxCxE = jax.lax.scan(chunk, jnp.zeros_like(w_BxE), ys)
        return dh_KxCxE, dw_BxE

    dh, dw_TxBxE = jax.lax.scan(tile, jnp.zeros_like(h_KxCxE), (tiles, jnp.arange(tiles.shape[0])))
    dw_VxE = dw_TxBxE.reshape(-1, w_VxE.shape[1])[:vocab].astype(w_VxE.dtype)
    return dh, dw_VxE, None


_head.defvjp(_forward, _backward)
