"""Architecture description of a Llama-family decoder (Llama, Llama-3, Qwen2, SmolLM2).

One frozen dataclass covers the three families; they differ only in

* Qwen2: biases on the q/k/v projections (`qkv_bias=True`);
* SmolLM2 (and Llama-3.2 small models): tied input/output embeddings;
* Llama-3.1+: the "llama3" RoPE frequency scaling (`rope_scaling`).

`from_hf_config` reads a Hugging Face `config.json` dict; `from_gguf_metadata`
lives with the GGUF loader.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
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
    """Llama-3 style RoPE frequency scaling (`rope_type="llama3"` in HF configs)."""

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
      param_dtype: storage dtype of the parameters ("float32" | "bfloat16").
      dtype: compute dtype of activations and matmuls ("float32" | "bfloat16");
        log-softmax and RMSNorm statistics are always computed in float32.
      remat: rematerialise each decoder block in the backward pass.
      blocked_head: the trainer's log-probs through `model.vocab_head` (vocabulary
        tiles with a streamed log-sum-exp, no row of logits held) instead of whole
        [chunk, V] logits; None = when `hidden_size` <= BLOCKED_HEAD_MAX_WIDTH, where
        it was measured faster (docs/trainer.md, "Vocabulary head").
      causal_block: query rows per block of a full sequence's causal attention
        (training, prefill): each block runs against the keys up to its last row, so
        the masked upper triangle is skipped; 0 = the whole [T, T] square, masked.
      bos_token_id / eos_token_ids: from the checkpoint, informational.
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
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False
    blocked_head: bool | None = None
    causal_block: int = CAUSAL_BLOCK
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

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
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
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
    def jnp_param_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return _DTYPES[self.dtype]

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
        block = attn + 3 * e * m + 2 * e
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * block + e + head

    def flops_per_token(self, context: int) -> float:
        """Forward matmul FLOPs per token (2 per MAC) at a given attention context."""
        e, h, k, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        proj = 2 * (e * h * d * 2 + e * k * d * 2 + 3 * e * self.intermediate_size)
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

    Raises:
      ValueError: for an architecture outside the Llama family or a missing field.
    """
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    model_type = hf.get("model_type", "")
    if arch not in SUPPORTED_ARCHITECTURES and model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(
            f"config.json: unknown architecture {arch!r} (model_type={model_type!r}); "
            f"supported: {SUPPORTED_ARCHITECTURES}"
        )
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        rope_scaling = None
        # transformers >= 5 writes `rope_parameters` (theta inside it); older
        # versions write `rope_scaling` and a top-level `rope_theta`.
        rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rs.get("rope_theta", 10000.0))
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind not in ("default", None):
            if kind != "llama3":
                raise ValueError(f"config.json: unsupported rope_scaling type {kind!r}")
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        cfg = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None
    cfg.update(overrides)
    return ModelConfig(**cfg)
