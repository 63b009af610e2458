"""Architecture description of a Llama-family decoder (Llama, Llama-3, Qwen2, Qwen3,
SmolLM2).

One frozen dataclass covers the families; they differ only in

* Qwen2: biases on the q/k/v projections (`qkv_bias=True`);
* Qwen3: an RMSNorm over each head's query and key before RoPE (`qk_norm=True`);
* Gemma 3: q/k norms too, embeddings scaled by sqrt(E) (`embed_scale`), GeGLU
  (`mlp_act="gelu_tanh"`), norms after attention and after the MLP as well
  (`sandwich_norms`), the attention scale `query_pre_attn_scalar ** -0.5`
  (`attn_scale`), and local sliding-window layers between global ones
  (`layer_windows`, with their own RoPE base `rope_local_theta`); its `(1 + w)`
  RMSNorm weights are stored as `1 + w` (the loader adds the 1);
* Qwen3-MoE and Mixtral: the MLP is `num_experts` SwiGLU experts of width
  `moe_intermediate_size`, each token sent to its top `experts_per_token` by a linear
  router (softmax over all experts, then the top k, renormalised when
  `norm_topk_prob`; Mixtral always renormalises);
* Mistral, Mixtral, and Qwen2 / Qwen3 / Qwen3-MoE with `use_sliding_window`: sliding
  windows on every layer or on some (`layer_windows`, with the global RoPE);
* SmolLM2 (and Llama-3.2 small models): tied input/output embeddings;
* Llama-3.1+: the "llama3" RoPE frequency scaling (`rope_scaling`).

`from_hf_config` reads a Hugging Face `config.json` dict (what it does with each field:
`model/hf_fields.py`); `from_gguf_metadata` lives with the GGUF loader.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from absl import logging

from streamrl_jax.model import hf_fields
from streamrl_jax.model.lora import TARGETS as LORA_TARGETS

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What the backward keeps of a decoder block (`ModelConfig.remat`, `Llama._run_blocks`).
REMAT_POLICIES = ("dots_attention", "minimal", "full", "none")
# architecture -> family (its `model_type`)
_FAMILIES = {fields.architecture: name for name, fields in hf_fields.FAMILIES.items()}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
MLP_ACTS = ("silu", "gelu_tanh")
# The integer dimensions of `ModelConfig` that fix parameter shapes.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (`rope_type="llama3"` in HF configs) or linear
    (every frequency divided by `factor`: Gemma 3's global layers)."""

    rope_type: str = "llama3"  # "llama3" | "linear"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Widest model whose trainer head runs blocked by default (`ModelConfig.blocked_head`):
# the blocked head made the tiny model's (width 64) micro-batch faster, but SmolLM2's
# (width 576) whole training step slower although its head alone gained, so wide models
# keep the dense head (docs/trainer.md, "Vocabulary head").
BLOCKED_HEAD_MAX_WIDTH = 128
# Query rows per block of a full sequence's causal attention (`ModelConfig.causal_block`):
# 128 beat the whole masked square and blocks of 256, and 64 did no better
# (BENCHMARKS.md "Trainer fraction of peak"; the A/B: docs/benchmarks/model.md).
CAUSAL_BLOCK = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and numerics of the decoder.

    Attributes:
      vocab_size: number of token ids (rows of the embedding).
      hidden_size: residual width E.
      intermediate_size: SwiGLU hidden width M.
      num_layers: decoder blocks L.
      num_heads: query heads H.
      num_kv_heads: key/value heads K (GQA: H % K == 0).
      head_dim: per-head width D (usually E // H).
      rope_theta: RoPE base.
      rope_scaling: Llama-3 frequency scaling, or None.
      rms_norm_eps: epsilon of every RMSNorm.
      max_position_embeddings: context length the model was trained for; prompts
        plus responses longer than this are rejected.
      tie_embeddings: output projection is the transposed input embedding.
      qkv_bias: q/k/v projections have biases (Qwen2).
      qk_norm: each head's query and key RMS-normalised (weights [D], shared by the
        heads of a layer) after the projection, before RoPE (Qwen3, Gemma 3).
      embed_scale: input embeddings multiplied by sqrt(E) (Gemma).
      mlp_act: the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      sandwich_norms: the attention output and the MLP output are RMS-normalised too
        before their residual adds (Gemma 3's post-attention / post-feedforward norms).
      attn_scale: the attention logits' scale; None = 1 / sqrt(head_dim).
      layer_windows: per layer, the sliding window of its attention (a query sees the
        keys less than W positions before it), 0 = global; () = every layer global.
      rope_local_theta: RoPE base of the sliding-window layers (None = rope_theta);
        `rope_scaling` applies to the global layers only.
      norm_weight_offset: a checkpoint's RMSNorm weights w scale by w + offset (Gemma:
        1); the loader stores w + offset, so the model's norms are plain.
      num_experts: experts of every layer's MLP (0 = a dense MLP of intermediate_size).
      experts_per_token: experts each token is routed to (top k of the router).
      moe_intermediate_size: each expert's SwiGLU width.
      norm_topk_prob: the top k routing probabilities renormalised to sum to 1.
      param_dtype: storage dtype of the parameters ("float32" | "bfloat16").
      dtype: compute dtype of activations and matmuls ("float32" | "bfloat16");
        log-softmax and RMSNorm statistics are always computed in float32.
      remat: what the backward pass keeps of each decoder block's forward, by name
        (`REMAT_POLICIES`): "dots_attention" (the default: every matmul's output and
        the attention probabilities; the elementwise work is recomputed), "minimal"
        (the matmuls without a batch dimension: the projections, not attention's
        batched products), "full" (nothing: the whole block is recomputed, the least
        memory) or "none" (everything, no recomputation). True and False, the old
        boolean, read as "full" and "dots_attention".
      blocked_head: the trainer's log-probs through `model.vocab_head` (vocabulary
        tiles with a streamed log-sum-exp, no row of logits held) instead of whole
        [chunk, V] logits; None = when `hidden_size` <= BLOCKED_HEAD_MAX_WIDTH, where
        it was measured faster (docs/trainer.md, "Vocabulary head").
      causal_block: query rows per block of a full sequence's causal attention
        (training, prefill): each block runs against the keys up to its last row, so
        the masked upper triangle is skipped; 0 = the whole [T, T] square, masked.
      bos_token_id / eos_token_ids: from the checkpoint, informational.
      scan_layers: the blocks are applied by one `jax.lax.scan` (compile time independent
        of depth); False unrolls it.
      lora_rank: LoRA adapters of rank r on the `lora_targets` matrices of every block
        (`model/lora.py`); 0 = none.
      lora_alpha: the adapters' scale is lora_alpha / lora_rank.
      lora_targets: the adapted matrices, of `lora.TARGETS` (q, k, v, o, gate, up,
        down; a mixture of experts' gate/up/down are its experts').
      sequence_parallel: in training on a mesh with "tp", the residual stream between
        blocks is sharded over "tp" along the sequence (`sharding.constrain`; Megatron-LM's
        sequence parallelism): the activations the backward keeps shrink by the TP
        degree, the same bytes cross the mesh (an all-gather and a reduce-scatter a
        projection pair instead of an all-reduce). Sequence lengths must then be a
        multiple of "tp". No effect outside the trainer's step functions.
      scan_unroll: blocks per step of that scan. XLA's cost analysis counts a loop body
        once, so the pod planner (`streamrl_podplan.programs`) reads a block's FLOPs and
        bytes off the difference of compiles with 2 and 1 blocks a step.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    embed_scale: bool = False
    mlp_act: str = "silu"
    sandwich_norms: bool = False
    attn_scale: float | None = None
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    norm_weight_offset: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "dots_attention"
    blocked_head: bool | None = None
    causal_block: int = CAUSAL_BLOCK
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    scan_layers: bool = True
    scan_unroll: int = 1
    sequence_parallel: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self) -> None:
        for name in (*SHAPE_FIELDS, "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not isinstance(self.causal_block, int) or self.causal_block < 0:
            raise ValueError(
                f"ModelConfig.causal_block must be an int >= 0 (0: no blocks), got "
                f"{self.causal_block!r}"
            )
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}")
        if self.lora_rank:
            unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
            if unknown or not self.lora_targets:
                raise ValueError(
                    f"ModelConfig.lora_targets must be a non-empty subset of {LORA_TARGETS}, "
                    f"got {tuple(self.lora_targets)!r}"
                )
            if not self.lora_alpha > 0:
                raise ValueError(f"ModelConfig.lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not isinstance(self.scan_unroll, int) or self.scan_unroll < 1:
            raise ValueError(
                f"ModelConfig.scan_unroll must be an int >= 1, got {self.scan_unroll!r}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not (
            0 < self.experts_per_token <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"ModelConfig: {self.num_experts} experts need 0 < experts_per_token "
                f"({self.experts_per_token}) <= num_experts and moe_intermediate_size > 0"
            )
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ModelConfig.mlp_act={self.mlp_act!r}; expected one of {MLP_ACTS}")
        if self.layer_windows and (
            len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0
        ):
            raise ValueError(
                f"ModelConfig.layer_windows: {self.num_layers} windows >= 0 (0 = global), "
                f"got {self.layer_windows!r}"
            )
        if isinstance(self.remat, bool):  # the old switch: on = keep nothing
            object.__setattr__(self, "remat", "full" if self.remat else "dots_attention")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {list(_DTYPES)}"
                )

    @property
    def uses_blocked_head(self) -> bool:
        """Whether the trainer's log-probs run through `model.vocab_head` (`blocked_head`)."""
        if self.blocked_head is None:
            return self.hidden_size <= BLOCKED_HEAD_MAX_WIDTH
        return self.blocked_head

    @property
    def q_prescale(self) -> float | None:
        """The factor queries take so that the attention's 1/sqrt(D) makes `attn_scale`."""
        return None if self.attn_scale is None else self.attn_scale * math.sqrt(self.head_dim)

    @property
    def jnp_param_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def lora_scale(self) -> float:
        """The adapters' scale, lora_alpha / lora_rank."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def replace(self, **kwargs: Any) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        e, m, h, k, d = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = e * h * d * 2 + e * k * d * 2 + (h * d + 2 * k * d if self.qkv_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * e + (2 * d if self.qk_norm else 0)
        mlp = 3 * e * m
        if self.num_experts:
            mlp = self.num_experts * (3 * e * self.moe_intermediate_size + e)
        block = attn + mlp + norms
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * block + e + head

    def flops_per_token(self, context: int) -> float:
        """Forward matmul FLOPs per token (2 per MAC) at a given attention context."""
        e, h, k, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        width = self.intermediate_size
        if self.num_experts:  # the experts a token is routed to, and the router
            width = self.experts_per_token * self.moe_intermediate_size + self.num_experts / 3
        proj = 2 * (e * h * d * 2 + e * k * d * 2 + 3 * e * width)
        attn = 2 * 2 * h * d * context
        return self.num_layers * (proj + attn) + 2 * e * self.vocab_size


def tiny(**overrides: Any) -> ModelConfig:
    """A tiny random model for tests and the `:tiny` configs."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
    )
    base.update(overrides)
    return ModelConfig(**base)


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dict.

    Every field is honoured, refused or ignored as `model.hf_fields` lists it per family;
    a field it does not list is logged.

    Raises:
      ValueError: an architecture outside the supported families, a missing field, or a
        field (or value) the decoder does not build, naming it.
    """
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    model_type = hf.get("model_type", "")
    family = model_type if model_type in hf_fields.FAMILIES else _FAMILIES.get(arch)
    if family is None:
        raise ValueError(
            f"config.json: unknown architecture {arch!r} (model_type={model_type!r}); "
            f"supported: {SUPPORTED_ARCHITECTURES}"
        )
    unknown = hf_fields.check(hf, family, arch)
    if unknown:
        logging.warning(
            "config.json: %s fields this loader does not know, not read: %s "
            '(docs/model.md, "config.json fields")',
            arch,
            ", ".join(unknown),
        )
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        n = int(hf["num_hidden_layers"])
        rope_theta, rope_scaling, local_rs = _rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        cfg = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",  # always there: transformers' Qwen2 has no switch
            qk_norm=family == "qwen3",
            layer_windows=_windows(hf, family, n),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if family == "gemma3_text":
            cfg.update(_gemma3(hf, local_rs))
        else:
            act = hf.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # one function (SiLU) under both names
                raise ValueError(f"config.json: hidden_act={act!r} is not supported for {arch}")
        if family in ("qwen3_moe", "mixtral"):
            cfg.update(_moe(hf, mixtral=family == "mixtral"))
    except KeyError as e:
        raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None
    cfg.update(overrides)
    return ModelConfig(**cfg)


# The keys each RoPE kind reads besides its kind and base (`layers.rope_inv_freq`).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, dict[str, Any]]:
    """(base, scaling, the sliding layers' RoPE dict) of a `config.json`.

    transformers >= 5 writes `rope_parameters` (the base inside it; Gemma 3's per layer
    type); older versions `rope_scaling` and a top-level `rope_theta`.

    Raises:
      ValueError: a RoPE kind other than default, linear and llama3, or a key its kind
        does not read (e.g. `partial_rotary_factor` < 1), naming it.
    """
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local_rs = {}
    if "full_attention" in rs:  # per layer type (Gemma 3, transformers >= 5)
        rs, local_rs = rs["full_attention"] or {}, rs.get("sliding_attention") or {}
        if _rope_kind(local_rs, f"{where}.sliding_attention") != "default":
            raise ValueError(
                f"config.json: {where}.sliding_attention RoPE scaling "
                f"{local_rs.get('rope_type')!r} is not supported (only the global layers')"
            )
        where += ".full_attention"
    rope_theta = hf.get("rope_theta", rs.get("rope_theta", 10000.0))
    kind = _rope_kind(rs, where)
    if kind == "llama3":
        return rope_theta, RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        ), local_rs  # fmt: skip
    if kind == "linear":
        return rope_theta, RopeScaling(rope_type="linear", factor=float(rs["factor"])), local_rs
    return rope_theta, None, local_rs


def _rope_kind(rs: dict[str, Any], where: str) -> str:
    """The RoPE kind of one RoPE dict, refusing one this decoder does not build and any
    key its kind does not read."""
    kind = rs.get("rope_type", rs.get("type")) or "default"
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"config.json: unsupported {where} type {kind!r} (supported: {tuple(_ROPE_KEYS)})"
        )
    read = {"rope_type", "type", "rope_theta", *_ROPE_KEYS[kind]}
    for key in sorted(set(rs) - read):
        if key == "partial_rotary_factor" and rs[key] in (1, 1.0):
            continue
        raise ValueError(f"config.json: {where}.{key}={rs[key]!r} is not supported ({kind} RoPE)")
    return kind


def _layer_types(types: list[str], n: int) -> list[str]:
    """`layer_types` checked: one of full/sliding attention per layer."""
    if set(types) - {"full_attention", "sliding_attention"} or len(types) != n:
        raise ValueError(f"config.json: layer_types {types!r} (expected {n} of full/sliding)")
    return types


def _window(hf: dict[str, Any]) -> int:
    w = hf["sliding_window"]
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"config.json: sliding_window={w!r}; expected an int >= 1 or null")
    return w


def _windows(hf: dict[str, Any], family: str, n: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: global) of a Mistral, Mixtral, Qwen2, Qwen3 or
    Qwen3-MoE `config.json`, as transformers reads it (Gemma 3's: `_gemma3`); () when
    no layer slides.

    Mistral and Mixtral: every layer slides when `sliding_window` is set. Qwen2 and
    Qwen3: `sliding_window` counts only with `use_sliding_window`, on the layers
    `layer_types` names "sliding_attention", by default those from `max_window_layers`
    on (the first `max_window_layers` stay global). Qwen3-MoE: every layer slides with
    `use_sliding_window` (transformers' Qwen3-MoE does not read `max_window_layers`).

    Raises:
      ValueError: a window that is not a positive int, or sliding layers named with no
        window (transformers fails there too).
    """
    if family in ("mistral", "mixtral", "qwen3_moe"):
        on = hf.get("sliding_window") is not None
        if family == "qwen3_moe":
            on = on and bool(hf.get("use_sliding_window", False))
        return (_window(hf),) * n if on else ()
    if family not in ("qwen2", "qwen3"):
        return ()
    on = bool(hf.get("use_sliding_window", False)) and hf.get("sliding_window") is not None
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if on and i >= first else "full_attention" for i in range(n)]
    if "sliding_attention" not in _layer_types(types, n):
        return ()
    if not on:
        raise ValueError(
            "config.json: layer_types names sliding_attention layers, but there is no window "
            f"(use_sliding_window={hf.get('use_sliding_window')!r}, "
            f"sliding_window={hf.get('sliding_window')!r})"
        )
    w = _window(hf)
    return tuple(w if t == "sliding_attention" else 0 for t in types)


def _gemma3(hf: dict[str, Any], local_rope: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 (text) fields of a `config.json` beyond the Llama ones (its refused
    ones, logit soft-capping and bidirectional attention: `hf_fields`).

    Raises:
      ValueError: layer types or an activation this decoder does not know.
    """
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:  # transformers < 4.53: every `sliding_window_pattern`-th layer global
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]  # fmt: skip
    window = _window(hf)
    local_theta = local_rope.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported")
    return dict(
        qk_norm=True,
        embed_scale=True,
        mlp_act="gelu_tanh",
        sandwich_norms=True,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        layer_windows=tuple(
            window if t == "sliding_attention" else 0 for t in _layer_types(types, n)
        ),  # fmt: skip
        rope_local_theta=float(local_theta),
        norm_weight_offset=1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _moe(hf: dict[str, Any], mixtral: bool) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral `config.json` (dense layers
    among the experts and Qwen2-MoE's shared expert are refused: `hf_fields`)."""
    # transformers 5 writes `num_local_experts` for both; Qwen's own configs `num_experts`
    n = int(hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"])
    width = int(hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"])
    return dict(
        num_experts=n,
        experts_per_token=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=width,
        norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        qk_norm=not mixtral,
    )
