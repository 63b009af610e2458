"""PPO critic: a value head on the policy's architecture, its loss, and GAE targets.

The critic is its own model (own params, own optimizer, own `Trainer`): the
Llama decoder's last hidden state, final RMSNorm, then a value head W_v
[E, 1] (logical axes ("embed", "value_head"): FSDP-sharded like every other
`embed` dimension). Values are aligned with the trainer's prediction
positions: V[b, t] = V(s_t), the state after tokens[b, :t + 1], from which
the response token tokens[b, t + 1] is sampled.

PPO flow for one global batch (after the samples are scored):

1. `values = critic_trainer.forward(critic_state.params, batch)` (forward-only,
   per micro-batch as samples stream in, with the critic's weights from before
   its update on this batch);
2. `batch = with_gae(batch, values, cfg)` on the complete global batch
   (advantage whitening couples all samples; without whitening GAE is per
   sample and can run per micro-batch);
3. policy and critic both `accumulate` over micro-batches and `apply`; the
   critic's loss is `algorithms.value_loss` (clipped around `old_values`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax import algorithms
from streamrl_jax.algorithms import advantages as adv_lib
from streamrl_jax.model import layers, llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig
from streamrl_jax.trainer.step import ForwardFn, LossFn, Trainer, build_trainer

_F32 = jnp.float32


class Critic(nnx.Module):
    """Llama backbone + RMSNorm + linear value head; V(s_t) per position."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.backbone = llama.Llama(cfg, rngs=rngs)
        # Zero init: every value starts at 0 (no baseline) instead of at noise.
        head = jnp.zeros((cfg.hidden_size, 1), cfg.jnp_param_dtype)
        self.value_head = nnx.Param(head, axes=("embed", "value_head"))

    def values(self, tokens_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
        """f32[B, T] values V(s_t) of a padded batch (meaningless on padding)."""
        cfg = self.backbone.cfg
        h_BxTxE = self.backbone.hidden_states(tokens_BxT, mask_BxT)
        h_BxTxE = layers.rms_norm(h_BxTxE, self.backbone.final_norm[...], cfg.rms_norm_eps)
        w_Ex1 = self.value_head[...].astype(h_BxTxE.dtype)
        return jnp.einsum("bte,eo->bto", h_BxTxE, w_Ex1)[..., 0].astype(_F32)


def critic_values(graphdef: nnx.GraphDef, params: nnx.State, batch: TrainBatch) -> jax.Array:
    """f32[B, T] values of `batch` under critic `params` (call inside jit)."""
    return nnx.merge(graphdef, params).values(batch.tokens, batch.attention_mask)


def critic_loss_fn(graphdef: nnx.GraphDef, cfg: TrainerConfig) -> LossFn:
    """Clipped PPO value loss against `batch.returns`, clipped around `batch.old_values`."""

    def loss_fn(params: nnx.State, batch: TrainBatch, normalizer: jax.Array):
        values_BxT = critic_values(graphdef, params, batch)
        loss, metrics = algorithms.value_loss(
            values_BxT,
            batch.old_values,
            batch.returns,
            batch.loss_mask,
            normalizer=normalizer,
            aggregation=cfg.aggregation,
            clip_eps=cfg.value_clip_eps,
        )
        mask_BxT = batch.loss_mask.astype(_F32)
        metrics["num_tokens"] = jnp.sum(mask_BxT)
        metrics["values_sum"] = jnp.sum(jax.lax.stop_gradient(values_BxT) * mask_BxT)
        metrics["loss"] = jax.lax.stop_gradient(loss)
        return loss, metrics

    return loss_fn


def critic_forward(graphdef: nnx.GraphDef, cfg: TrainerConfig) -> ForwardFn:
    """Forward-only values at loss positions (0 elsewhere), f32[B, T]."""
    del cfg

    def forward(params: nnx.State, batch: TrainBatch) -> jax.Array:
        return jnp.where(batch.loss_mask, critic_values(graphdef, params, batch), 0.0)

    return forward


def make_critic_trainer(
    model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *, model_seed: int = 0
) -> Trainer:
    """The critic's trainer: its own params and optimizer (learning rate etc. from `cfg`).

    `forward(params, batch)` gives values; `accumulate`/`apply` train the value
    loss with the same normaliser contract as the policy.
    """

    def make() -> Critic:
        return Critic(model_cfg, rngs=nnx.Rngs(params=model_seed))

    return build_trainer("critic", make, cfg, mesh, critic_loss_fn, critic_forward)


def with_gae(batch: TrainBatch, values_BxT: jax.Array, cfg: TrainerConfig) -> TrainBatch:
    """Fills advantages, returns and old_values of a scored batch by GAE.

    Token rewards put each sequence's outcome reward on its last response token
    (`algorithms.last_token_rewards`); `algorithms.gae` with (`gae_gamma`,
    `gae_lambda`) gives A_t and R_t = A_t + V_t. With `whiten_advantages`, A
    is whitened over all response tokens of the batch:
    A <- (A - mean) / (std + 1e-8) (masked), so call this on the complete batch.
    Pure; call inside jit (e.g. `jax.jit(with_gae, static_argnames="cfg")`).

    Args:
      batch: TrainBatch with `rewards` and `loss_mask`.
      values_BxT: f32[B, T] critic values (`critic_trainer.forward`).
      cfg: the trainer config (gamma, lambda, whitening).

    Returns:
      The batch with `advantages`, `returns` and `old_values` replaced.
    """
    mask_BxT = batch.loss_mask.astype(_F32)
    values_BxT = values_BxT.astype(_F32) * mask_BxT
    rewards_BxT = algorithms.last_token_rewards(batch.rewards, mask_BxT)
    adv_BxT, ret_BxT = algorithms.gae(
        rewards_BxT, values_BxT, mask_BxT, gamma=cfg.gae_gamma, lam=cfg.gae_lambda
    )
    if cfg.whiten_advantages:
        mean, std = adv_lib.masked_moments(adv_BxT, mask_BxT)
        adv_BxT = (adv_BxT - mean) / (std + 1e-8) * mask_BxT
    return batch.replace(advantages=adv_BxT, returns=ret_BxT, old_values=values_BxT)
