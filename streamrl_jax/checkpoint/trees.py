"""Pytree plumbing of checkpoints: model fingerprint, shape signatures, typed PRNG keys.

Orbax stores plain arrays, so typed PRNG keys are saved as `jax.random.key_data`
and rewrapped on restore with the implementation name recorded at save time.
The signature (`{keypath: "float32[256,64]"}`) of every saved tree goes into
the manifest, so a restore target is checked against it before orbax reads
any array: a mismatch names each differing leaf with both shapes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from streamrl_jax.errors import UserError
from streamrl_jax.model.config import SHAPE_FIELDS, ModelConfig

# Architecture fields of `model.config.ModelConfig` that decide parameter shapes
# or meaning; a checkpoint restores only into a model with the same values.
FINGERPRINT_FIELDS = (
    *SHAPE_FIELDS,
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "sandwich_norms",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "param_dtype",
)
# Fields added to the fingerprint after checkpoints were written without them: such a
# checkpoint's model had the field's default (a dense Llama-family model).
FINGERPRINT_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(ModelConfig)
    if f.name in ("qk_norm", "sandwich_norms", "num_experts", "experts_per_token",
                  "moe_intermediate_size")
}  # fmt: skip
MAX_LISTED = 5  # mismatching leaves named in an error message


def model_fingerprint(model_cfg: Any) -> dict[str, Any]:
    """The architecture dims of a `ModelConfig` (`FINGERPRINT_FIELDS`) as a JSON dict."""
    return {name: getattr(model_cfg, name) for name in FINGERPRINT_FIELDS}


def abstract_tree(tree: Any, shardings: Any | None = None) -> Any:
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) carrying `shardings`.

    Args:
      tree: a pytree of arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(init)`).
      shardings: a matching pytree of shardings; None keeps each leaf's own.
    """
    if shardings is None:
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
            tree,
        )
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def is_prng_key(x: Any) -> bool:
    """Whether `x` (an array or ShapeDtypeStruct) is a typed PRNG key."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"


def signature(tree: Any) -> dict[str, str]:
    """`{keypath: "float32[256,64]"}` of a key-free tree (arrays or ShapeDtypeStructs)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): _describe(leaf) for path, leaf in leaves}


def encode_keys(tree: Any) -> tuple[Any, dict[str, str]]:
    """Typed PRNG keys -> their raw `key_data` (orbax stores plain arrays), and their impls."""
    impls: dict[str, str] = {}

    def encode(path, leaf):
        if is_prng_key(leaf):
            impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(leaf))
            return jax.random.key_data(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(encode, tree), impls


def abstract_key_data(tree: Any) -> Any:
    """The abstract raw-data leaf of every abstract typed key (same sharding)."""

    def encode(leaf):
        if is_prng_key(leaf):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=leaf.sharding)
        return leaf

    return jax.tree.map(encode, tree)


def decode_keys(restored: Any, impls: Mapping[str, str]) -> Any:
    def decode(path, leaf):
        impl = impls.get(jax.tree_util.keystr(path))
        return leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)

    return jax.tree_util.tree_map_with_path(decode, restored)


def check_signature(what: str, where: str, saved: Mapping[str, str], want: Mapping[str, str]):
    """Raises ValueError naming the differing leaves (both shapes) of target vs checkpoint."""
    missing = [p for p in want if p not in saved]
    differ = [p for p in want if p in saved and saved[p] != want[p]]
    if not missing and not differ:
        return
    lines = [f"{p}: checkpoint {saved[p]} vs this run {want[p]}" for p in differ[:MAX_LISTED]]
    lines += [f"{p}: not in the checkpoint (this run {want[p]})" for p in missing[:MAX_LISTED]]
    more = len(missing) + len(differ) - len(lines)
    raise UserError(
        f"checkpoint {where} does not match this run's {what} "
        f"({len(differ)} leaves differ in shape/dtype, {len(missing)} missing): "
        + "; ".join(lines)
        + (f"; ... and {more} more" if more > 0 else "")
    )


def check_json(metadata: Mapping[str, Any]) -> None:
    """Fails now (naming the key) rather than later on orbax's writer thread."""
    for key, value in metadata.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint metadata[{key!r}] is not JSON-serialisable: {e}") from e
