"""Pure functions of one Llama-family decoder block: RMSNorm, RoPE, GQA attention, SwiGLU.

Shapes use single letters: B batch, T query length, S key length (or cache
length), E width, H query heads, K key/value heads, G = H // K, D head width,
M SwiGLU width. Matmuls run in the compute dtype; RMSNorm statistics and the
attention softmax run in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from streamrl_jax import sharding
from streamrl_jax.model.config import ModelConfig

_MASK_VALUE = -1e30  # finite, so a fully masked (padding) query row gives no NaN


def rms_norm(x_BxTxE: jax.Array, scale_E: jax.Array, eps: float) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * scale, statistics in float32."""
    x32 = x_BxTxE.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + eps)
    scale = scale_E.astype(jnp.float32).reshape((1,) * (x32.ndim - 1) + (-1,))
    return (y * scale).astype(x_BxTxE.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """Inverse frequencies theta^(-2i/D), with the configured scaling; `local`: those of
    the sliding-window layers (`rope_local_theta`, unscaled)."""
    d = cfg.head_dim
    exponents = jnp.arange(0, d, 2, dtype=jnp.float32) / d
    if local and cfg.rope_local_theta is not None:
        return 1.0 / (cfg.rope_local_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # Llama-3.1: long wavelengths are divided by `factor`, short ones kept, and the
    # band between them is interpolated smoothly (transformers' _compute_llama3_parameters).
    old_ctx = rs.original_max_position_embeddings
    low_wavelen = old_ctx / rs.low_freq_factor
    high_wavelen = old_ctx / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions_BxT: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables f32[B, T, D] for the half-split (HF "rotate_half") convention."""
    angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxNxD: jax.Array, cos_BxTxD: jax.Array, sin_BxTxD: jax.Array) -> jax.Array:
    """x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]."""
    x32 = x_BxTxNxD.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x32 * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
    return out.astype(x_BxTxNxD.dtype)


def attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    mask_BxTxS: jax.Array,
    *,
    causal_block: int = 0,
) -> jax.Array:
    """Grouped-query softmax attention; `mask` True where a query may see a key (a
    query that sees no key, e.g. padding, gets 0).

    `causal_block` > 0 (the caller's promise: S == T and `mask` is within the causal
    triangle, query t sees no key after t): queries run in blocks of that many rows and
    each block only against the keys up to its last row, so the masked upper triangle
    is skipped, not computed and masked (at T = 4 blocks, 10/16 of the work).
    """
    b, t, h, d = q_BxTxHxD.shape
    k_heads = k_BxSxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, k_heads, h // k_heads, d)
    if 0 < causal_block < t:
        if k_BxSxKxD.shape[1] != t:
            raise ValueError(
                f"causal_block needs as many keys as queries, got {k_BxSxKxD.shape[1]} and {t}"
            )
        out = _attend_causal(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, causal_block)
    else:
        out = _attend(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS)
    return out.reshape(b, t, h, d)


def _probs(q, k, mask):
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    sees_a_key = jnp.any(mask, axis=-1)[:, None, None, :, None]
    return jax.nn.softmax(scores, axis=-1) * sees_a_key  # a query that sees none: 0


@jax.custom_vjp
def _attend(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    """softmax(q k^T / sqrt(D), masked) v, with a hand-written backward: the softmax's
    derivative from the probabilities alone (masked entries are 0 there, so the mask is
    not applied again), in float32."""
    return _attend_fwd(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS)[0]


def _attend_fwd(q, k, v, mask):
    probs = checkpoint_name(_probs(q, k, mask), "attention_probs")
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out, (q, k, v, probs)


def _attend_bwd(res, dout_BxTxKxGxD):
    return (*_attend_grads(*res, dout_BxTxKxGxD), None)


def _attend_grads(q, k, v, probs, dout_BxTxKxGxD):
    dv = jnp.einsum("bkgts,btkgd->bskd", probs.astype(v.dtype), dout_BxTxKxGxD)
    dprobs = jnp.einsum("btkgd,bskd->bkgts", dout_BxTxKxGxD, v).astype(jnp.float32)
    dscores = probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True))
    dscores = (dscores / math.sqrt(q.shape[-1])).astype(q.dtype)
    dq = jnp.einsum("bkgts,bskd->btkgd", dscores, k)
    dk = jnp.einsum("bkgts,btkgd->bskd", dscores, q)
    return dq, dk, dv


_attend.defvjp(_attend_fwd, _attend_bwd)


def _query_blocks(t: int, rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + rows, t)) for start in range(0, t, rows)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend_causal(q_BxTxKxGxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, rows):
    """`_attend` with a mask inside the causal triangle: the query block [s, e) is
    computed against keys [0, e) only (static slices; one probability array per block,
    each saved for the backward under the same name)."""
    return _attend_causal_fwd(q_BxTxKxGxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, rows)[0]


def _attend_causal_fwd(q, k, v, mask, rows):
    outs, probs = [], []
    for s, e in _query_blocks(q.shape[1], rows):
        p = checkpoint_name(_probs(q[:, s:e], k[:, :e], mask[:, s:e, :e]), "attention_probs")
        outs.append(jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v[:, :e]))
        probs.append(p)
    return jnp.concatenate(outs, axis=1), (q, k, v, tuple(probs))


def _attend_causal_bwd(rows, res, dout_BxTxKxGxD):
    q, k, v, probs = res
    dq = []
    dk = jnp.zeros(k.shape, jnp.float32)  # key gradients summed over the query blocks
    dv = jnp.zeros(v.shape, jnp.float32)
    for (s, e), p in zip(_query_blocks(q.shape[1], rows), probs, strict=True):
        dq_s, dk_s, dv_s = _attend_grads(q[:, s:e], k[:, :e], v[:, :e], p, dout_BxTxKxGxD[:, s:e])
        dq.append(dq_s)
        dk = dk.at[:, :e].add(dk_s.astype(jnp.float32))
        dv = dv.at[:, :e].add(dv_s.astype(jnp.float32))
    return jnp.concatenate(dq, axis=1), dk.astype(k.dtype), dv.astype(v.dtype), None


_attend_causal.defvjp(_attend_causal_fwd, _attend_causal_bwd)


def sequence_parallel(h_BxTxE: jax.Array, cfg: ModelConfig, gather: bool = False) -> jax.Array:
    """With `cfg.sequence_parallel` (in a trainer's step, `sharding.constrain`): the
    residual stream sequence-sharded, or gathered along the sequence (`gather`) where a
    normalised input enters the tensor-parallel projections; `h` itself otherwise."""
    if not cfg.sequence_parallel:
        return h_BxTxE
    return sharding.constrain(h_BxTxE, sharding.GATHERED if gather else sharding.ACTIVATION)


def qkv(
    x_BxTxE: jax.Array, p: dict[str, jax.Array], cfg: ModelConfig, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pre-norm q/k/v projections with RoPE applied to q and k."""
    h = sequence_parallel(rms_norm(x_BxTxE, p["attn_norm"], cfg.rms_norm_eps), cfg, gather=True)
    q = jnp.einsum("bte,ehd->bthd", h, p["q"].astype(h.dtype))
    k = jnp.einsum("bte,ekd->btkd", h, p["k"].astype(h.dtype))
    v = jnp.einsum("bte,ekd->btkd", h, p["v"].astype(h.dtype))
    if cfg.qkv_bias:
        q = q + p["q_bias"].astype(q.dtype)[None, None]
        k = k + p["k_bias"].astype(k.dtype)[None, None]
        v = v + p["v_bias"].astype(v.dtype)[None, None]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    if cfg.q_prescale is not None:  # attention scale other than 1/sqrt(D) (Gemma 3)
        q = q * jnp.asarray(cfg.q_prescale, q.dtype)
    return q, apply_rope(k, cos, sin), v


@jax.custom_vjp
def swiglu(h_NxE: jax.Array, gate_ExM: jax.Array, up_ExM: jax.Array, down_MxE: jax.Array):
    """The SwiGLU MLP (silu(h gate) * (h up)) down over N rows, with a hand-written
    backward.

    Autodiff's backward fused the silu derivative and the gate-times-up product into
    the transposes that feed the weight-gradient matmuls (h^T dg, a^T dy): XLA:CPU wrote
    those [M, N] operands element by element from strided reads (their share of a
    SmolLM2 train step: docs/trainer.md, "Where the step goes"). Here the elementwise
    results are materialised row-major first, so the transposes are plain copies.
    Residuals: h and the two projections (a is recomputed).
    """
    return _swiglu_fwd(h_NxE, gate_ExM, up_ExM, down_MxE)[0]


def _swiglu_fwd(h, gate, up, down):
    g, u = h @ gate, h @ up
    return (jax.nn.silu(g) * u) @ down, (h, g, u, gate, up, down)


def _swiglu_bwd(res, dy_NxE):
    h, g, u, gate, up, down = res
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    da = dy_NxE @ down.T
    dg = da * u * (sig * (1 + g * (1 - sig)))  # d silu(g) / dg = s (1 + g (1 - s))
    du = da * silu
    a, dg, du = jax.lax.optimization_barrier((silu * u, dg, du))
    dh = dg @ gate.T + du @ up.T
    return dh, h.T @ dg, h.T @ du, a.T @ dy_NxE


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Routing(NamedTuple):
    """A mixture-of-experts layer's routing of its tokens: the experts each went to,
    i32[..., k], the router's probabilities over all experts, f32[..., X], and with
    routing replay whether a token's replayed experts differ from this router's own top
    k, bool[...] (None without replay)."""

    experts: jax.Array
    probs: jax.Array
    flipped: jax.Array | None = None


def attn_out_and_mlp(
    x_BxTxE: jax.Array,
    attn_BxTxHxD: jax.Array,
    p: dict[str, jax.Array],
    cfg: ModelConfig,
    replay_BxTxK: jax.Array | None = None,
) -> tuple[jax.Array, Routing | None]:
    """Residual output projection, then the pre-norm gated MLP residual (SwiGLU, or
    GeGLU; with `sandwich_norms` each branch's output normalised before its add).

    Returns the block's output and, for a mixture of experts, its `Routing` (None for a
    dense MLP); `replay_BxTxK`: recorded experts to use instead of routing (`route`)."""
    dt = x_BxTxE.dtype
    a = jnp.einsum("bthd,hde->bte", attn_BxTxHxD, p["o"].astype(dt))
    a = sequence_parallel(a, cfg)  # the output projection's sum lands sequence-sharded
    if cfg.sandwich_norms:
        a = rms_norm(a, p["post_attn_norm"], cfg.rms_norm_eps)
    x = x_BxTxE + a
    h = sequence_parallel(rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), cfg, gather=True)
    b, t, e = h.shape
    routing = None
    if cfg.num_experts:
        replay = None if replay_BxTxK is None else replay_BxTxK.reshape(b * t, -1)
        y, routing = moe_mlp(h.reshape(b * t, e), p, cfg, replay)
        y = y.reshape(b, t, e)
        routing = Routing(
            routing.experts.reshape(b, t, -1),
            routing.probs.reshape(b, t, -1),
            None if routing.flipped is None else routing.flipped.reshape(b, t),
        )
    else:
        w = [p[name].astype(dt) for name in ("gate", "up", "down")]
        y = gated_mlp(h.reshape(b * t, e), *w, cfg.mlp_act).reshape(b, t, e)
    # whole, then sequence-sharded: the backward gathers the cotangent before the
    # [rows, E] reshape instead of re-laying it out through a replicated copy (XLA:CPU
    # warned of that); XLA may fuse the forward's all-reduce and slice into a reduce-scatter
    y = sequence_parallel(sequence_parallel(y, cfg, gather=True), cfg)
    if cfg.sandwich_norms:
        y = rms_norm(y, p["post_mlp_norm"], cfg.rms_norm_eps)
    return x + y, routing


def gate_activation(x: jax.Array, act: str) -> jax.Array:
    """The gated MLP's activation `ModelConfig.mlp_act`: silu (SwiGLU) or tanh GELU (GeGLU)."""
    return jax.nn.silu(x) if act == "silu" else jax.nn.gelu(x, approximate=True)


def gated_mlp(h_NxE, gate_ExM, up_ExM, down_MxE, act: str) -> jax.Array:
    """act(h gate) * (h up) down: SwiGLU (`swiglu`, its own backward) or GeGLU (tanh
    GELU, autodiff)."""
    if act == "silu":
        return swiglu(h_NxE, gate_ExM, up_ExM, down_MxE)
    return (gate_activation(h_NxE @ gate_ExM, act) * (h_NxE @ up_ExM)) @ down_MxE


def block(
    x_BxTxE: jax.Array,
    p: dict[str, Any],
    cfg: ModelConfig,
    cos: jax.Array,
    sin: jax.Array,
    mask_BxTxT: jax.Array,
    replay_BxTxK: jax.Array | None = None,
) -> tuple[jax.Array, Routing | None]:
    """One decoder block over a full sequence (`mask` within the causal triangle): its
    output and a MoE's `Routing` (`attn_out_and_mlp`)."""
    q, k, v = qkv(x_BxTxE, p, cfg, cos, sin)
    attn = attention(q, k, v, mask_BxTxT, causal_block=cfg.causal_block)
    return attn_out_and_mlp(x_BxTxE, attn, p, cfg, replay_BxTxK)


def route(
    h_NxE: jax.Array, router_ExX: jax.Array, cfg: ModelConfig, replay_NxK: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, Routing]:
    """The experts each token goes to and their weights: softmax over the router's
    logits (f32), the top `experts_per_token`, renormalised when `norm_topk_prob`.

    `replay_NxK` (routing replay): experts recorded where the tokens were generated,
    used instead of the top k on every row whose ids are all < num_experts (a row of
    `routes.Spec.no_route` is routed here); the weights are this router's probabilities of
    the experts used, so the router still gets its gradient.

    Returns:
      (i32[N, k] expert ids, f32[N, k] weights, the `Routing`).
    """
    logits = (h_NxE @ router_ExX.astype(h_NxE.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)
    experts, flipped = experts.astype(jnp.int32), None
    if replay_NxK is not None:
        replay = replay_NxK.astype(jnp.int32)
        recorded = jnp.all(replay < cfg.num_experts, axis=-1, keepdims=True)
        differ = jnp.any(jnp.sort(replay, axis=-1) != jnp.sort(experts, axis=-1), axis=-1)
        flipped = differ & recorded[:, 0]
        experts = jnp.where(recorded, replay, experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, Routing(experts, probs, flipped)


def router_stats(experts_xK: jax.Array, probs_xX: jax.Array, valid_x: jax.Array) -> jax.Array:
    """The load-balancing statistics of `route`'s choices over the valid tokens (any
    leading axes x): f32[2, X], the (token, expert) assignments per expert and the
    probabilities summed."""
    valid = valid_x.astype(jnp.float32)[..., None]
    hits = jax.nn.one_hot(experts_xK, probs_xX.shape[-1], dtype=jnp.float32).sum(axis=-2)
    tokens = tuple(range(valid.ndim - 1))
    return jnp.stack([jnp.sum(hits * valid, axis=tokens), jnp.sum(probs_xX * valid, axis=tokens)])


def router_aux_loss(stats_2xX: jax.Array, tokens: jax.Array) -> jax.Array:
    """Switch Transformer's load-balancing loss as transformers computes it over all
    layers' tokens at once: X * sum_x f_x P_x, f_x the share of (token, expert)
    assignments to x and P_x its mean routing probability, per routed token (`tokens`:
    valid tokens times layers). k for a perfectly balanced router."""
    counts, probs = stats_2xX[0], stats_2xX[1]
    n = jnp.maximum(tokens, 1.0)
    return counts.shape[0] * jnp.sum((counts / n) * (probs / n))


def moe_mlp(
    h_NxE: jax.Array, p: dict[str, Any], cfg: ModelConfig, replay_NxK: jax.Array | None = None
) -> tuple[jax.Array, Routing]:
    """The mixture-of-experts MLP, dropless: every token's k (token, expert) pairs are
    sorted by expert and each expert's SwiGLU runs on its rows as one grouped matmul
    (`jax.lax.ragged_dot`: no capacity, no token dropped, no padding to a capacity);
    the outputs are weighted by the routing weights and summed back per token.

    Returns the output and the tokens' `Routing` (`replay_NxK`: as in `route`)."""
    n, e = h_NxE.shape
    k, dt = cfg.experts_per_token, h_NxE.dtype
    experts_NxK, weights_NxK, routing = route(h_NxE, p["router"], cfg, replay_NxK)
    flat = experts_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k  # the token of each sorted (token, expert) pair
    rows = jnp.take(h_NxE, token, axis=0)
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, p["experts_gate"].astype(dt), sizes)
    up = jax.lax.ragged_dot(rows, p["experts_up"].astype(dt), sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["experts_down"].astype(dt), sizes)
    w = jnp.take(weights_NxK.reshape(-1), order).astype(dt)
    y = jnp.zeros((n, e), dt).at[token].add(out * w[:, None])
    return y, routing
