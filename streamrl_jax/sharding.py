"""Logical-axis rule tables per role, and placing model state straight into them.

Model code names logical axes only (`vocab`, `embed`, `heads`, ...). One small
table per role maps each logical axis to a mesh axis (or None = replicated):

* train: FSDP over "fsdp" on the `embed` dimension of every matrix, tensor
  parallel over "tp" on heads / MLP / vocabulary (a no-op when tp = 1).
* generate: tensor parallel over "tp" inside an instance; nothing sharded over
  the batch (slots), so an instance's decode step needs no cross-device
  gather of parameters.

Activations have logical axes too (`ACTIVATION`: batch, length, embed). A step
function traced inside `activation_sharding(mesh, rules)` lets the model pin its
residual stream with `constrain`; outside one (generation, eager calls) `constrain`
returns its input. The trainer opens it for every step function; the model
constrains only with `ModelConfig.sequence_parallel`, whose residual stream is then
sharded over "tp" along the sequence between blocks (Megatron-LM's sequence
parallelism: each block all-gathers its input and reduce-scatters its output
instead of all-reducing it, and the activations kept for the backward are 1/tp).

A logical axis with no rule is an error, and so is a dimension that the
chosen mesh axis does not divide: silently replicating a large tensor is the
kind of surprise that only shows up as an OOM on a pod.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, str | None]

# Tensor parallelism over "tp" is one layout in both roles: heads, MLP and vocabulary
# split, per-head, norm and layer-stack dimensions replicated.
_TENSOR_PARALLEL: Rules = {
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    "layers": None,
    "lora_rank": None,
}

# Experts (MoE): expert parallelism over "fsdp" in training (the expert dimension takes
# the axis `embed` would: one mesh axis shards one dimension), over "tp" inside a
# generation instance.
TRAIN_RULES: Rules = {
    **_TENSOR_PARALLEL,
    "embed": "fsdp",
    "value_head": None,
    "expert": "fsdp",
    # activations (`constrain`): rows over "fsdp" as the batch; the sequence over "tp"
    "activation_batch": "fsdp",
    "activation_length": "tp",
    "activation_length_gathered": None,
    "activation_embed": None,
}

GENERATE_RULES: Rules = {
    **_TENSOR_PARALLEL,
    "embed": None,
    "cache_batch": None,
    "cache_seq": None,
    "expert": "tp",
    "activation_batch": None,
    "activation_length": None,
    "activation_length_gathered": None,
    "activation_embed": None,
}

# The residual stream's logical axes, [B, T, E]; and a block's normalised input, gathered
# along the sequence for the tensor-parallel projections.
ACTIVATION = ("activation_batch", "activation_length", "activation_embed")
GATHERED = ("activation_batch", "activation_length_gathered", "activation_embed")

RULES: dict[str, Rules] = {"train": TRAIN_RULES, "generate": GENERATE_RULES}


def logical_to_spec(
    axes: tuple[str, ...], shape: tuple[int, ...], rules: Rules, mesh: Mesh, name: str = "?"
) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes`, checked against `mesh`.

    Raises:
      ValueError: an axis without a rule, a rank mismatch, or a dimension the
        mesh axis does not divide; the message names the array.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{name}: logical axes {axes} do not match shape {shape}")
    spec, used = [], set()
    for axis, dim in zip(axes, shape, strict=True):
        if axis not in rules:
            raise ValueError(
                f"{name}: no sharding rule for logical axis {axis!r} (rules know {sorted(rules)})"
            )
        mesh_axis = rules[axis]
        if mesh_axis is None or mesh_axis not in mesh.shape or mesh.shape[mesh_axis] == 1:
            spec.append(None)
            continue
        if mesh_axis in used:
            spec.append(None)  # a mesh axis may shard only one dimension
            continue
        if dim % mesh.shape[mesh_axis]:
            raise ValueError(
                f"{name}: dimension {axis}={dim} is not divisible by mesh axis "
                f"{mesh_axis!r} of size {mesh.shape[mesh_axis]}; change the mesh or the rules"
            )
        spec.append(mesh_axis)
        used.add(mesh_axis)
    return PartitionSpec(*spec)


_ACTIVATIONS: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "streamrl_jax_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, role: str | Rules) -> Iterator[None]:
    """While open (around a step function's trace), `constrain` places activations on
    `mesh` by `role`'s rules."""
    token = _ACTIVATIONS.set((mesh, RULES[role] if isinstance(role, str) else role))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` pinned to the layout its logical `axes` have under the open
    `activation_sharding` (`x` itself when none is open).

    Raises:
      ValueError: as `logical_to_spec`: a dimension the mesh axis does not divide
        (a sequence length not a multiple of "tp" with sequence parallelism).
    """
    active = _ACTIVATIONS.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(axes, tuple(x.shape), rules, mesh, "activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def state_shardings(state: Any, mesh: Mesh, role: str | Rules) -> Any:
    """NamedShardings with the structure of an (abstract) nnx.State.

    Every Variable must carry `axes` metadata; one that does not is an error.
    """
    rules = RULES[role] if isinstance(role, str) else role

    def one(path, var):
        name = _path_name(path)
        axes = var.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"{name}: variable has no logical `axes` metadata")
        spec = logical_to_spec(tuple(axes), tuple(var.shape), rules, mesh, name)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


def spec_table(state: Any, mesh: Mesh, role: str | Rules) -> dict[str, PartitionSpec]:
    """Flat {param path: PartitionSpec}, for snapshots and logging."""
    shardings = state_shardings(state, mesh, role)
    flat = jax.tree_util.tree_leaves_with_path(shardings, is_leaf=_is_var)
    return {_path_name(p): v.get_value().spec for p, v in flat}


def placed_structs(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves (arrays or structs) placed by `shardings` (a
    pytree prefix of `tree`): what an ahead-of-time lowering takes instead of arrays."""

    def place(sharding, subtree):  # a sharding may stand for a whole subtree (a prefix)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree
        )

    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)
    return jax.tree.map(place, shardings, tree, is_leaf=is_sharding)


def init_sharded(
    make_module: Callable[[], nnx.Module], mesh: Mesh, role: str | Rules
) -> tuple[nnx.GraphDef, nnx.State]:
    """Creates a module's state directly in its sharded layout.

    `eval_shape` gives the abstract state, the rule table gives shardings, and
    `jit(init, out_shardings=...)` materialises each shard on its own device:
    no device ever holds an unsharded copy.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract, mesh, role)

    @jax.jit
    def init():
        return nnx.split(make_module())[1]

    init = jax.jit(init.__wrapped__, out_shardings=shardings)
    return graphdef, init()


def place_host_arrays(
    abstract: Any, host_arrays: Mapping[str, np.ndarray], mesh: Mesh, role: str | Rules
) -> Any:
    """Builds a sharded nnx.State from host numpy arrays keyed by param path.

    Each device receives only its own slice (`jax.make_array_from_callback`).

    Raises:
      ValueError: a missing array, or a shape that differs from the model's.
    """
    shardings = state_shardings(abstract, mesh, role)

    def one(path, var, sharding_var):
        name = _path_name(path)
        if name not in host_arrays:
            raise ValueError(f"checkpoint has no weights for parameter {name!r}")
        arr = host_arrays[name]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(
                f"parameter {name!r}: checkpoint shape {tuple(arr.shape)} does not match the "
                f"config's shape {tuple(var.shape)}"
            )
        arr = arr.astype(var.dtype, copy=False)
        target = sharding_var.get_value()
        value = jax.make_array_from_callback(arr.shape, target, lambda idx: arr[idx])
        return var.replace(value)

    return jax.tree_util.tree_map_with_path(one, abstract, shardings, is_leaf=_is_var)
