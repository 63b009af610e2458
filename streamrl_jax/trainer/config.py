"""Trainer configuration in the user's vocabulary, and the optax optimizer it describes.

`TrainerConfig` holds the user's own config sections (`algorithm`,
`optimizer`, `critic`, `trainer`, from `streamrl_jax.config`), not renamed copies, plus
the few things a trainer needs that the experiment derives: the run's
optimizer-step count and the shape buckets. The user's conventions ("0 =
off" for `dual_clip`, `tis_cap`, `max_grad_norm`, `value_clip`;
`clip_eps_high` used only by `dapo`) are interpreted here and nowhere else,
by the properties of `TrainerConfig`.

`trainer_config(cfg, fsdp=...)` and `critic_trainer_config(cfg, fsdp=...)`
are the one mapping from an `ExperimentConfig`. A bad field fails with the
message `config.validate` gives at start-up (`algorithm.policy_loss='x';
expected one of (...)`), whichever way the config was built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from streamrl_jax import config as config_lib
from streamrl_jax.config import (
    AlgorithmSection,
    CriticSection,
    ExperimentConfig,
    OptimizerSection,
    TrainerSection,
)
from streamrl_jax.model import routes as routes_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Everything a trainer step needs that is not an array (policy or critic).

    Attributes:
      algorithm: the user's `algorithm` section: policy loss, aggregation (it
        decides the normaliser N, see `algorithms.losses`), clipping, KL,
        entropy, truncated importance sampling.
      optimizer: the user's `optimizer` section: AdamW, warm-up, schedule,
        clipping. A critic's trainer gets it with `critic.learning_rate`
        (`critic_trainer_config`).
      critic: the user's `critic` section: value-loss clip and GAE's gamma and
        lambda (read by the critic's trainer only).
      trainer: the user's `trainer` section: the micro-batch layout
        (`shared_prompt`, `pack`; `layout` hands them to `make_batch`).
      total_steps: optimizer steps of the run (the end of the cosine decay).
      seq_buckets: allowed padded sequence lengths T, ascending; a batch is
        padded to the smallest bucket that fits.
      batch_buckets: allowed padded micro-batch sizes B, ascending; each must
        be divisible by the training mesh's "fsdp" size (the batch is sharded
        over it). Compilations per jitted step <= len(seq) * len(batch) buckets.
      logprob_chunk: sequence chunk of the vocabulary projection
        (`Llama.token_logprobs`); bounds peak logits memory to [B, chunk, V]. The
        batch's `loss_columns` width is a multiple of it (`make_batch(loss_chunk=)`).
      routing_replay: the model's route size when the policy replays the experts its
        tokens went to in generation (`model.routing_replay`; batches then carry
        `routes`); None: the trainer routes every token itself.
      nonfinite: the user's `pipeline.nonfinite`. Either way `apply` leaves the
        whole TrainState unchanged on device for a step whose loss or gradient
        norm is NaN/Inf and reports metric `nonfinite` = 1. "skip": training
        goes on; "stop": the pipeline raises `step.NonFiniteError` when it
        fetches that metric.
    """

    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerSection = OptimizerSection()
    critic: CriticSection = CriticSection()
    trainer: TrainerSection = TrainerSection()
    total_steps: int = 1000
    seq_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    batch_buckets: tuple[int, ...] = (8, 16, 32, 64)
    logprob_chunk: int = 128
    nonfinite: str = "skip"
    routing_replay: routes_lib.Spec | None = None

    def __post_init__(self) -> None:
        for name in ("algorithm", "optimizer", "critic", "trainer"):
            config_lib.check_section(name, getattr(self, name))
        if self.nonfinite not in config_lib.NONFINITE:
            raise ValueError(
                f"pipeline.nonfinite={self.nonfinite!r}; expected one of {config_lib.NONFINITE}"
            )

        def require(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"TrainerConfig.{field}={getattr(self, field)!r}: {why}")

        require(self.total_steps >= 1, "total_steps", "must be >= 1")
        require(self.logprob_chunk >= 1, "logprob_chunk", "must be >= 1")
        if self.optimizer.schedule == "cosine" and self.total_steps <= self.optimizer.warmup_steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) must be below the "
                f"run's optimizer steps ({self.total_steps}) for the cosine schedule"
            )
        for field in ("seq_buckets", "batch_buckets"):
            buckets = getattr(self, field)
            require(
                bool(buckets) and min(buckets) >= 1 and list(buckets) == sorted(set(buckets)),
                field,
                "must be a non-empty, strictly ascending tuple of positive ints",
            )

    def replace(self, **kwargs: Any) -> TrainerConfig:
        return dataclasses.replace(self, **kwargs)

    # The user's conventions, interpreted here only.

    @property
    def clip_eps_high(self) -> float:
        """Upper PPO clip: `algorithm.clip_eps_high` for dapo, else symmetric `clip_eps`."""
        a = self.algorithm
        return a.clip_eps_high if a.policy_loss == "dapo" else a.clip_eps

    @property
    def dual_clip_c(self) -> float | None:
        """`algorithm.dual_clip`, None when 0 (off)."""
        return self.algorithm.dual_clip or None

    @property
    def tis_cap(self) -> float | None:
        """`algorithm.tis_cap`, None when 0 (off: the ratio is against `old_logp` alone)."""
        return self.algorithm.tis_cap or None

    @property
    def max_grad_norm(self) -> float | None:
        """`optimizer.max_grad_norm`, None when 0 (no clipping)."""
        return self.optimizer.max_grad_norm or None

    @property
    def value_clip(self) -> float | None:
        """`critic.value_clip`, None when 0 (plain squared error)."""
        return self.critic.value_clip or None

    @property
    def layout(self) -> dict[str, Any]:
        """`make_batch`'s layout keywords: the buckets, `shared_prompt`, `pack`, the
        response-only projection's chunk (`loss_chunk`) and the route size replayed."""
        return {
            "routing_replay": self.routing_replay,
            "seq_buckets": self.seq_buckets,
            "batch_buckets": self.batch_buckets,
            "shared_prompt": self.trainer.shared_prompt,
            "pack": self.trainer.pack,
            "loss_chunk": self.logprob_chunk,
        }

    @property
    def policy_options(self) -> dict[str, Any]:
        """Keyword hyper-parameters of `algorithm.policy_loss` (`algorithms.POLICY_LOSSES`)."""
        return {
            "clip_eps_low": self.algorithm.clip_eps,
            "clip_eps_high": self.clip_eps_high,
            "dual_clip_c": self.dual_clip_c,
        }


def _buckets(limit: int, start: int, multiple: int = 1) -> tuple[int, ...]:
    """Powers of two from `start` (rounded up to `multiple`) up to and including `limit`."""
    out, b = [], start
    while b < limit:
        out.append(-(-b // multiple) * multiple)
        b *= 2
    out.append(-(-limit // multiple) * multiple)
    return tuple(sorted(set(out)))


def _row_buckets(limit: int) -> tuple[int, ...]:
    """64, 96, 128, 192, 256, 384, ... (powers of two and 1.5x them) below `limit`, then
    `limit`: a padded row wastes at most a third of itself, not half."""
    out, b = [], 64
    while b < limit:
        out += [b] + ([b * 3 // 2] if b * 3 // 2 < limit else [])
        b *= 2
    return (*out, limit)


def trainer_config(cfg: ExperimentConfig, *, fsdp: int) -> TrainerConfig:
    """The policy trainer's config of an experiment.

    Args:
      cfg: the validated experiment.
      fsdp: the training mesh's "fsdp" size; every batch bucket is a multiple of it.

    Returns:
      A TrainerConfig with the user's algorithm, optimizer, critic and trainer
      sections and `total_steps = max(pipeline.steps * pipeline.mini_batches, 1)`.
      Buckets: one sample per row (`trainer.shared_prompt` and `trainer.pack`
      off): sequence buckets up to `model.max_context`, batch buckets from 8 up to
      one micro-batch (`pipeline.micro_batch_groups * pipeline.group_size`
      samples). Shared-prompt or packed rows: sequence buckets up to
      `row_length(cfg)` in steps of 1.5x and 2x (`_row_buckets`: a packed row
      holds a whole group, so the bucket's rounding is its pad waste), batch
      buckets from 1 row up to that many rows (one sample per row is the most a
      micro-batch can need). With `model.sequence_parallel` every sequence bucket is
      rounded up to a multiple of `mesh.train_tp`.
    """
    p = cfg.pipeline
    micro = p.micro_batch_groups * p.group_size
    if cfg.trainer.shared_prompt or cfg.trainer.pack:
        seq_buckets = _row_buckets(row_length(cfg))
        batch_buckets = _buckets(micro, 1, multiple=fsdp)
    else:
        seq_buckets = _buckets(cfg.model.max_context, 64)
        batch_buckets = _buckets(micro, min(8, micro), multiple=fsdp)
    if cfg.model.sequence_parallel:  # the sequence splits over tp: whole multiples of it
        tp = cfg.mesh.train_tp
        seq_buckets = tuple(sorted({-(-t // tp) * tp for t in seq_buckets}))
    return TrainerConfig(
        algorithm=cfg.algorithm,
        optimizer=cfg.optimizer,
        critic=cfg.critic,
        trainer=cfg.trainer,
        total_steps=max(p.steps * p.mini_batches, 1),  # optimizer steps
        seq_buckets=seq_buckets,
        batch_buckets=batch_buckets,
        nonfinite=p.nonfinite,
    )


# Auto row length cap: attention over a row costs O(T^2) and a packed row still
# computes its masked pairs, so rows stay short unless the user asks otherwise.
_AUTO_ROW_CAP = 1024


def row_length(cfg: ExperimentConfig) -> int:
    """The longest training row: `trainer.row_tokens`, or auto.

    Auto: the longest possible group with a shared prompt,
    max_prompt_len - 1 + group_size * (max_new_tokens + 1) (`trainer.packing`),
    at most 1024 tokens, and never below `model.max_context` (one sample always
    fits a row). A group longer than the row is split over rows.
    """
    t, g, p = cfg.trainer, cfg.generation, cfg.pipeline
    if t.row_tokens:
        return t.row_tokens
    if not t.shared_prompt:
        return cfg.model.max_context
    group = g.max_prompt_len - 1 + p.group_size * (g.max_new_tokens + 1)
    return max(cfg.model.max_context, min(group, _AUTO_ROW_CAP))


def own_model_trainer_config(
    cfg: ExperimentConfig, *, fsdp: int, learning_rate: float
) -> TrainerConfig:
    """The config of a model a target trains beside the policy (the critic, the process
    reward model): the policy's, with `learning_rate` as peak lr.

    It shares every other `optimizer.*` setting (schedule, warm-up, clipping, AdamW
    moments) and the shape buckets, so both models step in lockstep over the same
    micro-batches.
    """
    policy = trainer_config(cfg, fsdp=fsdp)
    optimizer = dataclasses.replace(cfg.optimizer, learning_rate=learning_rate)
    return policy.replace(optimizer=optimizer)


def critic_trainer_config(cfg: ExperimentConfig, *, fsdp: int) -> TrainerConfig:
    """The critic trainer's config: the policy's, with `critic.learning_rate` as peak lr."""
    return own_model_trainer_config(cfg, fsdp=fsdp, learning_rate=cfg.critic.learning_rate)


def lr_schedule(cfg: TrainerConfig) -> Callable[[jax.Array], jax.Array]:
    """The learning rate as a jit-friendly function of the 0-based step count.

    lr(s) = peak * warm(s) * decay(s), warm(s) = min(1, (s + 1) / warmup_steps)
    (1 without warm-up), decay(s) = 1 for "constant" and, for "cosine",
    r + (1 - r) * (1 + cos(pi * p)) / 2 with p = clip((s - warmup) / (total -
    warmup), 0, 1) and r = `optimizer.min_lr_ratio`.
    """
    o = cfg.optimizer
    peak, warmup = o.learning_rate, o.warmup_steps

    def schedule(step: jax.Array) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup else jnp.float32(1.0)
        if o.schedule == "constant":
            return peak * warm
        progress = jnp.clip((s - warmup) / (cfg.total_steps - warmup), 0.0, 1.0)
        r = o.min_lr_ratio
        return peak * warm * (r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))

    return schedule


def _decay_mask(params: Any) -> Any:
    """True for matrices; False for norm scales and biases (no weight decay there)."""

    def one(path: tuple[Any, ...], leaf: Any) -> bool:
        name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
        return not (name.endswith("norm") or name.endswith("bias"))

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clipping (unless `optimizer.max_grad_norm` is 0), then AdamW."""
    o = cfg.optimizer
    adamw = optax.adamw(
        lr_schedule(cfg),
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mask=_decay_mask,
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
