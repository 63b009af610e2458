"""Parameters as one .npz of host arrays, keyed by key path (`log.final_params`).

Written at the end of a run so runs can be compared bit for bit, e.g. a
multi-process run against one process (tests/multicontroller_test.py).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def save_params_npz(path: str, params: Any) -> None:
    """Host copies of `params` in an .npz, one array per leaf keyed by its key path
    (`log.final_params`: compare runs across processes bit for bit). On a training mesh
    spanning processes every training process gathers (a collective)."""
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    if mesh.is_multi_process:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params = jax.jit(lambda x: x, out_shardings=replicated)(params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    # Replicated now: any local shard holds the whole array.
    arrays = jax.device_get([a.addressable_shards[0].data for _, a in flat])
    named = {jax.tree_util.keystr(p): np.asarray(a) for (p, _), a in zip(flat, arrays, strict=True)}
    with open(path, "wb") as f:
        np.savez(f, **named)
