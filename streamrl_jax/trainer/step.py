"""Jitted trainer steps: streamed gradient accumulation, optimizer apply, forward-only.

One `Trainer` (policy or critic) owns three jitted functions, each with
explicit in/out shardings on the training mesh and compiled once per
(batch, sequence) bucket:

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
  stream in.

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
(0.0 for a normal step). There is no host sync: with
`TrainerConfig.nonfinite="stop"` the caller raises `NonFiniteError` when it
fetches the metric, one step later, and nothing non-finite was written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax import algorithms
from streamrl_jax.model import llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer import state as state_lib
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig, lr_schedule, make_optimizer
from streamrl_jax.trainer.state import GradAccumulator, Metrics, TrainState

_F32 = jnp.float32
# (params, batch, normalizer) -> (scalar loss S_micro / normalizer, additive metrics)
LossFn = Callable[[nnx.State, TrainBatch, jax.Array], tuple[jax.Array, Metrics]]
# (params, batch) -> f32[B, T]
ForwardFn = Callable[[nnx.State, TrainBatch], jax.Array]


class NonFiniteError(FloatingPointError):
    """An optimizer step had a NaN/Inf loss or gradient norm (`nonfinite="stop"`).

    `Trainer.apply` never raises it (it does not sync with the host); the
    pipeline raises it when it fetches a step's metrics and finds
    `nonfinite == 1`, with a message naming that step. The state the step was
    given is intact (the guard skipped the update).
    """


def shifted_targets(tokens_BxT: jax.Array) -> jax.Array:
    """targets[b, t] = tokens[b, t + 1]; the last column (never trained) gets 0."""
    return jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros_like(tokens_BxT[:, :1])], axis=1)


def policy_logprobs(
    graphdef: nnx.GraphDef, params: nnx.State, batch: TrainBatch, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """(logp f32[B, T], entropy f32[B, T]) of the shifted targets under `params`."""
    model = nnx.merge(graphdef, params)
    return model.token_logprobs(
        batch.tokens, shifted_targets(batch.tokens), batch.attention_mask, chunk=chunk
    )


def policy_loss_fn(graphdef: nnx.GraphDef, cfg: TrainerConfig) -> LossFn:
    """The actor loss of `cfg` (policy loss, aggregation, KL, entropy, TIS) on a Llama."""

    def loss_fn(params: nnx.State, batch: TrainBatch, normalizer: jax.Array):
        logp_BxT, ent_BxT = policy_logprobs(graphdef, params, batch, cfg.logprob_chunk)
        use_tis = cfg.tis_cap is not None
        loss, metrics = algorithms.actor_loss(
            logp_BxT,
            batch.old_logp,
            batch.advantages,
            batch.loss_mask,
            normalizer=normalizer,
            policy_loss=cfg.policy_loss,
            aggregation=cfg.aggregation,
            policy_options=cfg.policy_options,
            behaviour_logp_BxT=batch.behaviour_logp if use_tis else None,
            tis_cap=cfg.tis_cap,
            ref_logp_BxT=batch.ref_logp,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            entropy_BxT=ent_BxT,
            entropy_coef=cfg.entropy_coef,
        )
        mask_BxT = batch.loss_mask.astype(_F32)
        metrics["entropy_sum"] = jnp.sum(jax.lax.stop_gradient(ent_BxT) * mask_BxT)
        return loss, metrics

    return loss_fn


def policy_forward(graphdef: nnx.GraphDef, cfg: TrainerConfig) -> ForwardFn:
    """Forward-only log pi(target) at loss positions (0 elsewhere), f32[B, T]."""

    def forward(params: nnx.State, batch: TrainBatch) -> jax.Array:
        logp_BxT, _ = policy_logprobs(graphdef, params, batch, cfg.logprob_chunk)
        return jnp.where(batch.loss_mask, logp_BxT, 0.0)

    return forward


def finalize_metrics(summed: Metrics, normalizer_total: jax.Array) -> Metrics:
    """On device: `x_sum` -> per-token mean x; loss terms -> divided by normalizer_total."""
    num_tokens = jnp.maximum(summed.get("num_tokens", jnp.zeros((), _F32)), 1.0)
    out: Metrics = {}
    for key, value in summed.items():
        if key.endswith("_sum"):
            out[key[: -len("_sum")]] = value / num_tokens
        elif key == "num_tokens":
            out[key] = value
        else:
            out[key] = value / normalizer_total
    return out


def _abstract_batch(cfg: TrainerConfig) -> TrainBatch:
    b, t = cfg.batch_buckets[0], cfg.seq_buckets[0]
    bt = lambda dt: jax.ShapeDtypeStruct((b, t), dt)
    return TrainBatch(
        tokens=bt(jnp.int32),
        attention_mask=bt(jnp.bool_),
        loss_mask=bt(jnp.bool_),
        advantages=bt(_F32),
        old_logp=bt(_F32),
        behaviour_logp=bt(_F32),
        ref_logp=bt(_F32),
        old_values=bt(_F32),
        returns=bt(_F32),
        rewards=jax.ShapeDtypeStruct((b,), _F32),
    )


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
    _copy: Callable[[nnx.State], nnx.State]

    def init_state(self, seed: int = 0) -> TrainState:
        """A fresh sharded TrainState (model params from the model's own seed)."""
        return self._init(jnp.int32(seed))

    def state_from_params(self, params: nnx.State, seed: int = 0) -> TrainState:
        """A TrainState around given params (e.g. loaded weights; copied, not donated)."""
        return self._from_params(params, jnp.int32(seed))

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

    def copy_params(self, params: nnx.State) -> nnx.State:
        """A distinct sharded copy (a frozen reference model that survives donation)."""
        return self._copy(params)

    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """Explicit host-to-device transfer of a (numpy) TrainBatch, rows over "fsdp".

        On a training mesh that spans processes, `batch` is this process's rows of the
        global micro-batch (`distributed/shards.py`)."""
        if self.mesh.is_multi_process:
            return jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch
            )
        return jax.device_put(batch, self.batch_sharding)

    def scalar(self, value: float) -> jax.Array:
        """An explicit f32[] device scalar (normalisers)."""
        return jax.device_put(np.float32(value), self.scalar_sharding)


def build_trainer(
    kind: str,
    make_module: Callable[[], nnx.Module],
    cfg: TrainerConfig,
    mesh: Mesh,
    loss_builder: Callable[[nnx.GraphDef, TrainerConfig], LossFn],
    forward_builder: Callable[[nnx.GraphDef, TrainerConfig], ForwardFn],
) -> Trainer:
    """Assembles the jitted, sharded step functions of one model.

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
    optimizer = make_optimizer(cfg)
    schedule = lr_schedule(cfg)
    graphdef, st_sh, init = state_lib.state_initializer(make_module, optimizer, mesh)
    acc_sh = state_lib.accumulator_shardings(st_sh, mesh)
    rep = state_lib.replicated(mesh)
    batch_sh = NamedSharding(mesh, PartitionSpec("fsdp"))
    loss_fn = loss_builder(graphdef, cfg)
    forward_fn = forward_builder(graphdef, cfg)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    abstract_params = jax.eval_shape(lambda: nnx.split(make_module())[1])
    _, abstract_metrics = jax.eval_shape(
        loss_fn, abstract_params, _abstract_batch(cfg), jax.ShapeDtypeStruct((), _F32)
    )
    metric_keys = tuple(sorted(abstract_metrics))

    def from_params(params: nnx.State, seed: jax.Array) -> TrainState:
        params = jax.tree.map(jnp.copy, params)
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.key(seed),
        )

    def init_acc() -> GradAccumulator:
        return state_lib.zero_accumulator(abstract_params, metric_keys)

    def accumulate(state: TrainState, acc: GradAccumulator, batch: TrainBatch, normalizer):
        (_, metrics), grads = grad_fn(state.params, batch, normalizer)
        part = algorithms.normalizer_part(batch.loss_mask, cfg.aggregation)
        acc = GradAccumulator(
            grads=jax.tree.map(jnp.add, acc.grads, grads),
            metrics={k: acc.metrics[k] + metrics[k] for k in metric_keys},
            normalizer_sum=acc.normalizer_sum + part,
            num_micro_batches=acc.num_micro_batches + 1,
        )
        return acc, metrics

    def apply(state: TrainState, acc: GradAccumulator, normalizer_total):
        inv = 1.0 / normalizer_total
        grads = jax.tree.map(lambda g: g * inv, acc.grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = finalize_metrics(acc.metrics, normalizer_total)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics.get("loss", grad_norm))
        metrics |= {
            "grad_norm": grad_norm,
            "update_norm": optax.tree.norm(updates),
            "lr": schedule(state.step),
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
        return new_state, init_acc(), metrics

    def apply_acc(state: TrainState, acc: GradAccumulator):
        return apply(state, acc, acc.normalizer_sum)

    step_out = (st_sh, acc_sh, rep)
    return Trainer(
        kind=kind,
        graphdef=graphdef,
        cfg=cfg,
        mesh=mesh,
        optimizer=optimizer,
        state_shardings=st_sh,
        acc_shardings=acc_sh,
        batch_sharding=batch_sh,
        scalar_sharding=rep,
        metric_keys=metric_keys,
        _init=init,
        _from_params=jax.jit(from_params, in_shardings=(st_sh.params, rep), out_shardings=st_sh),
        _init_acc=jax.jit(init_acc, out_shardings=acc_sh),
        _accumulate=jax.jit(
            accumulate,
            in_shardings=(st_sh, acc_sh, batch_sh, rep),
            out_shardings=(acc_sh, rep),
            donate_argnames=("acc",),
        ),
        _apply=jax.jit(
            apply,
            in_shardings=(st_sh, acc_sh, rep),
            out_shardings=step_out,
            donate_argnames=("state", "acc"),
        ),
        _apply_acc=jax.jit(
            apply_acc,
            in_shardings=(st_sh, acc_sh),
            out_shardings=step_out,
            donate_argnames=("state", "acc"),
        ),
        _forward=jax.jit(forward_fn, in_shardings=(st_sh.params, batch_sh), out_shardings=batch_sh),
        _copy=jax.jit(
            lambda p: jax.tree.map(jnp.copy, p),
            in_shardings=(st_sh.params,),
            out_shardings=st_sh.params,
        ),
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
    return build_trainer(
        "policy",
        lambda: llama.create(model_cfg, model_seed),
        cfg,
        mesh,
        policy_loss_fn,
        policy_forward,
    )
