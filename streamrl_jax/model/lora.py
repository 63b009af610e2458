"""LoRA adapters of the decoder blocks' matrices, in the blocks' stacked layout.

A target matrix W (stacked [L, (experts,) in..., out...], `llama.block_param_specs`) gets
two `nnx.LoRAParam`s: A [L, (experts,) in..., r] and B [L, (experts,) r, out...]; the
block computes with W + (alpha / r) * A B. B starts at zero, so a new adapter leaves the
model exactly as it was; A starts uniform in +-1/sqrt(fan_in) (as PEFT's LoRA). The
adapters are a variable type of their own, so the trainer differentiates and optimizes
them alone (`nnx.LoRAParam` is a subclass of `nnx.Param`: a filter of `nnx.LoRAParam`
takes the adapters, `nnx.Not(nnx.LoRAParam)` with `nnx.Param` the frozen base).

Why not `qwix` or `nnx.LoRALinear`: both adapt a module's own matmul (qwix intercepts a
module's dot_general and maps its operand back to a module parameter). The blocks here are
applied by one `jax.lax.scan` over stacked weights, whose slices no module owns; qwix
adapted only the tied embedding of this model (tried: docs/model.md, "LoRA"). Unstacking
the layers would lose the scan's depth-independent compile. The merge happens per layer
inside the scan (`merge_layer`), so no merged copy of the whole model is ever held in
training; the generation side merges once per weight update (`merged`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from streamrl_jax.config.sections import LORA_TARGETS

# The matrices an adapter may target, by the names users know (PEFT's q_proj ... as q ...).
TARGETS = LORA_TARGETS
# Input dimensions of each target after its leading [L, (experts,)] axes; the rest are
# output dimensions (o is [L, H, D, E]: two input dimensions).
_IN_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
RANK_AXIS = "lora_rank"


def _lead(name: str) -> int:
    """Leading axes of a block parameter's one layer that are not matrix axes (experts)."""
    return 1 if name.startswith("experts_") else 0


def param_name(target: str, num_experts: int) -> str:
    """The block parameter a target names (a MoE's gate/up/down are its experts')."""
    if num_experts and target in ("gate", "up", "down"):
        return f"experts_{target}"
    return target


def adapter_specs(
    specs: dict[str, tuple[tuple[int, ...], tuple[str, ...]]],
    targets: tuple[str, ...],
    rank: int,
    num_experts: int,
) -> dict[str, tuple[tuple[tuple[int, ...], tuple[str, ...]], ...]]:
    """{block parameter: ((A shape, A axes), (B shape, B axes))} of each target, from the
    blocks' `specs` (`llama.block_param_specs`)."""
    out = {}
    for target in targets:
        name = param_name(target, num_experts)
        shape, axes = specs[name]
        lead = 1 + _lead(name)  # [L] or [L, X]
        cut = lead + _IN_DIMS[target]
        a = (shape[:cut] + (rank,), axes[:cut] + (RANK_AXIS,))
        b = (shape[:lead] + (rank,) + shape[cut:], axes[:lead] + (RANK_AXIS,) + axes[cut:])
        out[name] = (a, b)
    return out


def init_a(key: jax.Array, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    """Block parameter `name`'s stacked A: uniform in +-1/sqrt(fan_in), fan_in the
    product of its input dimensions."""
    fan_in = math.prod(shape[1 + _lead(name) : -1])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def delta(a: jax.Array, b: jax.Array, lead: int) -> jax.Array:
    """A B over the rank, in f32: the shape of the adapted matrix ([lead..., in..., out...])."""
    lead_shape, rank = a.shape[:lead], a.shape[-1]
    ins, outs = a.shape[lead:-1], b.shape[lead + 1 :]
    a2 = a.astype(jnp.float32).reshape(*lead_shape, math.prod(ins), rank)
    b2 = b.astype(jnp.float32).reshape(*lead_shape, rank, math.prod(outs))
    return jnp.matmul(a2, b2).reshape(*lead_shape, *ins, *outs)


def _merge(weights, adapters, scale: float, stacked: bool, widen: bool) -> dict[str, jax.Array]:
    """Each adapted W + scale * A B over `weights` ([L, ...] when `stacked`), in the wider
    of W's and the adapters' dtypes when `widen`, else in W's own; exactly W while B = 0."""
    out = dict(weights)
    for name, (a, b) in adapters.items():
        w = weights[name]
        dt = jnp.promote_types(w.dtype, a.dtype) if widen else w.dtype
        d = delta(a, b, int(stacked) + _lead(name))
        out[name] = (w.astype(jnp.float32) + scale * d).astype(dt)
    return out


def merge_layer(
    weights: dict[str, jax.Array], adapters: dict[str, tuple[jax.Array, jax.Array]], scale: float
) -> dict[str, jax.Array]:
    """One layer's weights (no [L] axis) with each adapted matrix W + scale * A B, in the
    wider of W's and the adapters' dtypes (a bf16 base with f32 adapters merges in f32: a
    small update is not rounded away at the base's precision); exactly W while B is zero."""
    return _merge(weights, adapters, scale, stacked=False, widen=True)


def merged(
    stacked: dict[str, jax.Array], adapters: dict[str, tuple[jax.Array, jax.Array]], scale: float
) -> dict[str, jax.Array]:
    """`merge_layer` over the stacked [L, ...] weights (the generation side's weights and
    the export: in W's own dtype)."""
    return _merge(stacked, adapters, scale, stacked=True, widen=False)
