"""PPO critic: a value head on the policy's architecture, its loss, and GAE targets.

Selected by `algorithm.advantage="gae"`; configured by the `critic` section
(`CriticSection`: learning rate, value clip, gamma, lambda, whitening) and built with
`make_critic_trainer(model_cfg, trainer_config.critic_trainer_config(cfg,
fsdp=...), mesh)`.

The critic is its own model (own params, own optimizer, own `Trainer`): the
Llama decoder's last hidden state, final RMSNorm, then a value head W_v
[E, 1] (logical axes ("embed", "value_head"): FSDP-sharded like every other
`embed` dimension). Values are aligned with the trainer's prediction
positions: V[b, t] = V(s_t), the state after tokens[b, :t + 1], from which
the response token tokens[b, t + 1] is sampled.

PPO flow, per streamed micro-batch (after its samples are scored):

1. `batch = critic_trainer.fill_gae(critic_state.params, batch)`: one jitted
   call, the critic's values (its weights from before its update on this
   batch) then `with_gae`: advantages, returns and old values of every sample
   from its own group alone (per-sample GAE, whitened over the group's tokens
   with `critic.whiten="group"`), so it streams like GRPO's complete groups do;
2. policy and critic both `accumulate` the micro-batch; at the end of the
   global batch both `apply`. The critic's loss is `algorithms.value_loss`
   (clipped around `old_values` by `critic.value_clip`, 0 = unclipped).

`whiten_advantages` (A <- (A - mean) / std over every response token) is an
explicit option outside that flow: it couples the whole global batch, so it
can only run once the last sample has arrived, which defeats streaming.
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
from streamrl_jax.model.segments import Segments
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig
from streamrl_jax.trainer.state import LossOutput
from streamrl_jax.trainer.step import Trainer, build_trainer

_F32 = jnp.float32


class Critic(nnx.Module):
    """Llama backbone + RMSNorm + linear value head; V(s_t) per position."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.backbone = llama.Llama(cfg, rngs=rngs)
        # Zero init: every value starts at 0 (no baseline) instead of at noise.
        head = jnp.zeros((cfg.hidden_size, 1), cfg.jnp_param_dtype)
        self.value_head = nnx.Param(head, axes=("embed", "value_head"))

    def values(
        self, tokens_BxT: jax.Array, mask_BxT: jax.Array, *, segments: Segments | None = None
    ) -> jax.Array:
        """f32[B, T] values V(s_t) of a padded batch (meaningless on padding); `segments`
        as in `Llama.hidden_states` (packed rows)."""
        cfg = self.backbone.cfg
        h_BxTxE = self.backbone.hidden_states(tokens_BxT, mask_BxT, segments=segments)
        h_BxTxE = layers.rms_norm(h_BxTxE, self.backbone.final_norm[...], cfg.rms_norm_eps)
        w_Ex1 = self.value_head[...].astype(h_BxTxE.dtype)
        return jnp.einsum("bte,eo->bto", h_BxTxE, w_Ex1)[..., 0].astype(_F32)


def create(cfg: ModelConfig, seed: int = 0) -> Critic:
    """A critic with a random backbone (from `seed`) and a zero value head."""
    return Critic(cfg, rngs=nnx.Rngs(params=seed))


def critic_loss(
    model: Critic, cfg: TrainerConfig, batch: TrainBatch, normalizer: jax.Array
) -> LossOutput:
    """PPO value loss against `batch.returns`, clipped around `batch.old_values`.

    Returns:
      `(loss, metrics, per_token)`; `values` is reported as `values_sum`.
    """
    values_BxT = model.values(batch.tokens, batch.attention_mask, segments=batch.segments())
    loss, metrics = algorithms.value_loss(
        values_BxT,
        batch.old_values,
        batch.returns,
        batch.loss_mask,
        normalizer=normalizer,
        aggregation=cfg.algorithm.aggregation,
        clip_eps=cfg.value_clip,
        segment_ids_BxT=batch.segment_ids,
    )
    return loss, metrics, {"values": values_BxT}


def critic_forward(model: Critic, cfg: TrainerConfig, batch: TrainBatch) -> jax.Array:
    """Forward-only values at loss positions (0 elsewhere), f32[B, T]."""
    del cfg
    values_BxT = model.values(batch.tokens, batch.attention_mask, segments=batch.segments())
    return jnp.where(batch.loss_mask, values_BxT, 0.0)


def with_gae(batch: TrainBatch, values_BxT: jax.Array, cfg: TrainerConfig) -> TrainBatch:
    """Fills advantages, returns and old_values of a scored micro-batch by GAE, per group.

    Each sequence's outcome reward sits on its last response token
    (`batch.rewards`, placed by `make_batch`); `algorithms.gae` with the user's
    `critic.gamma` and `critic.lam` gives A_t and R_t = A_t + V_t, each
    sequence (row, segment) its own episode, so packed and shared-prompt rows
    get the targets of one sequence per row. With
    `critic.whiten="group"` the advantages are then whitened over each GRPO
    group's response tokens (`group_whiten`): raw GAE advantages of a [0, 1]
    reward are small, and PPO's usual whole-batch whitening would couple the
    global batch and defeat streaming, while a group never splits across
    micro-batches. So any split of a batch into micro-batches gives the same
    targets. Pure; call inside jit (`Trainer.fill_gae` does, with the critic's
    values; or `jax.jit(with_gae, static_argnames="cfg")`).

    Args:
      batch: TrainBatch with `rewards`, `loss_mask`, `segment_ids` and `group_ids`.
      values_BxT: f32[B, T] critic values (`critic_trainer.forward`).
      cfg: the trainer config; reads its `critic` section (gamma, lam).

    Returns:
      The batch with `advantages`, `returns` and `old_values` replaced.
    """
    mask_BxT = batch.loss_mask.astype(_F32)
    values_BxT = values_BxT.astype(_F32) * mask_BxT
    rewards_BxT = batch.rewards.astype(_F32) * mask_BxT
    gae = algorithms.CRITIC_ADVANTAGES["gae"]
    c = cfg.critic
    adv_BxT, ret_BxT = gae(
        rewards_BxT,
        values_BxT,
        mask_BxT,
        gamma=c.gamma,
        lam=c.lam,
        segment_ids_BxT=batch.segment_ids,
    )
    if c.whiten == "group":
        adv_BxT = group_whiten(adv_BxT, mask_BxT, batch.group_ids)
    return batch.replace(advantages=adv_BxT, returns=ret_BxT, old_values=values_BxT)


def group_whiten(
    adv_BxT: jax.Array, mask_BxT: jax.Array, group_ids_BxT: jax.Array, eps: float = 1e-8
) -> jax.Array:
    """A <- (A - mean_g) / (std_g + eps) over the response tokens of each token's group g.

    mean_g and std_g (population, two-pass) are over every masked token whose
    `group_ids` equal g, wherever it sits in the batch (a group may fill several
    rows, and a packed row may hold several groups). Ids are mapped to dense
    indices in-graph (`jnp.unique` with a static size), so they need only be
    unique, not dense; unmasked tokens contribute nothing and come back 0.
    """
    b, t = group_ids_BxT.shape
    _, dense = jnp.unique(group_ids_BxT.reshape(-1), size=b * t, return_inverse=True)
    dense = dense.reshape(-1)
    seg = lambda x_BxT: jax.ops.segment_sum(x_BxT.reshape(-1), dense, num_segments=b * t)
    mask_BxT = mask_BxT.astype(_F32)
    count_G = jnp.maximum(seg(mask_BxT), 1.0)
    mean_BxT = (seg(adv_BxT * mask_BxT) / count_G)[dense].reshape(b, t)
    centred_BxT = (adv_BxT - mean_BxT) * mask_BxT
    std_BxT = jnp.sqrt(seg(jnp.square(centred_BxT)) / count_G)[dense].reshape(b, t)
    return centred_BxT / (std_BxT + eps)


def whiten_advantages(batch: TrainBatch, eps: float = 1e-8) -> TrainBatch:
    """A <- (A - mean) / (std + eps) over every response token of `batch` (masked).

    Couples all samples: call it on a complete global batch only (not used by
    the streamed pipeline; module docstring). Pure; call inside jit.
    """
    mask_BxT = batch.loss_mask.astype(_F32)
    mean, std = adv_lib.masked_moments(batch.advantages, mask_BxT)
    return batch.replace(advantages=(batch.advantages - mean) / (std + eps) * mask_BxT)


def make_critic_trainer(
    model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *, model_seed: int = 0
) -> Trainer:
    """The critic's trainer: its own params and optimizer (`critic_trainer_config`).

    `forward(params, batch)` gives values, `fill_gae(params, batch)` the GAE
    targets; `accumulate`/`apply` train the value loss with the same
    normaliser contract as the policy. The critic trains every parameter: a policy's
    LoRA setting (`ModelConfig.lora_rank`) does not carry over to it.
    """
    return build_trainer(
        "critic",
        create,
        model_cfg.replace(lora_rank=0),
        cfg,
        mesh,
        model_seed=model_seed,
        loss=critic_loss,
        forward=critic_forward,
        targets=with_gae,
    )
