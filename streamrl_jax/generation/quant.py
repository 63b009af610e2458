"""int8 rollout weights (`generation.weight_dtype="int8"`): quantise, and the int8 matmul.

The FlashRL idea: generate with a quantised copy of the policy and let the
trainer's truncated importance sampling correct the mismatch. Here the
engine's generation copy of the weights (`decoder.from_training_layout`, run
inside the engine's jitted relayout on every weight update) has every matrix
quantised symmetric per output channel: int8 values `q` and f32 scales
`scale`, w ~= q * scale, with |w - q * scale| <= scale / 2 element-wise.
Norm weights and biases stay in the compute dtype.

The matmul (`einsum`) also quantises the activation, per token (symmetric,
over the contracted features), and multiplies in int8 with an int32
accumulator (W8A8), then rescales. Why not weight-only (`x @ q.astype(f32) *
scale`): on XLA:CPU the convert is never fused into the dot; the optimised HLO
materialises an f32 copy of every weight (`wrapped_convert`) before an f32
dot, which measured far slower than the f32 weights on SmolLM2's MLP shapes
(BENCHMARKS.md "int8 rollout"; docs/benchmarks/generation.md). An int8 x int8 ->
int32 dot is emitted as a YNNPACK fusion that reads the int8 weight directly, except
with a single row, where XLA converts the weight to s32 first: a one-row matmul is
therefore padded to two rows.

The behaviour log-probs the engine records come from these logits, so they
are the int8 model's (`tests/quant_test.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

# Weight dtypes of the generation copy, as `generation.weight_dtype` names them:
# "auto" = the compute dtype (`model.generate_dtype`), "int8" = quantised as above.
WEIGHT_DTYPES = ("auto", "int8")
_QMAX = 127.0

# The contracted axes of each matrix of the decoder layout (decoder.py, `GenModel`):
# the scale has one entry per remaining (output) index, in order, which are the
# trailing axes of the matmul's output. `lm_head` is [E, V]; with tied embeddings it
# is the only copy, and its per-vocabulary-entry scale also dequantises the looked-up
# columns. An untied `embed` [V, E] is only looked up: its scale is per row.
CONTRACTED = {
    "qkv": (0,),
    "o": (0, 1, 2),
    "gate_up": (0,),
    "down": (0,),
    "embed": (1,),
    "lm_head": (0,),
}


@struct.dataclass
class QArray:
    """A matrix quantised per output channel: w ~= q * scale (broadcast over the
    contracted axes).

    Attributes:
      q: int8 values in [-127, 127], the matrix's shape.
      scale: f32 scales, the matrix's shape without the contracted axes.
    """

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def quantize(w: jax.Array, contracted: tuple[int, ...]) -> QArray:
    """Symmetric per-output-channel int8 of `w` (channels = the axes not in `contracted`).

    An all-zero channel gets scale 1 (its values stay 0)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
    q = jnp.clip(jnp.round(w / scale), -_QMAX, _QMAX).astype(jnp.int8)
    return QArray(q=q, scale=jnp.squeeze(scale, axis=contracted))


def dequantize(w: QArray, contracted: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """q * scale in `dtype` (the inverse of `quantize`, within scale / 2)."""
    return (w.q.astype(jnp.float32) * jnp.expand_dims(w.scale, contracted)).astype(dtype)


def reshape_rows(w: jax.Array | QArray, cols: int) -> jax.Array | QArray:
    """A matrix whose trailing axis (`cols` outputs) follows its contracted axes, as
    [rows, cols] (`o` [K, G, D, E] -> [K*G*D, E]); a QArray keeps its per-column scale."""
    if isinstance(w, QArray):
        return QArray(q=w.q.reshape(-1, cols), scale=w.scale)
    return w.reshape(-1, cols)


def contracted(gate_up_parts_major: bool = False) -> dict[str, tuple[int, ...]]:
    """`CONTRACTED` for a layout whose `gate_up` is [2, E, M] (`gate_up_parts_major`)."""
    return {**CONTRACTED, "gate_up": (1,)} if gate_up_parts_major else CONTRACTED


def quantize_weights(weights: dict, gate_up_parts_major: bool = False) -> dict:
    """`decoder.from_training_layout`'s output with every matrix (`CONTRACTED`) a `QArray`."""
    axes = contracted(gate_up_parts_major)

    def one(d: dict) -> dict:
        return {k: quantize(v, axes[k]) if k in axes else v for k, v in d.items()}

    out = one({k: v for k, v in weights.items() if k != "layers"})
    out["layers"] = tuple(one(layer) for layer in weights["layers"])
    return out


def _per_token(x: jax.Array, n_contracted: int) -> tuple[jax.Array, jax.Array]:
    """x quantised per leading index over its `n_contracted` trailing axes: (int8, f32 scale)."""
    axes = tuple(range(x.ndim - n_contracted, x.ndim))
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
    q = jnp.clip(jnp.round(x / scale), -_QMAX, _QMAX).astype(jnp.int8)
    return q, jnp.squeeze(scale, axis=axes)


def einsum(spec: str, x: jax.Array, w: jax.Array | QArray) -> jax.Array:
    """`jnp.einsum(spec, x, w)`; for a `QArray` the W8A8 product, in x's dtype.

    The specs of `GenModel` contract x's trailing axes against w's contracted
    axes, and w's remaining axes are the output's trailing axes (what the scale
    broadcasts against); checked here.
    """
    if not isinstance(w, QArray):
        return jnp.einsum(spec, x, w)
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    kept = "".join(c for c in ws if c not in xs)
    n_con = len(ws) - len(kept)
    lead, con = xs[: len(xs) - n_con], xs[len(xs) - n_con :]
    if con != "".join(c for c in ws if c in xs) or out != lead + kept:
        raise ValueError(f"quant.einsum: {spec!r} is not a trailing-axes contraction")
    lead_shape = x.shape[: len(lead)]
    rows = math.prod(lead_shape)
    xf = x.reshape(rows, *x.shape[len(lead) :])
    if rows == 1:  # one row: XLA:CPU would convert the int8 weight to s32 (see module doc)
        xf = jnp.concatenate([xf, xf])
    xq, xscale = _per_token(xf, n_con)
    r = next(c for c in "NRBZ" if c not in spec)  # the flattened row axis
    acc = jnp.einsum(f"{r}{con},{ws}->{r}{kept}", xq, w.q, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * xscale.reshape(-1, *([1] * len(kept))) * w.scale[None]
    return y[:rows].reshape(*lead_shape, *w.scale.shape).astype(x.dtype)
