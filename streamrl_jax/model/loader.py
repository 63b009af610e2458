"""`load_pretrained`: an HF directory or a GGUF file -> config, sharded params, tokenizer.

Both formats become one `{param path: host array}` dict in this package's
layout (`hf_loader`, `gguf_loader`), and `sharding.place_host_arrays` puts
each device's slice straight onto that device under the role's rule table:
no device ever holds a full copy of a sharded weight.

    pre = load_pretrained(smollm2_gguf_path())
    logits = jax.jit(fn)(pre.params, ...)   # inside: nnx.merge(pre.graphdef, params)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import AxisType, Mesh

from streamrl_jax import sharding
from streamrl_jax.errors import UserError
from streamrl_jax.model import gguf_loader, hf_loader
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.llama import Llama
from streamrl_jax.model.tokenizer import Tokenizer

_GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A loaded checkpoint.

    Attributes:
      cfg: the architecture, with the requested param/compute dtypes.
      graphdef: static half of the NNX model.
      params: nnx.State of the parameters, placed in the role's sharding.
      tokenizer: the checkpoint's tokenizer, or None when the directory has none.
      generation_config: `generation_config.json` (HF) or the GGUF special-token
        ids as {"bos_token_id", "eos_token_id", "pad_token_id"}.
      source: the path it was loaded from.
    """

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any]
    source: str

    def model(self) -> Llama:
        """The NNX module (merge inside jit when the params are a jit argument)."""
        return nnx.merge(self.graphdef, self.params)


def single_device_mesh() -> Mesh:
    """A one-device ("tp",) mesh on the first device: every rule resolves to replicated."""
    devices = np.asarray(jax.devices()[:1], dtype=object)
    return Mesh(devices, ("tp",), axis_types=(AxisType.Auto,))


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract params) of a model, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


@dataclasses.dataclass(frozen=True)
class Description:
    """What a checkpoint is, read without its weights (config, tokenizer, special ids)."""

    cfg: ModelConfig  # with the requested param/compute dtypes and overrides
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any]
    source: str
    is_gguf: bool


def describe(
    path: str, *, param_dtype: str = "float32", dtype: str = "float32", **cfg_overrides: Any
) -> Description:
    """Config, tokenizer and special-token ids of a checkpoint; reads no weight.

    Raises:
      FileNotFoundError / ValueError: as `load_pretrained`, naming the file or field.
    """
    path = os.fspath(path)
    overrides = dict(cfg_overrides, param_dtype=param_dtype, dtype=dtype)
    if os.path.isdir(path):
        cfg, gen = hf_loader.read_hf_config(path, **overrides)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = Tokenizer.from_dir(path, generation_config=gen)
        else:
            logging.warning("%s has no tokenizer.json; the tokenizer is None", path)
            tokenizer = None
        return Description(cfg, tokenizer, gen, path, is_gguf=False)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not _is_gguf(path):
        raise UserError(f"{path}: not a GGUF file (bad magic) and not a Hugging Face directory")
    cfg, meta = gguf_loader.describe_gguf(path)
    if "tokenizer.ggml.model" in meta:
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)
    else:
        logging.warning("%s has no tokenizer.ggml.* metadata; the tokenizer is None", path)
        tokenizer = None
    gen = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return Description(cfg.replace(**overrides), tokenizer, gen, path, is_gguf=True)


def load_pretrained(
    path: str,
    *,
    mesh: Mesh | None = None,
    role: str = "generate",
    param_dtype: str = "float32",
    dtype: str = "float32",
    **cfg_overrides: Any,
) -> Pretrained:
    """Loads a Hugging Face safetensors directory or a GGUF file.

    Args:
      path: an HF directory (`config.json` + `model.safetensors` or shards with
        `model.safetensors.index.json`) or a `.gguf` file.
      mesh: target mesh; None places everything on the first device.
      role: which rule table shards the params ("generate" or "train").
      param_dtype: storage dtype of the parameters.
      dtype: compute dtype.
      **cfg_overrides: other ModelConfig fields (e.g. `remat="full"`).

    Raises:
      FileNotFoundError: `path` or a file the checkpoint needs is missing.
      ValueError: a corrupt/truncated file, an unknown architecture, or weights
        whose shapes disagree with the config; the message names the file/field.
    """
    return load_weights(
        describe(path, param_dtype=param_dtype, dtype=dtype, **cfg_overrides), mesh=mesh, role=role
    )


def load_weights(d: Description, *, mesh: Mesh | None = None, role: str = "generate") -> Pretrained:
    """The weights of a described checkpoint (`describe`), placed in `role`'s sharding on
    `mesh` (None: the first device); raises as `load_pretrained`."""
    cfg, path = d.cfg, d.source
    if d.is_gguf:
        arrays = hf_loader.to_model_layout(gguf_loader.read_gguf(path).hf_weights, cfg, path)
    else:
        arrays = hf_loader.read_hf_weights_in_layout(path, cfg)
    graphdef, abstract = abstract_model(cfg)
    mesh = single_device_mesh() if mesh is None else mesh
    try:
        params = sharding.place_host_arrays(abstract, arrays, mesh, role)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from e
    logging.info("loaded %s: %d params, %s on %s", path, cfg.num_params(), role, mesh.shape)
    return Pretrained(
        cfg=cfg,
        graphdef=graphdef,
        params=params,
        tokenizer=d.tokenizer,
        generation_config=d.generation_config,
        source=path,
    )
