"""Train state and gradient accumulator, created directly in their sharded layout.

`state_initializer` follows the house recipe: `nnx.eval_shape` gives the
abstract parameters, the training rule table (`sharding.TRAIN_RULES`: FSDP
over "fsdp", tensor parallel over "tp") gives their shardings, the optimizer
state's shardings mirror the parameters' (`optax.tree_map_params`), and one
`jit(init, out_shardings=...)` materialises every shard on its own device. No
device ever holds an unsharded copy.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import sharding as sharding_lib

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything the optimizer step updates.

    Attributes:
      params: nnx.State of the model's Params; float32 master weights, FSDP-sharded.
      opt_state: optax state (AdamW moments sharded like `params`, counts replicated).
      step: i32[] optimizer steps taken so far (replicated).
      rng: key[] typed PRNG key, replicated (for stochastic losses; unused by the
        deterministic policy loss, carried so checkpoints are complete).
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array


@flax.struct.dataclass
class GradAccumulator:
    """Sum of micro-batch gradients and metrics since the last optimizer step.

    Attributes:
      grads: nnx.State, f32, same structure and shardings as `TrainState.params`:
        sum over micro-batches of d(S_micro / normalizer)/d params.
      metrics: f32[] additive metrics summed over micro-batches (loss terms
        divided by the `normalizer` given to `accumulate`; `*_sum` token sums;
        `num_tokens`).
      normalizer_sum: f32[] sum of the micro-batches' `normalizer_part` (the
        global N once the batch is complete; see `algorithms.losses`).
      num_micro_batches: i32[] micro-batches accumulated.
    """

    grads: nnx.State
    metrics: Metrics
    normalizer_sum: jax.Array
    num_micro_batches: jax.Array


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts a full copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(
    abstract_params: nnx.State, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """Shardings of a TrainState: params by the train rules, moments mirror params.

    Args:
      abstract_params: nnx.State of ShapeDtypeStructs carrying `axes` metadata.
      optimizer: the optax transformation whose state is sharded.
      mesh: the training mesh, axes ("fsdp", "tp").

    Returns:
      A TrainState whose leaves are NamedShardings.
    """
    param_sh = sharding_lib.state_shardings(abstract_params, mesh, "train")
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    rep = replicated(mesh)
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return TrainState(params=param_sh, opt_state=opt_sh, step=rep, rng=rep)


def state_initializer(
    make_module: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
) -> tuple[nnx.GraphDef, TrainState, Callable[[jax.Array], TrainState]]:
    """Graph, shardings and a jitted sharded initialiser of a module's TrainState.

    Args:
      make_module: zero-argument constructor of the (NNX) model, including its
        own parameter seed; called under `eval_shape` and inside `jit` only.
      optimizer: optax transformation (see `config.make_optimizer`).
      mesh: the training mesh.

    Returns:
      `(graphdef, shardings, init)`: the static module structure, a TrainState
      of NamedShardings, and `init(seed) -> TrainState` (jit with
      `out_shardings=shardings`: each device materialises only its shards;
      `seed` seeds `TrainState.rng`).
    """
    graphdef, abstract_params = nnx.split(nnx.eval_shape(make_module))
    shardings = train_state_shardings(abstract_params, optimizer, mesh)

    def init(seed: jax.Array) -> TrainState:
        params = nnx.split(make_module())[1]
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.key(seed),
        )

    return graphdef, shardings, jax.jit(init, out_shardings=shardings)


def zero_accumulator(params: nnx.State, metric_keys: tuple[str, ...]) -> GradAccumulator:
    """An all-zero accumulator shaped like `params` (call inside jit)."""
    return GradAccumulator(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        metrics={k: jnp.zeros((), jnp.float32) for k in metric_keys},
        normalizer_sum=jnp.zeros((), jnp.float32),
        num_micro_batches=jnp.zeros((), jnp.int32),
    )


def accumulator_shardings(state_shardings: TrainState, mesh: Mesh) -> GradAccumulator:
    """Accumulator shardings: grads exactly like params, scalars replicated.

    `metrics` is given as one replicated sharding (a pytree prefix of the dict).
    """
    rep = replicated(mesh)
    return GradAccumulator(
        grads=state_shardings.params, metrics=rep, normalizer_sum=rep, num_micro_batches=rep
    )
