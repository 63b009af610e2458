"""Reads a llama.cpp GGUF file: architecture config, dequantised weights, tokenizer fields.

Weights come back as host float32 arrays in this package's layout (see
`hf_loader.to_model_layout`), stacked over layers, ready for
`sharding.place_host_arrays`.

The q/k permutation. llama.cpp's `convert_hf_to_gguf.py` permutes the rows of
`attn_q` / `attn_k` of Llama models so that its "normal" (interleaved-pair)
RoPE kernel computes the same rotation as HF's half-split ("rotate_half")
convention:

    permute(w, n) = w.reshape(n, 2, rows // n // 2, cols).swapaxes(1, 2).reshape(rows, cols)

with n = n_head for q and n = n_head_kv for k. Our model uses the half-split
convention, so we apply the inverse, `w.reshape(n, rows // n // 2, 2, cols)
.swapaxes(1, 2)`. Qwen2 files are written for the NEOX (half-split) kernel
and are not permuted. Parity with transformers' own GGUF loading is tested.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np

from streamrl_jax.errors import UserError
from streamrl_jax.model.config import ModelConfig

# GGUF architectures whose q/k rows llama.cpp permuted for its interleaved RoPE.
_PERMUTED_ARCHS = ("llama",)
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor name (per block) -> our stacked parameter name.
_BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
}


@dataclasses.dataclass(frozen=True)
class GGUFContents:
    """What the loader needs from one GGUF file.

    Attributes:
      cfg: the architecture (param/compute dtype left at float32).
      hf_weights: {our param name: float32 array in HF [out, in] layout, per layer
        lists already stacked} -- see `read_gguf`.
      metadata: scalar and string metadata fields (token arrays included).
    """

    cfg: ModelConfig
    hf_weights: dict[str, np.ndarray]
    metadata: dict[str, Any]


def unpermute_qk(w_RxC: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved -> half-split RoPE)."""
    rows = w_RxC.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    w = w_RxC.reshape(n_head, rows // n_head // 2, 2, *w_RxC.shape[1:])
    return w.swapaxes(1, 2).reshape(w_RxC.shape)


# GGUF value types (llama.cpp's gguf.md): numpy dtypes of the fixed-size ones.
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")  # a string's length


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor's entry in a GGUF header: its dims (innermost first, as GGUF lists them),
    ggml type and offset in the data section."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


def read_header(path: str) -> tuple[dict[str, Any], list[str]]:
    """(metadata, tensor names) of a GGUF file (v2/v3), read straight from its header.

    The same values as `gguf.GGUFReader`'s fields' contents (strings as `str`, arrays as
    lists), without its element-by-element parse, which takes seconds for a vocabulary of
    strings (the tokenizer and the config are all that most runs read). The file is
    untrusted: every length is checked against the file before it is read.

    Raises:
      FileNotFoundError: `path` does not exist.
      UserError: not a GGUF file, or truncated or corrupt (naming where).
    """
    meta, tensors, _, _ = _parse(path)
    return meta, [t.name for t in tensors]


def _parse(path: str) -> tuple[dict[str, Any], list[_Tensor], int, Any]:
    """(metadata, tensor entries, the data section's first byte, the file mapped) of a
    GGUF file: `read_header`'s parse."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        buf = np.memmap(f, dtype=np.uint8, mode="r") if os.path.getsize(path) else b""
    data = memoryview(buf)
    at = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal at
        if n < 0 or at + n > len(data):
            raise UserError(f"{path}: not a readable GGUF file (truncated or corrupt? {what})")
        out, at = data[at : at + n], at + n
        return out

    def scalar(dtype: Any, what: str) -> Any:
        return np.frombuffer(take(np.dtype(dtype).itemsize, what), dtype, 1)[0].item()

    def string(what: str) -> str:
        raw = take(scalar(np.uint64, what), what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: {what} is not UTF-8 ({e})") from None

    def value(kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return string(what)
        if kind != _ARRAY:
            raise UserError(f"{path}: {what} has an unknown GGUF value type {kind}")
        item, count = scalar(np.uint32, what), scalar(np.uint64, what)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item])
            return np.frombuffer(take(count * dtype.itemsize, what), dtype).tolist()
        if count > len(data):  # each element takes at least a byte
            raise UserError(f"{path}: {what} claims {count} elements")
        if item == _STRING:  # a vocabulary: ~10^5 strings, read in one loop
            return strings(count, what)
        return [value(item, what) for _ in range(count)]

    def strings(count: int, what: str) -> list[str]:
        nonlocal at
        out, end, i = [], len(data), at
        try:
            for _ in range(count):
                if i + 8 > end:
                    break
                (n,) = _U64.unpack_from(data, i)
                if n > end - i - 8:
                    break
                out.append(str(data[i + 8 : i + 8 + n], "utf-8"))
                i += 8 + n
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: {what} is not UTF-8 ({e})") from None
        at = i
        if len(out) < count:
            raise UserError(f"{path}: not a readable GGUF file (truncated or corrupt? {what})")
        return out

    if bytes(take(4, "magic")) != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (no GGUF magic)")
    version = scalar(np.uint32, "version")
    if version not in (2, 3):
        raise UserError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = scalar(np.uint64, "tensor count"), scalar(np.uint64, "metadata count")
    # The header's own fields, as `gguf.GGUFReader` lists them too.
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
    meta["GGUF.kv_count"] = n_kv
    for i in range(n_kv):
        key = string(f"metadata key {i}")
        meta[key] = value(scalar(np.uint32, key), key)
    tensors = []
    for i in range(n_tensors):
        name = string(f"tensor {i}'s name")
        n_dims = scalar(np.uint32, name)
        dims = np.frombuffer(take(8 * n_dims, name), np.uint64).tolist()
        kind, offset = scalar(np.uint32, name), scalar(np.uint64, name)
        tensors.append(_Tensor(name, tuple(dims), kind, offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise UserError(f"{path}: general.alignment={align!r} is not a power of two")
    return meta, tensors, -(-at // align) * align, buf


# ggml types whose elements numpy holds as they are; the others are blocks of bytes.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}  # fmt: skip


def _tensor_data(path: str, buf: Any, start: int, t: _Tensor) -> np.ndarray:
    """A tensor's bytes in the mapped file as `gguf.GGUFReader` presents them (numpy
    order: its dims reversed; a quantised tensor's rows as bytes), checked to lie in it."""
    import gguf

    try:
        kind = gguf.GGMLQuantizationType(t.kind)
        block, size = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise UserError(f"{path}: tensor {t.name!r} has an unknown ggml type {t.kind}") from None
    shape = tuple(reversed(t.dims))
    count = int(np.prod(t.dims, dtype=object))
    if shape and shape[-1] % block:
        raise UserError(f"{path}: tensor {t.name!r}'s rows of {shape[-1]} are not whole blocks")
    n_bytes = count * size // block
    first = start + t.offset
    if first + n_bytes > len(buf):
        raise UserError(f"{path}: tensor {t.name!r} lies past the end of the file")
    raw = buf[first : first + n_bytes]
    if t.kind in _PLAIN:
        return raw.view(_PLAIN[t.kind]).reshape(shape)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata.

    Raises:
      ValueError: an unsupported architecture, a missing field, or a field describing
        what this decoder does not build (RoPE scaling, partial RoPE, a sliding window),
        naming both.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UserError(
            f"{path}: unknown architecture general.architecture={arch!r}; "
            f"supported: {SUPPORTED_GGUF_ARCHITECTURES}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise UserError(
            f"{path}: has a rope_freqs tensor (Llama-3.1 RoPE scaling), which the GGUF loader "
            "does not support; load the Hugging Face directory instead"
        )

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise UserError(f"{path}: missing GGUF metadata field {arch}.{key!r}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    # Metadata that changes the forward and that this reader does not map: refused, not
    # dropped (an HF directory's config.json carries them in a form that is read).
    rotary = meta.get(f"{arch}.rope.dimension_count")
    refused = {
        "rope.scaling.type": meta.get(f"{arch}.rope.scaling.type") not in (None, "none"),
        "rope.dimension_count": rotary is not None and int(rotary) != head_dim,
        "attention.sliding_window": meta.get(f"{arch}.attention.sliding_window") is not None,
    }
    for key, bad in refused.items():
        if bad:
            raise UserError(
                f"{path}: GGUF metadata {arch}.{key}={meta[f'{arch}.{key}']!r} is not "
                "supported by the GGUF loader; load the Hugging Face directory instead"
            )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise UserError(f"{path}: missing {arch}.vocab_size and tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 2048),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def describe_gguf(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, metadata) of a GGUF file; no tensor data is read."""
    meta, names = read_header(path)
    return config_from_metadata(meta, set(names), path), meta


def read_gguf(path: str) -> GGUFContents:
    """Parses, dequantises and un-permutes every tensor of a GGUF file.

    Returns per-layer weights stacked along a leading layer axis, each still in
    HF orientation ([out, in] rows), so `hf_loader.to_model_layout` finishes
    the conversion for both formats. The header is read by `read_header`'s parse and
    each tensor's bytes taken from the mapped file (`gguf.GGUFReader`'s own parse of the
    header took 4 s of SmolLM2's load); `gguf.quants` dequantises them.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: unreadable file, unknown architecture, missing field or tensor.
    """
    import gguf

    meta, entries, start, buf = _parse(path)
    tensors = {t.name: t for t in entries}
    if len(tensors) < len(entries):
        raise UserError(f"{path}: a tensor name is listed twice")
    cfg = config_from_metadata(meta, set(tensors), path)
    permuted = meta["general.architecture"] in _PERMUTED_ARCHS

    def load(name: str) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{path}: missing tensor {name!r}")
        t = tensors[name]
        data = _tensor_data(path, buf, start, t)
        try:
            # GGUF lists dims innermost-first; dequantize returns numpy (row-major) order,
            # i.e. [out, in] like a torch Linear weight.
            arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.kind))
        except Exception as e:
            raise UserError(f"{path}: cannot dequantise tensor {name!r}: {e}") from e
        return np.asarray(arr, dtype=np.float32)

    hf: dict[str, np.ndarray] = {
        "embed": load("token_embd.weight"),
        "final_norm": load("output_norm.weight"),
    }
    if not cfg.tie_embeddings:
        hf["lm_head"] = load("output.weight")
    suffixes = [s for s in _BLOCK_TENSORS if cfg.qkv_bias or not s.endswith(".bias")]
    for suffix in suffixes:
        stacked = None
        for i in range(cfg.num_layers):
            w = load(f"blk.{i}.{suffix}")
            if permuted and suffix.startswith(("attn_q.", "attn_k.")):
                n = cfg.num_heads if suffix.startswith("attn_q.") else cfg.num_kv_heads
                w = unpermute_qk(w, n)
            if stacked is None:
                stacked = _stacked_like(w, cfg.num_layers)
            elif w.shape != stacked.shape[1:]:
                raise UserError(
                    f"{path}: tensor 'blk.{i}.{suffix}' has shape {w.shape}, layer 0's "
                    f"{stacked.shape[1:]}"
                )
            stacked[i] = w
        hf[_BLOCK_TENSORS[suffix]] = stacked
    return GGUFContents(cfg=cfg, hf_weights=hf, metadata=meta)


def _stacked_like(w: np.ndarray, layers: int) -> np.ndarray:
    """An uninitialised f32[layers, *w.shape] for per-layer tensors like `w`. A matrix's
    is a transposed view of a C-ordered [layers, in, out] array: the layout
    `hf_loader.to_model_layout` turns it into (its transpose is then that array as it
    lies, no copy), so a 135M-parameter model's weights are written once, not stacked
    and then copied again (SmolLM2's load: 6 s less here, where each copy into fresh
    memory is bound by page faults)."""
    if w.ndim != 2:
        return np.empty((layers, *w.shape), np.float32)
    return np.swapaxes(np.empty((layers, w.shape[1], w.shape[0]), np.float32), -1, -2)
