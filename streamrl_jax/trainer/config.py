"""Typed trainer configuration and the optax optimizer it describes.

One frozen, keyword-only dataclass holds everything a trainer step needs to
know that is not an array: the optimizer (AdamW, learning-rate schedule,
global-norm clipping), the RL loss chosen by config name from
`streamrl_jax.algorithms`, the PPO critic's knobs, and the shape buckets that
bound the number of compilations. Impossible values fail in `__post_init__`
with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from streamrl_jax.algorithms import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

LR_SCHEDULES = ("constant", "cosine")
NONFINITE_MODES = ("skip", "stop")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Optimizer, loss and shape-bucket settings of one trained model (policy or critic).

    Attributes:
      learning_rate: peak learning rate of AdamW.
      lr_schedule: "constant" (after warm-up) or "cosine" (decay to
        `min_lr_ratio * learning_rate` at `total_steps`).
      warmup_steps: linear warm-up length in optimizer steps; step s (0-based)
        uses `learning_rate * min(1, (s + 1) / warmup_steps)`, so the first step
        is never a wasted zero-lr step. 0 disables warm-up.
      total_steps: optimizer steps of the run (end of the cosine decay).
      min_lr_ratio: final learning rate of the cosine schedule / peak.
      adam_b1: AdamW first-moment decay.
      adam_b2: AdamW second-moment decay.
      adam_eps: AdamW epsilon.
      weight_decay: decoupled weight decay; never applied to norm scales or biases.
      max_grad_norm: clip the (normalised) gradient to this global L2 norm; None
        disables clipping.
      policy_loss: name in `algorithms.POLICY_LOSSES` ("ppo_clip", "dapo").
      aggregation: name in `algorithms.AGGREGATIONS`; decides the normaliser N
        (see `algorithms.losses`).
      clip_eps_low: PPO lower clip, ratio >= 1 - clip_eps_low.
      clip_eps_high: PPO upper clip, ratio <= 1 + clip_eps_high (DAPO: 0.28).
      dual_clip_c: dual-clip constant c > 1, or None.
      tis_cap: truncated-importance-sampling cap. None: the PPO ratio is taken
        against `TrainBatch.old_logp` alone (pass the behaviour log-probs there
        for the cheap behaviour-as-old mode). A float: the loss is also
        weighted by min(exp(old_logp - behaviour_logp), tis_cap).
      kl_coef: weight of the in-loss KL(pi || pi_ref) penalty (needs
        `TrainBatch.ref_logp`); 0 disables it.
      kl_estimator: name in `algorithms.KL_ESTIMATORS` ("k1", "k2", "k3").
      entropy_coef: weight of the entropy bonus (subtracted from the loss).
      value_clip_eps: critic only: clip of the PPO value loss, None for the
        plain squared error.
      gae_gamma: critic only: GAE discount.
      gae_lambda: critic only: GAE lambda.
      whiten_advantages: critic only: whiten GAE advantages over the batch
        (couples the whole batch: call `critic.with_gae` on the complete batch).
      logprob_chunk: sequence chunk of the vocabulary projection
        (`Llama.token_logprobs`); bounds peak logits memory to [B, chunk, V].
      seq_buckets: allowed padded sequence lengths T, ascending; a batch is
        padded to the smallest bucket that fits.
      batch_buckets: allowed padded micro-batch sizes B, ascending; each must
        be divisible by the training mesh's "fsdp" size (the batch is sharded
        over it). Compilations per jitted step <= len(seq) * len(batch) buckets.
      nonfinite: what a step whose loss or gradient norm is NaN/Inf does. Either
        way `apply` leaves the whole TrainState (params, optimizer state, step)
        unchanged on device and reports metric `nonfinite` = 1. "skip": training
        goes on with the next batch. "stop": the pipeline raises
        `step.NonFiniteError` when it fetches that metric.
    """

    learning_rate: float = 1e-6
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    policy_loss: str = "ppo_clip"
    aggregation: str = "token_mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    value_clip_eps: float | None = 0.2
    gae_gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten_advantages: bool = True
    logprob_chunk: int = 128
    seq_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    batch_buckets: tuple[int, ...] = (8, 16, 32, 64)
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        def fail(field: str, why: str) -> None:
            raise ValueError(f"TrainerConfig.{field}={getattr(self, field)!r}: {why}")

        choices = {
            "lr_schedule": LR_SCHEDULES,
            "policy_loss": tuple(POLICY_LOSSES),
            "aggregation": AGGREGATIONS,
            "kl_estimator": tuple(KL_ESTIMATORS),
            "nonfinite": NONFINITE_MODES,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                fail(field, f"expected one of {list(allowed)}")
        if not self.learning_rate > 0:
            fail("learning_rate", "must be > 0")
        for field in ("warmup_steps", "total_steps"):
            if getattr(self, field) < 0:
                fail(field, "must be >= 0")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            fail("total_steps", "must exceed warmup_steps for the cosine schedule")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("min_lr_ratio", "must be in [0, 1]")
        for field in ("weight_decay", "kl_coef", "entropy_coef"):
            if getattr(self, field) < 0:
                fail(field, "must be >= 0")
        for field in ("max_grad_norm", "tis_cap", "value_clip_eps"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                fail(field, "must be > 0 or None")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            fail("dual_clip_c", "must be > 1 or None")
        if self.logprob_chunk < 1:
            fail("logprob_chunk", "must be >= 1")
        for field in ("seq_buckets", "batch_buckets"):
            buckets = getattr(self, field)
            if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                fail(field, "must be a non-empty, strictly ascending tuple of positive ints")

    def replace(self, **kwargs: Any) -> TrainerConfig:
        return dataclasses.replace(self, **kwargs)

    @property
    def policy_options(self) -> dict[str, Any]:
        """Keyword hyper-parameters of the configured policy loss."""
        return {
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "dual_clip_c": self.dual_clip_c,
        }


def lr_schedule(cfg: TrainerConfig) -> Callable[[jax.Array], jax.Array]:
    """The learning rate as a jit-friendly function of the 0-based step count.

    lr(s) = peak * warm(s) * decay(s), warm(s) = min(1, (s + 1) / warmup_steps)
    (1 without warm-up), decay(s) = 1 for "constant" and, for "cosine",
    r + (1 - r) * (1 + cos(pi * p)) / 2 with p = clip((s - warmup) / (total -
    warmup), 0, 1) and r = `min_lr_ratio`.
    """
    peak, warmup = cfg.learning_rate, cfg.warmup_steps

    def schedule(step: jax.Array) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (s + 1.0) / warmup) if warmup else jnp.float32(1.0)
        if cfg.lr_schedule == "constant":
            return peak * warm
        progress = jnp.clip((s - warmup) / (cfg.total_steps - warmup), 0.0, 1.0)
        r = cfg.min_lr_ratio
        return peak * warm * (r + (1.0 - r) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))

    return schedule


def _decay_mask(params: Any) -> Any:
    """True for matrices; False for norm scales and biases (no weight decay there)."""

    def one(path: tuple[Any, ...], leaf: Any) -> bool:
        name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
        return not (name.endswith("norm") or name.endswith("bias"))

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with `lr_schedule(cfg)`."""
    adamw = optax.adamw(
        lr_schedule(cfg),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=_decay_mask,
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
