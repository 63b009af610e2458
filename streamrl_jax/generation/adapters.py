"""Unmerged LoRA adapters in the engine: a table of adapter slots, one adapter per row.

With `EngineConfig.adapters = N > 0` the engine keeps the base weights once and, in
each layer's weight dict, a table of N adapters beside the fused matrices they adapt
(`decoder.from_training_layout`): for a fused matrix `name` (qkv, o, gate_up, down)

* `name_lora_a` [N, in..., R] and `name_lora_b` [N, R, out...], B already scaled by
  alpha / r; for `qkv` and `gate_up` the targeted parts' adapters side by side along
  R (q, k and v's A concatenated, each B zero outside its own part of the fused
  output), so one pair of products serves the fused matrix.

Every row (a prefill row, a decode slot) names its adapter slot (`SlotState.adapter`,
`GenerationRequest.adapter`; -1: the base model alone) and its output is

    x W + (x A[slot]) B[slot]

computed without gathering: x is multiplied by every slot's A at once ([rows, N, R]),
the other slots' columns are zeroed by the row's one-hot selector, and the product
contracts (slot, rank) against all the B's as one matrix of N * R rows. For the few
adapters of a few learners this reads each adapter once per step and adds
2 N R (in + out) FLOPs a row, against the in x out of the base matmul; a gathered
per-row A and B (S-LoRA's BGMV) would move rows x R x (in + out) elements instead,
which is more for any batch larger than N. Rows of different adapters therefore
decode in one batch, and a row's result does not depend on its batch-mates'
adapters (tested: `tests/adapters_test.py`).

A mixture of experts' experts are not adapted here (their matmuls are grouped by
expert, not by row): an engine with adapter slots refuses expert targets; its
attention targets work, and an engine without slots merges every target
(`EngineConfig.adapters = 0`, the default: `lora.merged` at each weight update).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from streamrl_jax.model import lora
from streamrl_jax.model.config import ModelConfig

# The fused matrices of the generation layout, each with the training targets it holds
# (in the order of its parts).
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
SLOT_AXIS, RANK_AXIS = "lora_slot", "lora_rank"
# Logical axes of a table's A and B (decoder.weight_shardings): B shares its matrix's
# output sharding (tp on kv heads / mlp), A its input's, so the base's partitioning holds.
AXES = {
    "qkv_lora_a": (SLOT_AXIS, "embed", RANK_AXIS),
    "qkv_lora_b": (SLOT_AXIS, RANK_AXIS, "kv_heads", "parts", "head_dim"),
    "o_lora_a": (SLOT_AXIS, "kv_heads", "parts", "head_dim", RANK_AXIS),
    "o_lora_b": (SLOT_AXIS, RANK_AXIS, "embed"),
    "gate_up_lora_a": (SLOT_AXIS, "embed", RANK_AXIS),
    "gate_up_lora_b": (SLOT_AXIS, RANK_AXIS, "parts", "mlp"),
    "down_lora_a": (SLOT_AXIS, "mlp", RANK_AXIS),
    "down_lora_b": (SLOT_AXIS, RANK_AXIS, "embed"),
}
RULES = {SLOT_AXIS: None, RANK_AXIS: None}


def check(cfg: ModelConfig, slots: int) -> None:
    """Raises ValueError naming what an engine with `slots` adapter slots (an
    `EngineConfig.adapters`, validated there) cannot serve."""
    if not slots:
        return
    if not cfg.lora_rank:
        raise ValueError(
            f"EngineConfig.adapters={slots}: the model has no LoRA adapters "
            "(ModelConfig.lora_rank is 0; trainer.lora.rank sets it)"
        )
    experts = sorted(set(cfg.lora_targets) & {"gate", "up", "down"}) if cfg.num_experts else []
    if experts:
        raise ValueError(
            f"EngineConfig.adapters={slots}: LoRA targets {experts} adapt a mixture of "
            "experts' experts, which unmerged adapter slots do not (their matmuls are "
            "grouped by expert); target attention only (q, k, v, o) or use adapters=0 "
            "(merged at each weight update)"
        )


def fused_targets(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{fused matrix: its targeted parts} of the fused matrices `cfg` adapts."""
    out = {}
    for fused, parts in FUSED.items():
        hit = tuple(t for t in parts if t in cfg.lora_targets)
        if hit:
            out[fused] = hit
    return out


def layer_entries(
    adapters: dict[str, tuple[jax.Array, jax.Array]],
    cfg: ModelConfig,
    i: int,
    dtype: Any,
    scale: float | jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Layer i's adapter in the generation layout, without the slot axis:
    {`<fused>_lora_a`: [in..., R], `<fused>_lora_b`: [R, out...]} (B times `scale`, by
    default the model's alpha / r: each slot's own scale is folded into its B, so the
    adapters of one table may have different alphas), from the stacked training adapters
    {block parameter: (A, B)} (`DecoderStack.adapters`).
    """
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g, r = h // k, cfg.lora_rank
    scale = cfg.lora_scale if scale is None else scale
    f32 = jnp.float32
    out = {}
    for fused, parts in fused_targets(cfg).items():
        a_list, b_list = [], []
        for t in parts:
            a, b = (x[i].astype(f32) for x in adapters[lora.param_name(t, cfg.num_experts)])
            b = b * scale
            if fused == "qkv":  # B into the fused [R, K, G + 2, D] output, zero elsewhere
                block = jnp.zeros((r, k, g + 2, d), f32)
                if t == "q":
                    block = block.at[:, :, :g].set(b.reshape(r, k, g, d))
                else:
                    block = block.at[:, :, g + (t == "v")].set(b)
                b = block
            elif fused == "gate_up":  # [R, 2, M]
                b = jnp.zeros((r, 2, b.shape[-1]), f32).at[:, int(t == "up")].set(b)
            elif fused == "o":  # A [H, D, R] -> [K, G, D, R]
                a = a.reshape(k, g, d, r)
            a_list.append(a)
            b_list.append(b)
        out[f"{fused}_lora_a"] = jnp.concatenate(a_list, axis=-1).astype(dtype)
        out[f"{fused}_lora_b"] = jnp.concatenate(b_list, axis=0).astype(dtype)
    return out


def tables(entries: dict[str, jax.Array], slots: int) -> dict[str, jax.Array]:
    """`entries` (one adapter) in slot 0 of `slots` slots, the others zero (the base)."""
    return {n: jnp.zeros((slots, *x.shape), x.dtype).at[0].set(x) for n, x in entries.items()}


def adapters_of(cfg: ModelConfig, state: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
    """{block parameter: (A, B)} stacked, from a model's state or its adapters alone
    (`state.filter(nnx.LoRAParam)`: what an adapter-only weight sync sends)."""
    stack = state["layers"]
    out = {}
    for t in cfg.lora_targets:
        name = lora.param_name(t, cfg.num_experts)
        out[name] = tuple(stack[f"{name}_lora_{ab}"][...] for ab in "ab")  # Variable or array
    return out


def selector(adapter_N: jax.Array, slots: int, dtype: Any) -> jax.Array:
    """[N, slots] one-hot of each row's adapter slot (-1 or out of range: all zero)."""
    return jax.nn.one_hot(adapter_N, slots, dtype=dtype)


def delta(x: jax.Array, p: dict[str, jax.Array], fused: str, sel: jax.Array) -> jax.Array | None:
    """Rows' adapter term of fused matrix `fused` for input x [N, T, in...] (the input's
    trailing axes are the matrix's inputs): [N, T, out...]; None if it has no table."""
    a = p.get(f"{fused}_lora_a")
    if a is None:
        return None
    b = p[f"{fused}_lora_b"]
    n, t = x.shape[:2]
    slots, rank = a.shape[0], a.shape[-1]
    x2 = x.reshape(n, t, -1)
    a2 = a.reshape(slots, -1, rank)
    xa = jnp.einsum("nti,sir->ntsr", x2, a2) * sel[:, None, :, None]
    out = jnp.einsum("ntq,qo->nto", xa.reshape(n, t, slots * rank), b.reshape(slots * rank, -1))
    return out.reshape(n, t, *b.shape[2:])


def tables_of(weights: dict) -> tuple[dict[str, jax.Array], ...]:
    """Each layer's adapter tables of generation `weights`."""
    return tuple({n: x for n, x in w.items() if n in AXES} for w in weights["layers"])


def with_tables(weights: dict, tables: tuple[dict[str, jax.Array], ...]) -> dict:
    """`weights` with each layer's adapter tables replaced by `tables`' (host-side)."""
    layers = tuple({**w, **t} for w, t in zip(weights["layers"], tables, strict=True))
    return {**weights, "layers": layers}
