"""Train state and gradient accumulator, created directly in their sharded layout.

The house recipe (carried out by `step`): `nnx.eval_shape` gives the
abstract parameters, the training rule table (`sharding.TRAIN_RULES`: FSDP
over "fsdp", tensor parallel over "tp") gives their shardings
(`train_state_shardings`; the optimizer state's mirror the parameters' through
`optax.tree_map_params`), and one `jit(init, out_shardings=...)` around
`new_state` materialises every shard on its own device. No device ever holds
an unsharded copy.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import sharding as sharding_lib

Metrics = dict[str, jax.Array]
# A model kind's loss: (S_micro / normalizer, additive metrics, per-token statistics
# f32[B, T] that the step reports as masked `<name>_sum`).
LossOutput = tuple[jax.Array, Metrics, dict[str, jax.Array]]


@flax.struct.dataclass
class TrainState:
    """Everything the optimizer step updates.

    Attributes:
      params: nnx.State of the model's Params; float32 master weights, FSDP-sharded.
      opt_state: optax state of the `trainable` params (AdamW moments sharded like
        them, counts replicated): all params, or with LoRA the adapters only.
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
      grads: nnx.State, f32, the structure and shardings of the `trainable` params:
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


def trainable(params: nnx.State, lora: bool) -> nnx.State:
    """The params the optimizer updates: all, or with LoRA the adapters (`nnx.LoRAParam`);
    the rest (`frozen`) stay as they are."""
    return params.filter(nnx.LoRAParam) if lora else params


def frozen(params: nnx.State) -> nnx.State:
    """The params LoRA training leaves unchanged: all but the adapters."""
    return params.filter(nnx.Not(nnx.LoRAParam))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts a full copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(
    abstract_params: nnx.State,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    lora: bool = False,
) -> TrainState:
    """Shardings of a TrainState: params by the train rules, moments mirror the
    `trainable` params'.

    Args:
      abstract_params: nnx.State of ShapeDtypeStructs carrying `axes` metadata.
      optimizer: the optax transformation whose state is sharded.
      mesh: the training mesh, axes ("fsdp", "tp").
      lora: only the adapters are trained (`trainable`).

    Returns:
      A TrainState whose leaves are NamedShardings.
    """
    param_sh = sharding_lib.state_shardings(abstract_params, mesh, "train")
    abstract_opt = jax.eval_shape(optimizer.init, trainable(abstract_params, lora))
    rep = replicated(mesh)
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        trainable(param_sh, lora),
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return TrainState(params=param_sh, opt_state=opt_sh, step=rep, rng=rep)


def new_state(
    params: nnx.State, optimizer: optax.GradientTransformation, seed: jax.Array, lora: bool = False
) -> TrainState:
    """A step-0 TrainState around `params` (call inside jit, `out_shardings` = the
    `train_state_shardings`, so each device materialises only its own shards)."""
    return TrainState(
        params=params,
        opt_state=optimizer.init(trainable(params, lora)),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key(seed),
    )


def zero_accumulator(params: nnx.State, metric_keys: tuple[str, ...]) -> GradAccumulator:
    """An all-zero accumulator shaped like `params` (call inside jit)."""
    return GradAccumulator(
        grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        metrics={k: jnp.zeros((), jnp.float32) for k in metric_keys},
        normalizer_sum=jnp.zeros((), jnp.float32),
        num_micro_batches=jnp.zeros((), jnp.int32),
    )


def accumulator_shardings(
    state_shardings: TrainState, mesh: Mesh, lora: bool = False
) -> GradAccumulator:
    """Accumulator shardings: grads exactly like the `trainable` params, scalars
    replicated.

    `metrics` is given as one replicated sharding (a pytree prefix of the dict).
    """
    rep = replicated(mesh)
    grads = trainable(state_shardings.params, lora)
    return GradAccumulator(grads=grads, metrics=rep, normalizer_sum=rep, num_micro_batches=rep)
