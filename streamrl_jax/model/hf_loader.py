"""Reads a Hugging Face checkpoint directory and converts weights to this package's layout.

A directory holds `config.json`, either one `model.safetensors` or shards
listed in `model.safetensors.index.json`, and optionally `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`.

Safetensors files are parsed here (an 8-byte header length, a JSON header,
raw little-endian data) and memory-mapped with numpy, so bfloat16 checkpoints
load without torch and a truncated file is reported with its name.

Layout conversion (`to_model_layout`), HF [out, in] -> ours, L stacked:

    q_proj [H*D, E] -> q [E, H, D]       o_proj [E, H*D] -> o [H, D, E]
    k/v_proj [K*D, E] -> k/v [E, K, D]   gate/up_proj [M, E] -> [E, M]
    down_proj [E, M] -> down [M, E]      lm_head [V, E] -> [E, V]
    q/k/v_proj.bias [N*D] -> [N, D]      embeddings and norms (q/k_norm [D]) unchanged
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from streamrl_jax.errors import UserError
from streamrl_jax.model.config import ModelConfig, from_hf_config

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# our block param name -> HF per-layer tensor suffix
_HF_BLOCK = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}


# Gemma 3's block: norms before and after attention and the MLP
_HF_GEMMA_NORMS = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def hf_block(cfg: ModelConfig) -> dict[str, str]:
    """Our block param name -> HF per-layer tensor suffix, for the params `cfg` has."""
    table = dict(_HF_BLOCK, **(_HF_GEMMA_NORMS if cfg.sandwich_norms else {}))
    drop = set()
    if not cfg.qkv_bias:
        drop |= {"q_bias", "k_bias", "v_bias"}
    if not cfg.qk_norm:
        drop |= {"q_norm", "k_norm"}
    if cfg.num_experts:  # the experts are read by _moe_layer
        drop |= {"gate", "up", "down"}
    return {k: v for k, v in table.items() if k not in drop}


def _moe_layer(get, has, i: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Layer i's router [X, E] and experts (gate, up [X, I, E]; down [X, E, I]) in HF's
    orientation, from any of the three layouts checkpoints use: per expert under
    `mlp.experts.{j}.{gate,up,down}_proj` (Qwen3-MoE) or `block_sparse_moe.experts.{j}.
    w{1,3,2}` (Mixtral), or fused `mlp.experts.gate_up_proj` / `down_proj` (transformers 5)."""
    pre, x, m = f"model.layers.{i}.", cfg.num_experts, cfg.moe_intermediate_size
    if has(pre + "block_sparse_moe.gate.weight"):
        base, names = pre + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = pre + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {"router": get(base + "gate.weight")}
    if has(base + "experts.gate_up_proj"):
        gate_up = get(base + "experts.gate_up_proj")
        out["experts_gate"], out["experts_up"] = gate_up[:, :m], gate_up[:, m:]
        out["experts_down"] = get(base + "experts.down_proj")
        return out
    for ours, theirs in zip(("experts_gate", "experts_up", "experts_down"), names, strict=True):
        out[ours] = np.stack([get(f"{base}experts.{j}.{theirs}.weight") for j in range(x)])
    return out


def read_json(path: str) -> dict[str, Any]:
    """A JSON file as a dict, with the file named in every error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON: {e}") from e


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as read-only memory-mapped numpy arrays.

    Raises:
      FileNotFoundError: the file is missing.
      ValueError: a corrupt or truncated header, or tensor data past the file end.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing weights file: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise UserError(f"{path}: truncated safetensors header ({n} bytes declared)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    data_start = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else None
    out = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: corrupt header entry for tensor {name!r}") from e
        if data_start + end > size or end - begin != dtype.itemsize * int(np.prod(shape)):
            raise UserError(
                f"{path}: tensor {name!r} data [{begin}, {end}) does not fit the file "
                f"({size - data_start} data bytes): truncated or corrupt"
            )
        raw = mm[data_start + begin : data_start + end] if mm is not None else np.zeros(0, np.uint8)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, by HF name."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: missing 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{directory}: no model.safetensors, model.safetensors.index.json or *.safetensors"
            )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(directory, name)))
    return tensors


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    v, e, m = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (v, e),
        "final_norm": (e,),
        "attn_norm": (e,),
        "q": (qd, e),
        "k": (kd, e),
        "v": (kd, e),
        "o": (e, qd),
        "mlp_norm": (e,),
        "gate": (m, e),
        "up": (m, e),
        "down": (e, m),
    }
    if cfg.qkv_bias:
        shapes.update(q_bias=(qd,), k_bias=(kd,), v_bias=(kd,))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(e,), post_mlp_norm=(e,))
    if cfg.num_experts:
        x, mi = cfg.num_experts, cfg.moe_intermediate_size
        for name in ("gate", "up", "down"):
            del shapes[name]
        shapes.update(
            router=(x, e), experts_gate=(x, mi, e), experts_up=(x, mi, e), experts_down=(x, e, mi)
        )
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (v, e)
    return shapes


def stack_hf_weights(tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict:
    """Gathers HF-named tensors into {our name: array}, block params stacked over layers.

    Raises:
      ValueError: a missing tensor, naming it and `source`.
    """

    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{source}: checkpoint has no tensor {name!r}")
        used.add(name)
        return tensors[name]

    out = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head"] = get("lm_head.weight")
    for ours, suffix in hf_block(cfg).items():
        layers = [get(f"model.layers.{i}.{suffix}") for i in range(cfg.num_layers)]
        shapes = {a.shape for a in layers}
        if len(shapes) != 1:
            raise UserError(f"{source}: {suffix} has different shapes across layers: {shapes}")
        out[ours] = np.stack(layers)
    if cfg.num_experts:
        has = tensors.__contains__
        per_layer = [_moe_layer(get, has, i, cfg) for i in range(cfg.num_layers)]
        for name in per_layer[0]:
            out[name] = np.stack([layer[name] for layer in per_layer])
    # A tensor we do not consume (mlp biases, q/k norms, ...) means an architecture
    # variant this model does not implement: refuse rather than silently drop it.
    unused = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise UserError(
            f"{source}: checkpoint has {len(unused)} tensors the model does not use "
            f"(unsupported architecture variant?), e.g. {unused[:3]}"
        )
    return out


def to_model_layout(hf: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict:
    """HF-oriented (stacked) weights -> {param path: array} in this package's layout.

    Raises:
      ValueError: a tensor whose shape does not match `cfg`, naming both.
    """
    expected = _expected_hf_shapes(cfg)
    for name, shape in expected.items():
        got = hf[name].shape
        want = shape if name in ("embed", "final_norm", "lm_head") else (cfg.num_layers, *shape)
        if tuple(got) != want:
            raise UserError(
                f"{source}: weights for {name!r} have shape {tuple(got)} but the config "
                f"implies {want}; config and weights disagree"
            )
    L, E, H, K, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def t(x: np.ndarray) -> np.ndarray:  # [L, out, in] -> [L, in, out]
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))

    out = {
        "embed": hf["embed"],
        "final_norm": hf["final_norm"],
        "layers/attn_norm": hf["attn_norm"],
        "layers/q": t(hf["q"]).reshape(L, E, H, D),
        "layers/k": t(hf["k"]).reshape(L, E, K, D),
        "layers/v": t(hf["v"]).reshape(L, E, K, D),
        "layers/o": t(hf["o"]).reshape(L, H, D, E),
        "layers/mlp_norm": hf["mlp_norm"],
    }
    if cfg.num_experts:  # [L, X, out, in] -> [L, X, in, out]; the router [L, X, E] -> [L, E, X]
        for name in ("router", "experts_gate", "experts_up", "experts_down"):
            out[f"layers/{name}"] = t(hf[name])
    else:
        out.update({f"layers/{name}": t(hf[name]) for name in ("gate", "up", "down")})
    if cfg.qkv_bias:
        out["layers/q_bias"] = hf["q_bias"].reshape(L, H, D)
        out["layers/k_bias"] = hf["k_bias"].reshape(L, K, D)
        out["layers/v_bias"] = hf["v_bias"].reshape(L, K, D)
    if cfg.qk_norm:
        out["layers/q_norm"] = hf["q_norm"]
        out["layers/k_norm"] = hf["k_norm"]
    if cfg.sandwich_norms:
        out["layers/post_attn_norm"] = hf["post_attn_norm"]
        out["layers/post_mlp_norm"] = hf["post_mlp_norm"]
    if cfg.norm_weight_offset:  # Gemma's (1 + w) norms, stored as 1 + w, in f32 (a bf16
        # 1 + w would round w to 2^-8)
        for name in out:
            if name.endswith("norm"):
                out[name] = out[name].astype(np.float32) + np.float32(cfg.norm_weight_offset)
    if not cfg.tie_embeddings:
        out["lm_head"] = np.ascontiguousarray(hf["lm_head"].T)
    return out


def read_hf_config(directory: str, **overrides: Any) -> tuple[ModelConfig, dict]:
    """(config, generation config) of an HF directory, without reading any weight."""
    cfg_path = os.path.join(directory, "config.json")
    hf_cfg = read_json(cfg_path)
    try:
        cfg = from_hf_config(hf_cfg, **overrides)
    except ValueError as e:
        raise UserError(f"{cfg_path}: {e}") from e
    gen_path = os.path.join(directory, "generation_config.json")
    return cfg, read_json(gen_path) if os.path.isfile(gen_path) else {}


def read_hf_weights_in_layout(directory: str, cfg: ModelConfig) -> dict:
    """{param path: host array} of an HF directory in this package's layout."""
    tensors = read_hf_weights(directory)
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints still store lm_head; it must equal the embedding.
        tensors.pop("lm_head.weight")
    return to_model_layout(stack_hf_weights(tensors, cfg, directory), cfg, directory)
