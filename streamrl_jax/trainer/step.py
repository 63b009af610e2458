"""Trainer steps as module-level pure functions, jitted in one place.

Every step is a pure function `fn(spec, *arrays)` of a static, hashable
`StepSpec` (what to compute: model structure, config, loss and forward of the
model's kind) and arrays (state, accumulator, batch, scalars). `_jit` is the
only place that calls `jax.jit`: it binds a spec and gives each function
explicit in/out shardings on the training mesh and `donate_argnames`; each
compiles once per (batch, sequence) bucket; trainers of equal spec and shardings
share one set (`_compile`). `Trainer` holds the results:

* `accumulate(state, acc, batch, normalizer) -> (acc, metrics)`: loss and
  gradients of one micro-batch, added into the donated accumulator (same
  shardings as the params).
* `apply(state, acc, normalizer_total) -> (state, acc, metrics)`: divides the
  summed gradients by `normalizer_total`, clips, AdamW; donates state and
  accumulator and returns a zeroed accumulator in the same buffers. A step
  whose loss or gradient norm is NaN/Inf changes nothing (the non-finite guard
  below).
* `forward(params, batch) -> f32[B, T]`: token log-probs (policy; alias
  `logprobs`) or values (critic), for reference / old log-probs as samples
  stream in; `fill_gae(params, batch)` (critic) adds the GAE targets.

## Normaliser usage (exact streamed accumulation)

Every loss is S_micro / N (see `algorithms.losses`). Two equivalent ways:

1. N known ahead (`seq_mean_*` aggregations: N = number of sequences of the
   global batch): `accumulate(..., normalizer=N)` for every micro-batch, then
   `apply(state, acc, normalizer_total=1)`.
2. N known only at the end (`token_mean`: N = response tokens of the batch):
   `accumulate(..., normalizer=1)`, then `apply(state, acc)` (no
   `normalizer_total`: it uses `acc.normalizer_sum`, the on-device sum of the
   micro-batches' `normalizer_part`) or pass N explicitly.

Either way the step equals one step on the whole batch up to float summation
order. Scalars must be device arrays (`trainer.scalar(x)`): the loop runs
under `jax.transfer_guard("disallow")`, where a Python float argument is an
implicit transfer.

Metrics come back as device arrays and never block: fetch a step's metrics
with `jax.device_get` after dispatching the next step.

## Non-finite guard

`apply` checks on device that the loss and the global gradient norm are finite
(an overflowing norm counts as non-finite). If not, it returns the TrainState
unchanged, bit for bit: params, optimizer state (so AdamW's count and moments)
and `step` (so the learning-rate schedule does not advance for a step that was
not taken). The accumulator is zeroed either way and metric `nonfinite` is 1.0
(0.0 for a normal step). `apply` itself never syncs with the host: with
`pipeline.nonfinite="stop"` the trainer loop fetches the metric right after the
step (a deliberate sync, that mode's price) and raises `NonFiniteError`; nothing
non-finite was written.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import algorithms, sharding
from streamrl_jax.errors import UserError
from streamrl_jax.model import llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer import state as state_lib
from streamrl_jax.trainer.batch import TrainBatch, abstract_batch
from streamrl_jax.trainer.config import TrainerConfig, lr_schedule, make_optimizer
from streamrl_jax.trainer.policy import policy_forward, policy_loss
from streamrl_jax.trainer.state import GradAccumulator, LossOutput, Metrics, TrainState

_F32 = jnp.float32
# (model merged from params, cfg, batch, normalizer) -> state.LossOutput
LossFn = Callable[[nnx.Module, TrainerConfig, TrainBatch, jax.Array], LossOutput]
# (model, cfg, batch) -> f32[B, T], 0 off the loss mask
ForwardFn = Callable[[nnx.Module, TrainerConfig, TrainBatch], jax.Array]
# (batch, forward output f32[B, T], cfg) -> batch with targets filled (critic: GAE)
TargetsFn = Callable[[TrainBatch, jax.Array, TrainerConfig], TrainBatch]


class NonFiniteError(FloatingPointError):
    """An optimizer step had a NaN/Inf loss or gradient norm (`nonfinite="stop"`).

    `Trainer.apply` never raises it (it does not sync with the host); the
    pipeline raises it when it fetches a step's metrics and finds
    `nonfinite == 1`, with a message naming that step. The state the step was
    given is intact (the guard skipped the update).
    """


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static half of every step function: hashable, no arrays.

    Attributes:
      kind: "policy" or "critic".
      graphdef: the model's static NNX structure (merge with params to rebuild).
      cfg: the trainer config.
      model_cfg: the architecture, for `create`.
      model_seed: parameter-initialisation seed, for `create`.
      create: `(model_cfg, seed) -> nnx.Module` (module-level, e.g. `llama.create`).
      loss: the kind's `LossFn`.
      forward: the kind's `ForwardFn`.
      targets: the kind's `TargetsFn` (critic: GAE), or None.
      metric_keys: keys of the additive micro-batch metrics (the accumulator's).
    """

    kind: str
    graphdef: nnx.GraphDef
    cfg: TrainerConfig
    model_cfg: ModelConfig
    model_seed: int
    create: Callable[[ModelConfig, int], nnx.Module]
    loss: LossFn
    forward: ForwardFn
    targets: TargetsFn | None = None
    metric_keys: tuple[str, ...] = ()


def _params(spec: StepSpec) -> nnx.State:
    return nnx.split(spec.create(spec.model_cfg, spec.model_seed))[1]


def _lora(spec: StepSpec) -> bool:
    """Only the LoRA adapters are trained (`ModelConfig.lora_rank`)."""
    return spec.model_cfg.lora_rank > 0


def init_state(spec: StepSpec, seed: jax.Array) -> TrainState:
    """A fresh TrainState, model params from the spec's own seed; `seed` seeds `rng`."""
    return state_lib.new_state(_params(spec), make_optimizer(spec.cfg), seed, _lora(spec))


def state_from_params(spec: StepSpec, params: nnx.State, seed: jax.Array) -> TrainState:
    """A TrainState around a copy of `params` (e.g. loaded weights)."""
    params = jax.tree.map(jnp.copy, params)
    return state_lib.new_state(params, make_optimizer(spec.cfg), seed, _lora(spec))


def init_accumulator(spec: StepSpec) -> GradAccumulator:
    """An all-zero GradAccumulator (of the trainable params)."""
    abstract_params = jax.eval_shape(functools.partial(_params, spec))
    trained = state_lib.trainable(abstract_params, _lora(spec))
    return state_lib.zero_accumulator(trained, spec.metric_keys)


def loss_and_metrics(
    spec: StepSpec, params: nnx.State, batch: TrainBatch, normalizer: jax.Array
) -> tuple[jax.Array, Metrics]:
    """The kind's loss S_micro / normalizer and its additive metrics.

    Adds, for every kind alike, `num_tokens`, `loss` and `<name>_sum` of each
    per-token statistic the loss reports (masked, stop-gradient).
    """
    model = nnx.merge(spec.graphdef, params)
    loss, metrics, per_token = spec.loss(model, spec.cfg, batch, normalizer)
    mask_BxT = batch.loss_mask.astype(_F32)
    metrics = dict(metrics)
    for name, x_BxT in per_token.items():
        metrics[f"{name}_sum"] = jnp.sum(jax.lax.stop_gradient(x_BxT) * mask_BxT)
    metrics["num_tokens"] = jnp.sum(mask_BxT)
    metrics["loss"] = jax.lax.stop_gradient(loss)
    return loss, metrics


def accumulate(
    spec: StepSpec,
    state: TrainState,
    acc: GradAccumulator,
    batch: TrainBatch,
    normalizer: jax.Array,
) -> tuple[GradAccumulator, Metrics]:
    """`acc` plus one micro-batch's gradients of S_micro / normalizer, and its metrics
    (with LoRA of the adapters only: the base is not differentiated)."""
    if _lora(spec):
        fixed = state_lib.frozen(state.params)
        of_adapters = lambda t, *a: loss_and_metrics(spec, nnx.merge_state(t, fixed), *a)
        grad_fn = jax.value_and_grad(of_adapters, has_aux=True)
        (_, metrics), grads = grad_fn(state_lib.trainable(state.params, True), batch, normalizer)
    else:
        grad_fn = jax.value_and_grad(loss_and_metrics, argnums=1, has_aux=True)
        (_, metrics), grads = grad_fn(spec, state.params, batch, normalizer)
    part = algorithms.normalizer_part(
        batch.loss_mask, spec.cfg.algorithm.aggregation, batch.segment_ids
    )
    acc = GradAccumulator(
        grads=jax.tree.map(jnp.add, acc.grads, grads),
        metrics={k: acc.metrics[k] + metrics[k] for k in spec.metric_keys},
        normalizer_sum=acc.normalizer_sum + part,
        num_micro_batches=acc.num_micro_batches + 1,
    )
    return acc, metrics


def apply(
    spec: StepSpec, state: TrainState, acc: GradAccumulator, normalizer_total: jax.Array
) -> tuple[TrainState, GradAccumulator, Metrics]:
    """One optimizer step with grads = acc.grads / normalizer_total (non-finite guarded).

    Returns:
      `(state, zeroed accumulator, metrics)`: batch means (`algorithms.finalize_metrics`)
      plus `grad_norm` (before clipping), `update_norm`, `lr`,
      `num_micro_batches`, `normalizer` and `nonfinite`.
    """
    inv = 1.0 / normalizer_total
    grads = jax.tree.map(lambda g: g * inv, acc.grads)
    trained = state_lib.trainable(state.params, _lora(spec))
    updates, opt_state = make_optimizer(spec.cfg).update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    if _lora(spec):  # the adapters updated, the base as it was
        params = nnx.merge_state(params, state_lib.frozen(state.params))
    metrics = algorithms.finalize_metrics(acc.metrics, normalizer_total)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics.get("loss", grad_norm))
    metrics |= {
        "grad_norm": grad_norm,
        "update_norm": optax.tree.norm(updates),
        "lr": lr_schedule(spec.cfg)(state.step),
        "num_micro_batches": acc.num_micro_batches.astype(_F32),
        "normalizer": normalizer_total,
        "nonfinite": (~finite).astype(_F32),
    }
    # Non-finite guard (module docstring): an elementwise select, not a cond, so
    # it fuses into the update and writes into the donated buffers.
    params, opt_state, step = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old),
        (params, opt_state, state.step + 1),
        (state.params, state.opt_state, state.step),
    )
    new_state = TrainState(params=params, opt_state=opt_state, step=step, rng=state.rng)
    return new_state, init_accumulator(spec), metrics


def apply_accumulated(
    spec: StepSpec, state: TrainState, acc: GradAccumulator
) -> tuple[TrainState, GradAccumulator, Metrics]:
    """`apply` with N = acc.normalizer_sum (the summed normalizer parts)."""
    return apply(spec, state, acc, acc.normalizer_sum)


def forward(spec: StepSpec, params: nnx.State, batch: TrainBatch) -> jax.Array:
    """Policy: log pi(targets); critic: values; f32[B, T], 0 off the loss mask."""
    return spec.forward(nnx.merge(spec.graphdef, params), spec.cfg, batch)


def fill_targets(spec: StepSpec, params: nnx.State, batch: TrainBatch) -> TrainBatch:
    """`batch` with the targets the kind derives from its forward (critic: GAE)."""
    return spec.targets(batch, forward(spec, params, batch), spec.cfg)


def copy_params(spec: StepSpec, params: nnx.State) -> nnx.State:
    """A distinct copy of `params` (new buffers)."""
    del spec
    return jax.tree.map(jnp.copy, params)


def _in_activation_sharding(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced with the training mesh's activation layout open
    (`sharding.activation_sharding`: what `ModelConfig.sequence_parallel` pins)."""

    @functools.wraps(fn)  # keeps the signature: `donate_argnames` reads it
    def traced(*args, **kwargs):
        with sharding.activation_sharding(mesh, "train"):
            return fn(*args, **kwargs)

    return traced


# Trainers of equal statics share their jits, as engines do (`generation.executables`): a
# rebuilt trainer (a resume in the same process, a learner restarted after a failure, the
# next run of a sweep) traces, lowers and compiles nothing its predecessor did. Bounded, so
# a process that builds trainers of many models or meshes does not keep every executable;
# an evicted entry only stops being shared, the trainers holding it keep working.
_SHARED: collections.OrderedDict[tuple, dict[str, Callable]] = collections.OrderedDict()
_SHARED_MAX = 16
_shared_lock = threading.Lock()


def _compile(
    spec: StepSpec, state_sh: TrainState, acc_sh: GradAccumulator, batch_sh: NamedSharding
) -> dict[str, Callable]:
    """The jitted steps of `spec` on these shardings: those of an equal earlier trainer, or
    new ones (`_jit`). The key is the spec (hashable: model structure, configs and
    module-level functions) and the shardings, pytrees of `NamedSharding`s by structure and
    leaves."""
    trees = (jax.tree.flatten(t) for t in (state_sh, acc_sh))
    key = (spec, *((treedef, tuple(leaves)) for leaves, treedef in trees), batch_sh)
    with _shared_lock:
        if key in _SHARED:
            _SHARED.move_to_end(key)
            return _SHARED[key]
    jitted = _jit(spec, state_sh, acc_sh, batch_sh)
    with _shared_lock:
        jitted = _SHARED.setdefault(key, jitted)
        while len(_SHARED) > _SHARED_MAX:
            _SHARED.popitem(last=False)
    return jitted


def _jit(
    spec: StepSpec, state_sh: TrainState, acc_sh: GradAccumulator, batch_sh: NamedSharding
) -> dict[str, Callable]:
    """The one place that calls `jax.jit`: every step function, `spec` bound, sharded."""
    rep = state_lib.replicated(batch_sh.mesh)
    params_sh, step_out = state_sh.params, (state_sh, acc_sh, rep)
    table = {  # name: (function, in_shardings, out_shardings, donate_argnames)
        "init": (init_state, (rep,), state_sh, ()),
        "from_params": (state_from_params, (params_sh, rep), state_sh, ()),
        "init_acc": (init_accumulator, (), acc_sh, ()),
        "accumulate": (accumulate, (state_sh, acc_sh, batch_sh, rep), (acc_sh, rep), ("acc",)),
        "apply": (apply, (state_sh, acc_sh, rep), step_out, ("state", "acc")),
        "apply_acc": (apply_accumulated, (state_sh, acc_sh), step_out, ("state", "acc")),
        "forward": (forward, (params_sh, batch_sh), batch_sh, ()),
        "fill_targets": (fill_targets, (params_sh, batch_sh), batch_sh, ()),
        "copy": (copy_params, (params_sh,), params_sh, ()),
    }
    return {
        name: jax.jit(
            _in_activation_sharding(functools.partial(fn, spec), batch_sh.mesh),
            in_shardings=in_sh,
            out_shardings=out_sh,
            donate_argnames=donate,
        )
        for name, (fn, in_sh, out_sh, donate) in table.items()
    }


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One of the trainer's jitted steps and abstract arguments to lower it on, so that it
    compiles ahead of time (for a pod that is not attached) with no array made.

    Attributes:
      fn: the jit, with the trainer's in/out shardings and donation.
      args: ShapeDtypeStructs placed as the trainer places the step's arguments.
    """

    fn: Callable
    args: tuple

    def lower(self) -> jax.stages.Lowered:
        """`fn` lowered on `args`."""
        return self.fn.lower(*self.args)


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """Shardings and jitted step functions of one trained model (policy or critic).

    Build with `make_policy_trainer` or `critic.make_critic_trainer`. All
    methods dispatch asynchronously; none blocks the host.

    Attributes:
      kind: "policy" or "critic".
      graphdef: static NNX structure of the model (merge with params to rebuild).
      cfg: the trainer config.
      mesh: training mesh, axes ("fsdp", "tp").
      optimizer: the optax transformation.
      spec: the StepSpec every jitted function was built from.
      state_shardings: TrainState of NamedShardings.
      acc_shardings: GradAccumulator of NamedShardings (grads like params).
      batch_sharding: NamedSharding of every TrainBatch leaf (rows over "fsdp").
      scalar_sharding: replicated NamedSharding for scalars.
      metric_keys: keys of the additive micro-batch metrics.
    """

    kind: str
    graphdef: nnx.GraphDef
    cfg: TrainerConfig
    mesh: Mesh
    optimizer: optax.GradientTransformation
    spec: StepSpec
    state_shardings: TrainState
    acc_shardings: GradAccumulator
    batch_sharding: NamedSharding
    scalar_sharding: NamedSharding
    metric_keys: tuple[str, ...]
    _init: Callable[..., TrainState]
    _from_params: Callable[..., TrainState]
    _init_acc: Callable[[], GradAccumulator]
    _accumulate: Callable[..., tuple[GradAccumulator, Metrics]]
    _apply: Callable[..., tuple[TrainState, GradAccumulator, Metrics]]
    _apply_acc: Callable[..., tuple[TrainState, GradAccumulator, Metrics]]
    _forward: Callable[..., jax.Array]
    _fill_targets: Callable[..., TrainBatch]
    _copy: Callable[[nnx.State], nnx.State]

    def _seed(self, seed: int) -> jax.Array:
        return jax.device_put(np.int32(seed), self.scalar_sharding)

    def init_state(self, seed: int = 0) -> TrainState:
        """A fresh sharded TrainState (model params from the model's own seed)."""
        return self._init(self._seed(seed))

    def state_from_params(self, params: nnx.State, seed: int = 0) -> TrainState:
        """A TrainState around given params (e.g. loaded weights; copied, not donated)."""
        return self._from_params(params, self._seed(seed))

    def init_accumulator(self) -> GradAccumulator:
        """An all-zero sharded GradAccumulator."""
        return self._init_acc()

    def accumulate(
        self, state: TrainState, acc: GradAccumulator, batch: TrainBatch, normalizer: jax.Array
    ) -> tuple[GradAccumulator, Metrics]:
        """Adds one micro-batch's gradients of S_micro / normalizer into `acc` (donated).

        Args:
          state: current TrainState (not modified).
          acc: accumulator; donated, use the returned one.
          batch: device TrainBatch (`place_batch`), a bucket shape.
          normalizer: f32[] device scalar: the global N or 1 (module docstring).

        Returns:
          `(acc, metrics)`: the new accumulator and this micro-batch's additive metrics.
        """
        return self._accumulate(state, acc, batch, normalizer)

    def apply(
        self,
        state: TrainState,
        acc: GradAccumulator,
        normalizer_total: jax.Array | None = None,
    ) -> tuple[TrainState, GradAccumulator, Metrics]:
        """One optimizer step with grads = acc.grads / normalizer_total.

        Args:
          state: donated.
          acc: donated; a zeroed accumulator comes back in its buffers.
          normalizer_total: f32[] device scalar; None uses `acc.normalizer_sum`.

        Returns:
          `(state, zeroed acc, metrics)`; metrics are batch means (`x_sum` ->
          per-token `x`, loss terms / normalizer_total) plus `grad_norm`
          (before clipping), `update_norm`, `lr`, `num_micro_batches`,
          `normalizer` and `nonfinite` (1.0 if the loss or gradient norm was
          NaN/Inf and the state came back unchanged, else 0.0).
        """
        if normalizer_total is None:
            return self._apply_acc(state, acc)
        return self._apply(state, acc, normalizer_total)

    def forward(self, params: nnx.State, batch: TrainBatch) -> jax.Array:
        """Policy: log pi(targets) f32[B, T]; critic: values f32[B, T]; 0 off the loss mask."""
        return self._forward(params, batch)

    def logprobs(self, params: nnx.State, batch: TrainBatch) -> jax.Array:
        """Forward-only token log-probs (reference / old log-probs) f32[B, T]."""
        if self.kind != "policy":
            raise ValueError(f"logprobs() needs a policy trainer, this one is a {self.kind}")
        return self._forward(params, batch)

    def fill_gae(self, params: nnx.State, batch: TrainBatch) -> TrainBatch:
        """Critic: `batch` with GAE advantages, returns and old values, per sample (`fill`:
        one jitted call per streamed micro-batch, the critic's values under `params`,
        then `critic.with_gae`; no coupling across samples)."""
        return self.fill(params, batch)

    def fill(self, params: nnx.State, batch: TrainBatch) -> TrainBatch:
        """`batch` with what this kind derives from its forward under `params` (critic:
        GAE, `fill_gae`; process reward model: process rewards in the advantages)."""
        if self.spec.targets is None:
            raise ValueError(f"fill() needs a trainer with targets, this one is a {self.kind}")
        return self._fill_targets(params, batch)

    def copy_params(self, params: nnx.State) -> nnx.State:
        """A distinct sharded copy (a frozen reference model that survives donation)."""
        return self._copy(params)

    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """Explicit host-to-device transfer of a (numpy) TrainBatch, rows over "fsdp".

        On a training mesh that spans processes, `batch` is this process's rows of the
        global micro-batch (`pipeline/shards.py`)."""
        if self.mesh.is_multi_process:
            return jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch
            )
        return jax.device_put(batch, self.batch_sharding)

    def scalar(self, value: float) -> jax.Array:
        """An explicit f32[] device scalar (normalisers)."""
        return jax.device_put(np.float32(value), self.scalar_sharding)

    def programs(self, rows: int, seq: int) -> dict[str, StepProgram]:
        """The optimizer step's programs at one micro-batch shape, ready to lower.

        Args:
          rows: micro-batch rows (a multiple of the mesh's "fsdp" size).
          seq: micro-batch columns.

        Returns:
          `{"init": seed -> state, "accumulate": (state, acc, batch, normalizer),
          "apply": (state, acc, normalizer_total)}`: the jits `init_state`, `accumulate`
          and `apply` call, each with abstract arguments in the trainer's shardings.
        """
        fsdp = self.mesh.shape.get("fsdp", 1)
        if rows % fsdp:
            raise ValueError(f"rows={rows}: not divisible by the training mesh's fsdp {fsdp}")
        seed = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.scalar_sharding)
        state = sharding.placed_structs(jax.eval_shape(self._init, seed), self.state_shardings)
        acc = sharding.placed_structs(jax.eval_shape(self._init_acc), self.acc_shardings)
        batch = sharding.placed_structs(
            abstract_batch(rows, seq, self.cfg.routing_replay), self.batch_sharding
        )
        scalar = jax.ShapeDtypeStruct((), _F32, sharding=self.scalar_sharding)
        return {
            "init": StepProgram(self._init, (seed,)),
            "accumulate": StepProgram(self._accumulate, (state, acc, batch, scalar)),
            "apply": StepProgram(self._apply, (state, acc, scalar)),
        }


def build_trainer(
    kind: str,
    create: Callable[[ModelConfig, int], nnx.Module],
    model_cfg: ModelConfig,
    cfg: TrainerConfig,
    mesh: Mesh,
    *,
    model_seed: int,
    loss: LossFn,
    forward: ForwardFn,
    targets: TargetsFn | None = None,
) -> Trainer:
    """Shardings, the StepSpec and the jitted step functions of one model.

    Raises:
      ValueError: a batch bucket not divisible by the mesh's "fsdp" size.
    """
    fsdp = mesh.shape.get("fsdp", 1)
    bad = [b for b in cfg.batch_buckets if b % fsdp]
    if bad:
        raise ValueError(
            f"TrainerConfig.batch_buckets={cfg.batch_buckets}: {bad} not divisible by the "
            f"training mesh's fsdp size {fsdp} (batch rows are sharded over it)"
        )
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: create(model_cfg, model_seed)))
    spec = StepSpec(kind, graphdef, cfg, model_cfg, model_seed, create, loss, forward, targets)
    _, abstract_metrics = jax.eval_shape(
        functools.partial(loss_and_metrics, spec),
        abstract_params,
        abstract_batch(cfg.batch_buckets[0], cfg.seq_buckets[0], cfg.routing_replay),
        jax.ShapeDtypeStruct((), _F32),
    )
    spec = dataclasses.replace(spec, metric_keys=tuple(sorted(abstract_metrics)))
    optimizer = make_optimizer(cfg)
    lora = model_cfg.lora_rank > 0
    state_sh = state_lib.train_state_shardings(abstract_params, optimizer, mesh, lora)
    acc_sh = state_lib.accumulator_shardings(state_sh, mesh, lora)
    batch_sh = NamedSharding(mesh, PartitionSpec("fsdp"))
    jitted = _compile(spec, state_sh, acc_sh, batch_sh)
    return Trainer(
        kind=kind,
        graphdef=graphdef,
        cfg=cfg,
        mesh=mesh,
        optimizer=optimizer,
        spec=spec,
        state_shardings=state_sh,
        acc_shardings=acc_sh,
        batch_sharding=batch_sh,
        scalar_sharding=state_lib.replicated(mesh),
        metric_keys=spec.metric_keys,
        **{f"_{name}": fn for name, fn in jitted.items()},
    )


def make_policy_trainer(
    model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *, model_seed: int = 0
) -> Trainer:
    """The policy (actor) trainer of a Llama-family model on the training mesh.

    Args:
      model_cfg: architecture; `dtype="bfloat16"` gives bf16 compute with float32
        master weights (`param_dtype="float32"`).
      cfg: optimizer and loss settings.
      mesh: training mesh, axes ("fsdp", "tp").
      model_seed: parameter-initialisation seed of `init_state`.
    """
    if cfg.algorithm.router_aux_coef and not model_cfg.num_experts:
        raise UserError(
            f"algorithm.router_aux_coef={cfg.algorithm.router_aux_coef}: the model has no "
            "experts (a load-balancing loss is for mixture-of-experts models)"
        )
    return build_trainer(
        "policy",
        llama.create,
        model_cfg,
        cfg,
        mesh,
        model_seed=model_seed,
        loss=policy_loss,
        forward=policy_forward,
    )
