"""The output-length ranker on disk: arrays and JSON in one .npz, no pickle.

`save_ranker(path, ranker, report)` writes every leaf of `Ranker.state()`
keyed by its key path, plus a `__meta__` JSON string (format tag,
`RankerConfig`, the training report). `load_ranker(path)` reads it back with
`allow_pickle=False`: the config is checked field by field (and bounded, so a
file cannot make the loader allocate a huge embedding), a fresh ranker of that
config is the template, and every array's shape and dtype is checked against
it from the .npy header *before* the array is read. Every problem is a
`ValueError` naming the file (`scheduling.ranker_path`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from typing import Any

import jax
import numpy as np

from streamrl_jax.scheduling.ranker import Ranker, RankerConfig

FORMAT = "streamrl-ranker/1"
_META = "__meta__"
# Bounds on a loaded config: a file must not size the ranker past any real one.
_LIMITS = {"vocab_size": 1 << 22, "max_tokens": 1 << 16, "embed_dim": 4096, "hidden_dim": 4096}
_LIMITS |= {"batch_size": 1 << 16, "buffer_size": 1 << 22, "steps_per_update": 1 << 16}


def save_ranker(path: str, ranker: Ranker, report: dict[str, Any] | None = None) -> None:
    """Writes `ranker` (config, parameters, optimizer state, step count) to `path`."""
    flat = jax.tree_util.tree_flatten_with_path(ranker.state())[0]
    arrays = {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
    meta = {"format": FORMAT, "config": dataclasses.asdict(ranker.cfg), "report": report or {}}
    with open(path, "wb") as f:
        np.savez(f, **{_META: np.asarray(json.dumps(meta, default=float))}, **arrays)


def _config(path: str, meta: Any) -> RankerConfig:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: not a ranker file of format {FORMAT!r} (found {found!r})")
    kinds = {f.name: float if f.type == "float" else int for f in dataclasses.fields(RankerConfig)}
    given = meta.get("config")
    if not isinstance(given, dict) or set(given) - set(kinds) or "vocab_size" not in given:
        raise ValueError(f"{path}: ranker config {given!r} does not match RankerConfig")
    out = {}
    for name, value in given.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or value < 0 or value > _LIMITS.get(name, float("inf")):
            raise ValueError(f"{path}: ranker config {name}={value!r} is out of range")
        if kinds[name] is int and value != int(value):
            raise ValueError(f"{path}: ranker config {name}={value!r} must be an integer")
        out[name] = kinds[name](value)
    return RankerConfig(**out)


def load_ranker(path: str) -> Ranker:
    """The ranker `save_ranker` wrote (see the module docstring for the checks)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"scheduling.ranker_path {path} does not exist")
    try:
        with zipfile.ZipFile(path) as z:
            names = {n.removesuffix(".npy"): n for n in z.namelist()}
            if _META not in names:
                raise ValueError(f"{path}: no {_META} entry (not a ranker file)")
            with z.open(names[_META]) as f:
                meta = json.loads(str(np.lib.format.read_array(f, allow_pickle=False)))
            ranker = Ranker(_config(path, meta))
            flat, treedef = jax.tree_util.tree_flatten_with_path(ranker.state())
            leaves = []
            for key_path, ref in flat:
                key = jax.tree_util.keystr(key_path)
                if key not in names:
                    raise ValueError(f"{path}: missing array {key}")
                with z.open(names[key]) as f:
                    major, _ = np.lib.format.read_magic(f)
                    read_header = (
                        np.lib.format.read_array_header_1_0
                        if major == 1
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read_header(f)
                    want = np.asarray(ref)
                    if tuple(shape) != want.shape or np.dtype(dtype) != want.dtype:
                        raise ValueError(
                            f"{path}: array {key} is {dtype}{list(shape)}, expected "
                            f"{want.dtype}{list(want.shape)}"
                        )
                with z.open(names[key]) as f:
                    leaves.append(np.lib.format.read_array(f, allow_pickle=False))
    except (zipfile.BadZipFile, json.JSONDecodeError, OSError, EOFError) as e:
        raise ValueError(f"scheduling.ranker_path {path}: not a readable ranker file ({e})") from e
    ranker.load_state(jax.tree_util.tree_unflatten(treedef, leaves))
    return ranker
