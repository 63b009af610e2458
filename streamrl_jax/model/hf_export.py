"""Writes a model as a Hugging Face safetensors directory, LoRA adapters merged.

The inverse of `hf_loader.to_model_layout` (its module docstring has the table): the
stacked [L, ...] weights in this package's layout become per-layer HF tensors
[out, in], the adapters merged into their matrices (W + alpha / r A B, in the
weights' dtype), Gemma's norm offset taken back off. `model.loader.load_pretrained` and
transformers read the directory back.

`config.json`: a checkpoint loaded from an HF directory keeps its own (copied with its
tokenizer and generation config: `source`), since only the weights change; a model
without one (the GGUF SmolLM2, the tiny test model) gets a Llama config written from its
`ModelConfig`, or a Qwen2 one when it has q/k/v biases (a GGUF Qwen2: transformers'
Llama `attention_bias` would add an output bias too); other families need their
source's config, and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np

from streamrl_jax.errors import UserError
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.hf_loader import hf_block

_ST_NAMES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}
# Files of an HF directory that travel with its weights unchanged.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header
    (names sorted, offsets into the data), the raw little-endian data."""
    header: dict[str, Any] = {}
    offset = 0
    for name in sorted(tensors):
        a = tensors[name]
        if a.dtype not in _ST_NAMES:
            raise ValueError(f"write_safetensors: {name} has dtype {a.dtype} (no safetensors name)")
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(
                np.ascontiguousarray(tensors[name])
                .astype(tensors[name].dtype.newbyteorder("<"))
                .tobytes()
            )
    os.replace(tmp, path)


def hf_tensors(
    model: Any, cfg: ModelConfig, moe_naming: str = "qwen3_moe"
) -> dict[str, np.ndarray]:
    """{HF tensor name: host array} of `model` (a `llama.Llama`), adapters merged.

    Args:
      moe_naming: a mixture of experts' tensor names: "qwen3_moe" (`mlp.experts.{j}.
        gate_proj`, ...) or "mixtral" (`block_sparse_moe.experts.{j}.w1`, ...).
    """
    blocks = jax.device_get(model.layers.merged_arrays(cfg.lora_scale))
    L, E, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    off = np.float32(cfg.norm_weight_offset)

    def norm(x: np.ndarray) -> np.ndarray:  # the loader stored w + offset
        return (x.astype(np.float32) - off).astype(x.dtype) if off else x

    t = lambda x: np.ascontiguousarray(np.swapaxes(x, -1, -2))  # [in, out] -> [out, in]
    out = {
        "model.embed_tokens.weight": np.asarray(jax.device_get(model.embed[...])),
        "model.norm.weight": norm(np.asarray(jax.device_get(model.final_norm[...]))),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t(np.asarray(jax.device_get(model.lm_head[...])))
    per_layer = {
        "q": lambda i: t(blocks["q"][i].reshape(E, H * D)),
        "k": lambda i: t(blocks["k"][i].reshape(E, K * D)),
        "v": lambda i: t(blocks["v"][i].reshape(E, K * D)),
        "o": lambda i: t(blocks["o"][i].reshape(H * D, E)),
        "q_bias": lambda i: blocks["q_bias"][i].reshape(H * D),
        "k_bias": lambda i: blocks["k_bias"][i].reshape(K * D),
        "v_bias": lambda i: blocks["v_bias"][i].reshape(K * D),
        "gate": lambda i: t(blocks["gate"][i]),
        "up": lambda i: t(blocks["up"][i]),
        "down": lambda i: t(blocks["down"][i]),
    }
    for ours, suffix in hf_block(cfg).items():
        for i in range(L):
            x = per_layer[ours](i) if ours in per_layer else blocks[ours][i]
            out[f"model.layers.{i}.{suffix}"] = norm(x) if ours.endswith("norm") else x
    if cfg.num_experts:
        mixtral = moe_naming == "mixtral"
        base = "block_sparse_moe." if mixtral else "mlp."
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for i in range(L):
            pre = f"model.layers.{i}.{base}"
            out[pre + "gate.weight"] = t(blocks["router"][i])
            for ours, theirs in zip(
                ("experts_gate", "experts_up", "experts_down"), names, strict=True
            ):
                for j in range(cfg.num_experts):
                    out[f"{pre}experts.{j}.{theirs}.weight"] = t(blocks[ours][i, j])
    return out


def llama_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """A transformers `LlamaForCausalLM` config.json of `cfg`, `Qwen2ForCausalLM` with
    q/k/v biases (Llama-family shapes only)."""
    other = [f for f in ("qk_norm", "sandwich_norms", "num_experts", "embed_scale", "layer_windows")
             if getattr(cfg, f)]  # fmt: skip
    if other or cfg.mlp_act != "silu" or cfg.attn_scale is not None:
        raise UserError(
            f"hf_export: a {', '.join(other) or cfg.mlp_act} model needs its source's "
            "config.json (pass `source=`: the HF directory it was loaded from)"
        )
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
    }
    if cfg.qkv_bias:  # Qwen2's q/k/v biases are not a switch: always on
        hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    if cfg.bos_token_id is not None:
        hf["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        eos = list(cfg.eos_token_ids)
        hf["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    rs = cfg.rope_scaling
    if rs is not None:
        hf["rope_scaling"] = (
            {"rope_type": "linear", "factor": rs.factor}
            if rs.rope_type == "linear"
            else {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        )
    return hf


def export(
    model: Any,
    cfg: ModelConfig,
    out_dir: str,
    *,
    source: str | None = None,
    tokenizer: Any = None,
) -> str:
    """Writes `model` (adapters merged) to `out_dir` as an HF directory; returns it.

    Args:
      source: the HF directory the model was loaded from: its config.json, tokenizer and
        generation config are copied (and its MoE tensor naming kept); None writes a
        Llama config.json from `cfg`.
      tokenizer: a `model.tokenizer.Tokenizer` whose `tokenizer.json` to write (when
        `source` has none, e.g. a GGUF checkpoint's).
    """
    os.makedirs(out_dir, exist_ok=True)
    naming = "qwen3_moe"
    dtype = {"float32": "float32", "bfloat16": "bfloat16"}.get(cfg.param_dtype, "float32")
    if source is not None and os.path.isdir(source):
        for name in _SIDE_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
        with open(os.path.join(source, "config.json")) as f:
            if json.load(f).get("model_type") == "mixtral":
                naming = "mixtral"
    else:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(llama_config(cfg, dtype), f, indent=2)
    if tokenizer is not None and not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), hf_tensors(model, cfg, naming))
    return out_dir
