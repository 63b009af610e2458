"""Implicit process rewards (PRIME: Cui et al., "Process Reinforcement through Implicit
Rewards", arXiv 2502.01456), trained online from outcome labels.

A process reward model pi_prm of the policy's architecture starts as the reference
pi_ref (the policy as the run starts), so every process reward starts at 0. Its
sequence-level implicit reward is

    s_u = beta * sum_{t in u} (log pi_prm(y_t) - log pi_ref(y_t)),

trained by cross-entropy against the sample's outcome label y_u = clip(reward_u, 0, 1)
(`implicit_prm_loss`: softplus(s_u) - y_u * s_u). The process reward of response token t
is its term of that sum, r_t = beta * (log pi_prm(y_t) - log pi_ref(y_t))
(`process_rewards`); the policy's advantage at t gains coef * sum_{s >= t, s in u} r_s,
the process rewards still to come in the sample (`returns_to_go`: gamma = 1, as PRIME's
return), the outcome advantage (GRPO's group normalisation) unchanged. With
`algorithm.prm_baseline="leave_one_out"` the process rewards first get PRIME's
leave-one-out baseline over each group (`leave_one_out`, as PRIME's RLOO of its implicit
rewards: with K samples in the group and m_j sample j's mean process reward over its
tokens, r_t <- r_t * K / (K - 1) - sum_j m_j / (K - 1); for a sample of constant r that
is r less the mean of the others' m), so a group whose samples the PRM credits alike adds
nothing.

A "unit" u is one sequence: a row, or a (row, segment) of a packed row (`segment_ids`),
as every loss here counts them (`losses.py`). All functions are pure (call inside jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl_jax.algorithms.advantages import CRITIC_ADVANTAGES
from streamrl_jax.algorithms.losses import Metrics, _sequence_keys, aggregate, sequence_sums

_F32 = jnp.float32


def process_rewards(
    prm_logp_BxT: jax.Array, ref_logp_BxT: jax.Array, mask_BxT: jax.Array, beta: float
) -> jax.Array:
    """f32[B, T] r_t = beta * (log pi_prm - log pi_ref) at loss positions, 0 elsewhere."""
    mask_BxT = mask_BxT.astype(_F32)
    diff_BxT = prm_logp_BxT.astype(_F32) - ref_logp_BxT.astype(_F32)
    return beta * diff_BxT * mask_BxT


def leave_one_out(
    r_BxT: jax.Array, mask_BxT: jax.Array, segment_ids_BxT: jax.Array, group_ids_BxT: jax.Array
) -> jax.Array:
    """f32[B, T]: process rewards with PRIME's leave-one-out baseline (module docstring).

    A group is every sequence (a row, or a (row, segment)) whose columns carry one id of
    `group_ids_BxT`, wherever it sits in the batch; K counts its sequences with a loss
    position. A group of one keeps its rewards. Ids are made dense in-graph (`jnp.unique`
    with a static size, as `trainer.critic.group_whiten`): they need only be unique.
    """
    b, t = r_BxT.shape
    mask_BxT = mask_BxT.astype(_F32)
    r_BxT = r_BxT.astype(_F32) * mask_BxT
    keys_BxT = _sequence_keys(segment_ids_BxT)
    n_BxT = jnp.maximum(sequence_sums(mask_BxT, segment_ids_BxT)[keys_BxT], 1.0)
    # Per column, its share of its sequence's mean reward and of its sequence (1 / n):
    # summed over a group's columns, the sum of its sequences' means, and K.
    _, dense = jnp.unique(group_ids_BxT.reshape(-1), size=b * t, return_inverse=True)
    dense = dense.reshape(-1)

    def over_groups(x_BxT: jax.Array) -> jax.Array:
        sums = jax.ops.segment_sum(x_BxT.reshape(-1), dense, num_segments=b * t)
        return sums[dense].reshape(b, t)

    means_BxT = over_groups(r_BxT / n_BxT)
    k_BxT = jnp.round(over_groups(mask_BxT / n_BxT))
    several = k_BxT > 1.5
    k1_BxT = jnp.where(several, k_BxT - 1.0, 1.0)
    loo_BxT = r_BxT * k_BxT / k1_BxT - means_BxT / k1_BxT
    return jnp.where(several, loo_BxT, r_BxT) * mask_BxT


def returns_to_go(r_BxT: jax.Array, mask_BxT: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
    """f32[B, T]: at each loss position, the sum of r over it and the later positions of
    its sequence (GAE with no values, gamma = lambda = 1), 0 elsewhere."""
    gae = CRITIC_ADVANTAGES["gae"]
    mask_BxT = mask_BxT.astype(_F32)
    zeros_BxT = jnp.zeros_like(mask_BxT)
    rtg_BxT, _ = gae(
        r_BxT.astype(_F32) * mask_BxT,
        zeros_BxT,
        mask_BxT,
        gamma=1.0,
        lam=1.0,
        segment_ids_BxT=segment_ids_BxT,
    )
    return rtg_BxT * mask_BxT


def implicit_prm_loss(
    prm_logp_BxT: jax.Array,
    ref_logp_BxT: jax.Array,
    rewards_BxT: jax.Array,
    mask_BxT: jax.Array,
    segment_ids_BxT: jax.Array,
    *,
    beta: float,
    normalizer: jax.Array | float,
    aggregation: str,
) -> tuple[jax.Array, Metrics]:
    """The PRM's cross-entropy on outcome labels, S_micro / N as every loss here.

    Each sequence u: s_u = beta * sum (log pi_prm - log pi_ref) over its loss positions,
    y_u = clip(its outcome reward, 0, 1) (`rewards_BxT` holds it at its last loss
    position), l_u = softplus(s_u) - y_u * s_u; l_u is every loss position's loss of u,
    aggregated as the policy's loss (`aggregation`, `normalizer`): with
    `seq_mean_token_mean` each sequence weighs 1, with `token_mean` its token count.

    Returns:
      `(loss, metrics)` with `agree_sum`: the loss positions of the sequences whose
      implicit reward has the label's side (s_u > 0 iff y_u > 1/2); the step's row
      divides it by its tokens (`prm_agree`, a token-weighted share).
    """
    mask_BxT = mask_BxT.astype(_F32)
    keys_BxT = _sequence_keys(segment_ids_BxT)
    r_BxT = process_rewards(prm_logp_BxT, jax.lax.stop_gradient(ref_logp_BxT), mask_BxT, beta)
    s_K = sequence_sums(r_BxT, segment_ids_BxT)
    labels_BxT = jax.lax.stop_gradient(rewards_BxT).astype(_F32) * mask_BxT
    y_K = jnp.clip(sequence_sums(labels_BxT, segment_ids_BxT), 0.0, 1.0)
    l_K = jax.nn.softplus(s_K) - y_K * s_K
    loss = aggregate(
        l_K[keys_BxT],
        mask_BxT,
        aggregation=aggregation,
        normalizer=normalizer,
        segment_ids_BxT=segment_ids_BxT,
    )
    agree_K = ((s_K > 0) == (y_K > 0.5)).astype(_F32)
    metrics: Metrics = {"agree_sum": jax.lax.stop_gradient(jnp.sum(agree_K[keys_BxT] * mask_BxT))}
    return loss, metrics
