"""The policy (actor) model's loss and forward, as the trainer step calls them.

Both are pure functions of `(model, cfg, batch, ...)`, the model merged from
its params inside the step; `step` differentiates and jits them
(`step.make_policy_trainer`). The critic's counterparts live in `critic`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl_jax import algorithms
from streamrl_jax.model import layers, llama
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig
from streamrl_jax.trainer.state import LossOutput


def shifted_targets(tokens_BxT: jax.Array) -> jax.Array:
    """targets[b, t] = tokens[b, t + 1]; the last column (never trained) gets 0."""
    return jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros_like(tokens_BxT[:, :1])], axis=1)


def policy_logprobs(
    model: llama.Llama, batch: TrainBatch, chunk: int, router_stats: bool = False
) -> tuple[jax.Array, ...]:
    """(logp f32[B, T], entropy f32[B, T]) of the shifted targets under `model` (with
    `router_stats`, a MoE's `llama.RouterReport` too), the experts of `batch.routes`
    replayed when it has them.

    Computed at the loss positions only (the vocabulary projection skips prompt
    and padding columns); 0 elsewhere.
    """
    return model.token_logprobs(
        batch.tokens,
        shifted_targets(batch.tokens),
        batch.attention_mask,
        chunk=chunk,
        segments=batch.segments(),
        columns_BxL=batch.loss_columns,
        router_stats=router_stats,
        routes=batch.routes,
    )


def policy_loss(
    model: llama.Llama, cfg: TrainerConfig, batch: TrainBatch, normalizer: jax.Array
) -> LossOutput:
    """`algorithms.actor_loss` of `cfg.algorithm` (policy loss, aggregation, KL, entropy, TIS).

    Returns:
      `(loss, metrics, per_token)`: S_micro / normalizer, its additive metrics,
      and the per-token statistics the step reports as masked sums
      (`entropy` -> `entropy_sum`; with routing replay `route_flips`, the share of
      layers whose replayed experts differ from the trainer's own choice).
    """
    a = cfg.algorithm
    aux, replay = a.router_aux_coef > 0, batch.routes is not None
    logp_BxT, ent_BxT, *report = policy_logprobs(model, batch, cfg.logprob_chunk, aux or replay)
    loss, metrics = algorithms.actor_loss(
        logp_BxT,
        batch.old_logp,
        batch.advantages,
        batch.loss_mask,
        normalizer=normalizer,
        policy_loss=a.policy_loss,
        aggregation=a.aggregation,
        policy_options=cfg.policy_options,
        behaviour_logp_BxT=None if cfg.tis_cap is None else batch.behaviour_logp,
        tis_cap=cfg.tis_cap,
        ref_logp_BxT=batch.ref_logp,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_BxT=ent_BxT,
        entropy_coef=a.entropy_coef,
        segment_ids_BxT=batch.segment_ids,
    )
    if aux:
        # The router's load-balancing loss of this micro-batch, weighted by its share of
        # the batch's normaliser: summed over the micro-batches, the units' mean.
        part = algorithms.normalizer_part(batch.loss_mask, a.aggregation, batch.segment_ids)
        weighted = layers.router_aux_loss(report[0].load, report[0].routed) * part / normalizer
        loss = loss + a.router_aux_coef * weighted
        metrics = metrics | {"router_aux": weighted}
    per_token = {"entropy": ent_BxT}
    if replay:
        per_token["route_flips"] = report[0].flips
    return loss, metrics, per_token


def policy_forward(model: llama.Llama, cfg: TrainerConfig, batch: TrainBatch) -> jax.Array:
    """Forward-only log pi(target) at loss positions (0 elsewhere), f32[B, T]."""
    logp_BxT, _ = policy_logprobs(model, batch, cfg.logprob_chunk)
    return jnp.where(batch.loss_mask, logp_BxT, 0.0)
