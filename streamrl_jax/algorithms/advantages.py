"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE.

Pure functions on arrays; call them inside `jax.jit` (Python-float
hyper-parameters are then compile-time constants, not host transfers).

Symbols (shared by every docstring here):

* `B` samples (responses) in the batch, `T` response tokens (right-padded).
* `r_i` scalar outcome reward of sample `i`; `g(i)` its group (the prompt it
  answers); `G_g` the number of valid samples in group `g`.
* `m_it` response mask (1 on a response token, 0 on padding or on tokens that
  are not trained on, e.g. tool output).
* `mean_g`, `std_g` mean and unbiased (Bessel, ddof=1, as torch.std in
  TRL/verl) standard deviation of the rewards of group `g`.

Group layout. Groups are given as `group_ids_B: i32[B]` (any order, members
need not be contiguous, ids in `[0, num_groups)`), reduced with
`jax.ops.segment_sum`. Streamed samples arrive in any order, so a micro-batch
of complete groups is simply concatenated with one id per sample; the host maps
prompt ids to `0..num_groups-1` (`np.unique(..., return_inverse=True)`).
`num_groups` is static; it defaults to `B`, which is always enough. Padding
rows (a fixed shape bucket not full) get `valid_B = 0`: they add nothing to any
group statistic and get advantage 0.

Streaming. GRPO, Dr.GRPO and RLOO need only the samples of one group, so the
trainer can compute them as soon as a group is complete. REINFORCE++ whitens
over the whole global batch, so its advantages exist only once the last sample
of the batch has arrived (or the trainer accumulates `masked_moments` first).

KL in the reward. With `kl_coef = beta > 0` and per-token `kl_BxT` (see
`algorithms.kl`), the outcome estimators use the sequence score
`r_i - beta * sum_t m_it kl_it` (as verl's `use_kl_in_reward` with GRPO sums
the token-level rewards); REINFORCE++ puts `-beta kl_it` on every token.

Registry `ADVANTAGES` maps a config name to an outcome estimator with the
common signature `fn(rewards_B, mask_BxT, group_ids_B, *, valid_B=None,
num_groups=None, kl_BxT=None, kl_coef=0.0, **options) -> f32[B, T]`, where the
estimator-specific `options` (`eps`, `gamma`) are bound from config with
`functools.partial`. GAE needs a critic's values and per-token rewards, so it
has its own registry, `CRITIC_ADVANTAGES`, of functions
`fn(token_rewards_BxT, values_BxT, mask_BxT, *, gamma, lam) -> (advantages,
returns)`; `algorithm.advantage` names an entry of either (the trainer's
`critic.with_gae` applies it per sample).
"""

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

_F32 = jnp.float32


class _Outcomes(NamedTuple):
    """An outcome estimator's inputs, checked, cast and with defaults filled in."""

    rewards_B: jax.Array  # f32[B] r_i
    mask_BxT: jax.Array  # f32[B, T] m_it
    group_ids_B: jax.Array  # i32[B] g(i)
    valid_B: jax.Array  # f32[B] 1 for real samples, 0 for padding rows
    num_groups: int  # static number of groups
    kl_BxT: jax.Array | None  # f32[B, T] kl_it; None when there is no KL in the reward
    kl_coef: float  # beta


def _outcome_estimator(body: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Gives `body(x: _Outcomes, **options) -> f32[B, T]` the `ADVANTAGES` signature.

    The estimator checks the shapes, casts to f32, fills the defaults
    (`valid_B` all ones, `num_groups = B`) and calls `body`; it keeps `body`'s
    name and docstring, and shows the common signature plus `body`'s options.
    """

    @functools.wraps(body, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
    def estimator(
        rewards_B: jax.Array,
        mask_BxT: jax.Array,
        group_ids_B: jax.Array,
        *,
        valid_B: jax.Array | None = None,
        num_groups: int | None = None,
        kl_BxT: jax.Array | None = None,
        kl_coef: float = 0.0,
        **options: float,
    ) -> jax.Array:
        if rewards_B.ndim != 1 or mask_BxT.ndim != 2 or group_ids_B.shape != rewards_B.shape:
            raise ValueError(
                f"expected rewards_B [B], mask_BxT [B, T], group_ids_B [B]; got "
                f"{rewards_B.shape}, {mask_BxT.shape}, {group_ids_B.shape}"
            )
        x = _Outcomes(
            rewards_B=rewards_B.astype(_F32),
            mask_BxT=mask_BxT.astype(_F32),
            group_ids_B=group_ids_B.astype(jnp.int32),
            valid_B=jnp.ones_like(rewards_B, _F32) if valid_B is None else valid_B.astype(_F32),
            num_groups=rewards_B.shape[0] if num_groups is None else num_groups,
            kl_BxT=kl_BxT.astype(_F32) if kl_BxT is not None and kl_coef else None,
            kl_coef=kl_coef,
        )
        return body(x, **options)

    # What help() and inspect show: `**options` replaced by body's keyword options.
    *common, _ = inspect.signature(estimator, follow_wrapped=False).parameters.values()
    options = [p for p in inspect.signature(body).parameters.values() if p.kind is p.KEYWORD_ONLY]
    estimator.__signature__ = inspect.Signature([*common, *options], return_annotation=jax.Array)
    return estimator


def group_moments(
    scores_B: jax.Array, group_ids_B: jax.Array, valid_B: jax.Array, num_groups: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-sample group count, mean and unbiased std.

    Args:
      scores_B: f32[B] scores.
      group_ids_B: i32[B] group of each sample, in `[0, num_groups)`.
      valid_B: f32[B] 1 for real samples, 0 for padding rows.
      num_groups: static number of segments.

    Returns:
      `(count_B, mean_B, std_B)`, each f32[B]: the statistic of sample `i`'s
      group, gathered back to the sample. `std` uses ddof=1 (0 for a group of 1).
    """
    seg = lambda x: jax.ops.segment_sum(x, group_ids_B, num_segments=num_groups)
    count_G = seg(valid_B)  # f32[num_groups]
    mean_G = seg(scores_B * valid_B) / jnp.maximum(count_G, 1.0)
    dev_B = (scores_B - mean_G[group_ids_B]) * valid_B
    var_G = seg(dev_B * dev_B) / jnp.maximum(count_G - 1.0, 1.0)
    return count_G[group_ids_B], mean_G[group_ids_B], jnp.sqrt(var_G)[group_ids_B]


def broadcast_to_tokens(adv_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """A_it = A_i * m_it: a sequence-level advantage on every response token."""
    return adv_B[:, None] * mask_BxT.astype(_F32)


def _per_sequence(formula: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """An outcome estimator from a per-sequence formula, applied per group.

    `formula(s_B, count_B, mean_B, std_B, **options) -> A_B` sees the sequence
    scores `s_i = r_i - beta sum_t m_it kl_it` and the `group_moments` of
    `s` (`G_g(i)`, `mean_g(i)`, `std_g(i)`); the estimator returns
    `A_it = m_it A_i`, 0 on padding rows. The decorated function's docstring
    documents the resulting estimator (`_outcome_estimator`).
    """

    @functools.wraps(formula)
    def body(x: _Outcomes, **options: float) -> jax.Array:
        s_B = x.rewards_B
        if x.kl_BxT is not None:
            s_B = s_B - x.kl_coef * jnp.sum(x.kl_BxT * x.mask_BxT, axis=1)
        count_B, mean_B, std_B = group_moments(s_B, x.group_ids_B, x.valid_B, x.num_groups)
        adv_B = formula(s_B, count_B, mean_B, std_B, **options)
        return broadcast_to_tokens(adv_B * x.valid_B, x.mask_BxT)

    return _outcome_estimator(body)


@_per_sequence
def grpo(
    s_B: jax.Array, count_B: jax.Array, mean_B: jax.Array, std_B: jax.Array, *, eps: float = 1e-6
) -> jax.Array:
    """GRPO (Shao et al. 2024): A_it = m_it (r_i - mean_g(i)) / (std_g(i) + eps).

    Returns:
      f32[B, T] token advantages (0 on padding and on padding rows).
    """
    return (s_B - mean_B) / (std_B + eps)


@_per_sequence
def dr_grpo(s_B: jax.Array, count_B: jax.Array, mean_B: jax.Array, std_B: jax.Array) -> jax.Array:
    """Dr.GRPO (Liu et al. 2025): A_it = m_it (r_i - mean_g(i)), no std scaling.

    Dr.GRPO also drops the per-sequence length normalisation of the loss: use
    aggregation `seq_mean_token_sum` with a constant normaliser (see `losses`).

    Returns:
      f32[B, T] token advantages.
    """
    return s_B - mean_B


@_per_sequence
def rloo(s_B: jax.Array, count_B: jax.Array, mean_B: jax.Array, std_B: jax.Array) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline.

    A_i = r_i - 1/(G-1) sum_{j in g(i), j != i} r_j = G/(G-1) (r_i - mean_g(i)),
    with G = G_g(i); a group of one sample has no baseline and gets A = 0.

    Returns:
      f32[B, T] token advantages.
    """
    scale_B = jnp.where(count_B > 1.0, count_B / jnp.maximum(count_B - 1.0, 1.0), 0.0)
    return scale_B * (s_B - mean_B)


def last_token_rewards(rewards_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Puts each outcome reward on the last response token (m_it = 1 with largest t).

    A sample with no response token contributes nothing.

    Returns:
      f32[B, T] per-token rewards.
    """
    mask_BxT = mask_BxT.astype(_F32)
    t_T = jnp.arange(mask_BxT.shape[1], dtype=jnp.int32)
    last_B = jnp.max(jnp.where(mask_BxT > 0, t_T[None, :], -1), axis=1)  # i32[B]
    is_last_BxT = (t_T[None, :] == last_B[:, None]).astype(_F32)
    return rewards_B.astype(_F32)[:, None] * is_last_BxT


def discounted_returns(
    token_rewards_BxT: jax.Array, mask_BxT: jax.Array, gamma: float
) -> jax.Array:
    """G_it = r_it + gamma G_i,next(t), with next(t) the next unmasked token of i.

    Masked-out positions are skipped (the return carries over them unchanged),
    so right padding and interior masked spans are both handled; after the last
    response token the return is 0.

    Returns:
      f32[B, T] returns (0 where m_it = 0).
    """
    r_TxB = token_rewards_BxT.astype(_F32).T
    m_TxB = mask_BxT.astype(_F32).T

    def step(next_ret_B, xs):
        r_B, m_B = xs
        ret_B = r_B + gamma * next_ret_B
        return m_B * ret_B + (1.0 - m_B) * next_ret_B, ret_B * m_B

    _, ret_TxB = jax.lax.scan(step, jnp.zeros_like(r_TxB[0]), (r_TxB, m_TxB), reverse=True)
    return ret_TxB.T


def masked_moments(x_BxT: jax.Array, mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked mean and (biased) std over every masked element of the batch."""
    mask_BxT = mask_BxT.astype(_F32)
    n = jnp.maximum(jnp.sum(mask_BxT), 1.0)
    mean = jnp.sum(x_BxT * mask_BxT) / n
    var = jnp.sum(jnp.square(x_BxT - mean) * mask_BxT) / n
    return mean, jnp.sqrt(var)


@_outcome_estimator
def reinforce_pp(x: _Outcomes, *, gamma: float = 1.0, eps: float = 1e-6) -> jax.Array:
    """REINFORCE++ (Hu 2025, OpenRLHF): batch-whitened token returns, no critic.

    Token rewards  r_it = -beta kl_it + r_i [t = last response token of i],
    returns        G_it = sum_{k >= t} gamma^(k - t) r_ik   (over response tokens),
    advantages     A_it = m_it (G_it - mu) / (sigma + eps),
    with mu, sigma the mean and (biased) std of G over all response tokens of
    all valid samples in the batch. `group_ids_B` is unused (API symmetry):
    the baseline is the whole batch, which is why this estimator needs the
    whole global batch before any advantage is known.

    Returns:
      f32[B, T] token advantages.
    """
    mask_BxT = x.mask_BxT * x.valid_B[:, None]
    tok_r_BxT = last_token_rewards(x.rewards_B, mask_BxT)
    if x.kl_BxT is not None:
        tok_r_BxT = tok_r_BxT - x.kl_coef * x.kl_BxT * mask_BxT
    ret_BxT = discounted_returns(tok_r_BxT, mask_BxT, gamma)
    mean, std = masked_moments(ret_BxT, mask_BxT)
    return (ret_BxT - mean) / (std + eps) * mask_BxT


def gae(
    token_rewards_BxT: jax.Array,
    values_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) with a critic.

    Reverse scan over response tokens, skipping masked positions:
      delta_t = r_t + gamma V_next - V_t,
      A_t     = delta_t + gamma lam A_next,
      returns_t = A_t + V_t,
    where V_next, A_next are those of the next *unmasked* token (0 after the
    last one: the response ends the episode, also when it was truncated at the
    length limit). With `segment_ids_BxT` a row holds several sequences (packed
    rows, `algorithms.losses`): the next unmasked token counts only if it is in
    the same segment, so each sequence is its own episode. Outputs are 0 where
    m_t = 0. Use `last_token_rewards` (and optionally subtract `beta * kl_BxT`)
    to build `token_rewards_BxT`.

    Args:
      token_rewards_BxT: f32[B, T] per-token rewards.
      values_BxT: f32[B, T] critic values V(s_t) (the old critic's, stop-grad).
      mask_BxT: [B, T] response mask (bool or float).
      gamma: discount.
      lam: GAE lambda.
      segment_ids_BxT: i32[B, T] the sequence of each column within its row;
        None = one sequence per row.

    Returns:
      `(advantages_BxT, returns_BxT)`, both f32[B, T].
    """
    r_TxB = token_rewards_BxT.astype(_F32).T
    v_TxB = jax.lax.stop_gradient(values_BxT).astype(_F32).T
    m_TxB = mask_BxT.astype(_F32).T

    def step(carry, xs):
        next_v_B, next_a_B = carry
        r_B, v_B, m_B = xs
        a_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B
        carry = (m_B * v_B + (1.0 - m_B) * next_v_B, m_B * a_B + (1.0 - m_B) * next_a_B)
        return carry, a_B * m_B

    zeros_B = jnp.zeros_like(r_TxB[0])
    if segment_ids_BxT is None:
        _, adv_TxB = jax.lax.scan(step, (zeros_B, zeros_B), (r_TxB, v_TxB, m_TxB), reverse=True)
    else:

        def segment_step(carry, xs):
            next_v_B, next_a_B, next_seg_B = carry
            r_B, v_B, m_B, seg_B = xs
            # The carried token belongs to another sequence: this one ends here.
            same_B = (seg_B == next_seg_B).astype(_F32)
            (next_v_B, next_a_B), a_B = step((same_B * next_v_B, same_B * next_a_B), xs[:3])
            next_seg_B = jnp.where(m_B > 0, seg_B, next_seg_B)
            return (next_v_B, next_a_B, next_seg_B), a_B

        seg_TxB = segment_ids_BxT.astype(jnp.int32).T
        carry = (zeros_B, zeros_B, jnp.full_like(seg_TxB[0], -1))
        xs = (r_TxB, v_TxB, m_TxB, seg_TxB)
        _, adv_TxB = jax.lax.scan(segment_step, carry, xs, reverse=True)
    adv_BxT = adv_TxB.T
    return adv_BxT, (adv_BxT + v_TxB.T) * m_TxB.T


AdvantageFn = Callable[..., jax.Array]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}

CriticAdvantageFn = Callable[..., tuple[jax.Array, jax.Array]]

CRITIC_ADVANTAGES: dict[str, CriticAdvantageFn] = {"gae": gae}
