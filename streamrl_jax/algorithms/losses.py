"""Policy, KL, entropy and value losses, decomposable over streamed micro-batches.

Call these inside `jax.jit`. Symbols: `B` samples, `T` response tokens,
`m_it` response mask, `A_it` advantage, `rho_it = exp(log pi_theta - log pi_old)`
the PPO ratio, `l_it` a per-token loss.

## The normaliser contract (exactness of stream-sync)

A global batch is split into micro-batches that arrive in any order and any
sizes. Every loss here is

    L_micro = S_micro / normalizer,      S_micro = sum over the micro-batch of
                                          its per-element contributions,

so that sum_micro L_micro equals the loss of one step on the whole batch
whenever every micro-batch gets the same `normalizer` N, the global value:

| `aggregation`         | per-element contribution              | N (global)                    |
| --------------------- | ------------------------------------- | ----------------------------- |
| `token_mean`          | sum_t m_it l_it                       | sum_i sum_t m_it (tokens)     |
| `seq_mean_token_sum`  | sum_t m_it l_it                       | number of sequences           |
| `seq_mean_token_mean` | sum_t m_it l_it / sum_t m_it          | number of sequences           |

"Number of sequences" counts sequences with at least one response token
(`normalizer_part`). `normalizer_part(mask_BxT, aggregation)` is a micro-batch's
share of N; summed over the micro-batches of a batch it is N. Dr.GRPO's
constant normaliser is `seq_mean_token_sum` with N = num_sequences * T_max.

When N is not known until the last sample arrives (token counts in
`token_mean`), pass `normalizer=1.0` while accumulating: the gradient is linear
in 1/N, so dividing the *summed* gradients (and the summed loss/metrics) by the
summed `normalizer_part`s at apply time gives the same step up to float
rounding. For the sequence modes N is the number of non-empty responses:
the global batch size, known ahead, when no response is empty.
Nothing else in these losses couples samples, so any split is exact; the
advantages (GRPO groups, REINFORCE++ batch whitening) must be computed on
complete groups / the complete batch before the micro-batch loss.

Metrics are also additive: loss components are already divided by N; token
statistics are returned as `*_sum` over the micro-batch plus `num_tokens`.
Sum the dicts over micro-batches, then call `finalize_metrics` (on the host,
or on device inside the trainer's `apply`: one implementation for both).

## Sequences in packed rows

By default row i is one sequence. A packed row (several sequences, or a
prompt shared by several responses: `trainer/batch.py`) names its sequences by
`segment_ids_BxT` (i32, k >= 1 on the columns of sequence k of its row, ids
unique within a row); every function here takes it as an optional keyword.
Only the `seq_mean_*` aggregations read it (the per-sequence token count of
`seq_mean_token_mean` and the sequence count of `normalizer_part`); token sums
do not depend on how tokens are grouped into rows, so a packed batch gives the
same loss as its one-sequence-per-row layout up to float summation order.

## Old log-probs and truncated importance sampling

The generator records behaviour log-probs `log mu` when it samples. Two modes:

* behaviour-as-old (cheap): pass `old_logp_BxT = behaviour_logp` and no
  `behaviour_logp_BxT`. The ratio is taken directly against the sampler; any
  engine/trainer numerical mismatch and staleness is absorbed by the clip.
* recomputed old: the trainer recomputes `log pi_old` with the weights that
  generated the sample, W_{g(b)}, in its own forward, and passes the recorded
  `behaviour_logp_BxT` and `tis_cap`. The per-token loss is multiplied by the
  truncated importance weight (stop-gradient)
      w_it = min(exp(log pi_old - log mu), tis_cap),
  which corrects for the sampler's numerics differing from the trainer's
  (truncated IS, as in Yao et al. 2025); the PPO ratio stays
  pi_theta / pi_old with both sides from the trainer.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from streamrl_jax.algorithms import kl as kl_lib

_F32 = jnp.float32
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
Metrics = dict[str, jax.Array]


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")


def _sequence_keys(segment_ids_BxT: jax.Array) -> jax.Array:
    """i32[B, T]: b * (T + 1) + segment, one key per sequence (row b, segment k)."""
    b, t = segment_ids_BxT.shape
    return jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids_BxT


def sequence_sums(x_BxT: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
    """f32[B * (T + 1)]: the sum of x over each sequence, at its `_sequence_keys` key."""
    b, t = x_BxT.shape
    keys = _sequence_keys(segment_ids_BxT).reshape(-1)
    return jax.ops.segment_sum(x_BxT.astype(_F32).reshape(-1), keys, num_segments=b * (t + 1))


def _sequence_token_counts(mask_BxT: jax.Array, segment_ids_BxT: jax.Array) -> jax.Array:
    """f32[B, T]: at each column, the masked tokens of its sequence."""
    return sequence_sums(mask_BxT, segment_ids_BxT)[_sequence_keys(segment_ids_BxT)]


def normalizer_part(
    mask_BxT: jax.Array, aggregation: str, segment_ids_BxT: jax.Array | None = None
) -> jax.Array:
    """This micro-batch's share of the global normaliser N (f32 scalar).

    Tokens for `token_mean`; sequences (rows, or (row, segment) with
    `segment_ids_BxT`) with at least one response token for the `seq_mean_*`
    modes. Summed over all micro-batches of a batch, it is N.
    """
    _check_aggregation(aggregation)
    mask_BxT = mask_BxT.astype(_F32)
    if aggregation == "token_mean":
        return jnp.sum(mask_BxT)
    if segment_ids_BxT is not None:
        return jnp.sum((sequence_sums(mask_BxT, segment_ids_BxT) > 0).astype(_F32))
    return jnp.sum((jnp.sum(mask_BxT, axis=1) > 0).astype(_F32))


def aggregate(
    loss_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    aggregation: str,
    normalizer: jax.Array | float,
    segment_ids_BxT: jax.Array | None = None,
) -> jax.Array:
    """S_micro / N for per-token losses l_it (see the module table).

    Args:
      loss_BxT: f32[B, T] per-token loss.
      mask_BxT: [B, T] response mask (bool or float).
      aggregation: one of `AGGREGATIONS`.
      normalizer: the global N (or 1.0 to normalise after accumulation).
      segment_ids_BxT: the sequences of packed rows (module docstring); None =
        one sequence per row.

    Returns:
      f32 scalar.
    """
    _check_aggregation(aggregation)
    mask_BxT = mask_BxT.astype(_F32)
    if aggregation == "seq_mean_token_mean" and segment_ids_BxT is not None:
        count_BxT = jnp.maximum(_sequence_token_counts(mask_BxT, segment_ids_BxT), 1.0)
        return jnp.sum(loss_BxT.astype(_F32) * mask_BxT / count_BxT) / normalizer
    per_seq_B = jnp.sum(loss_BxT.astype(_F32) * mask_BxT, axis=1)
    if aggregation == "seq_mean_token_mean":
        per_seq_B = per_seq_B / jnp.maximum(jnp.sum(mask_BxT, axis=1), 1.0)
    return jnp.sum(per_seq_B) / normalizer


def _token_sum(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    return jnp.sum(x_BxT.astype(_F32) * mask_BxT.astype(_F32))


def ppo_clip(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    normalizer: jax.Array | float,
    aggregation: str = "token_mean",
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    behaviour_logp_BxT: jax.Array | None = None,
    tis_cap: float | None = None,
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped surrogate with optional dual clip and truncated IS.

    l_it = w_it * max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)), and with
    dual clip (Ye et al. 2020, c > 1) for A < 0: l_it = min(that, -c A), i.e.
    the objective for negative advantages is bounded by c A however large rho
    grows. w_it is the truncated IS weight (module docstring), 1 without
    `behaviour_logp_BxT`. Gradients flow through `logp_BxT` only.

    Args:
      logp_BxT: f32[B, T] log pi_theta of the sampled tokens.
      old_logp_BxT: f32[B, T] log pi_old (recomputed, or the behaviour log-probs).
      advantages_BxT: f32[B, T] advantages.
      mask_BxT: [B, T] response mask.
      normalizer: global N for `aggregation` (see the module docstring).
      aggregation: one of `AGGREGATIONS`.
      clip_eps_low: eps_low, lower clip 1 - eps_low.
      clip_eps_high: eps_high, upper clip 1 + eps_high.
      dual_clip_c: c of the dual clip (e.g. 3.0), None to disable.
      behaviour_logp_BxT: f32[B, T] recorded sampler log-probs log mu, for TIS.
      tis_cap: the cap of w; required with `behaviour_logp_BxT`.
      segment_ids_BxT: the sequences of packed rows (module docstring).

    Returns:
      `(loss, metrics)`: f32 scalar S_micro / N and additive metrics.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1")
    if (behaviour_logp_BxT is None) != (tis_cap is None):
        raise ValueError("behaviour_logp_BxT and tis_cap go together (both or neither)")
    mask_BxT = mask_BxT.astype(_F32)
    adv_BxT = jax.lax.stop_gradient(advantages_BxT).astype(_F32)
    old_BxT = jax.lax.stop_gradient(old_logp_BxT).astype(_F32)
    log_ratio_BxT = logp_BxT.astype(_F32) - old_BxT
    ratio_BxT = jnp.exp(log_ratio_BxT)
    clipped_BxT = jnp.clip(ratio_BxT, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    unclipped_loss_BxT = -adv_BxT * ratio_BxT
    loss_BxT = jnp.maximum(unclipped_loss_BxT, -adv_BxT * clipped_BxT)
    metrics: Metrics = {}
    clip_BxT = (loss_BxT > unclipped_loss_BxT).astype(_F32)
    if dual_clip_c is not None:
        dual_BxT = (adv_BxT < 0) & (loss_BxT > -dual_clip_c * adv_BxT)
        loss_BxT = jnp.where(dual_BxT, -dual_clip_c * adv_BxT, loss_BxT)
        metrics["dual_clip_frac_sum"] = _token_sum(dual_BxT, mask_BxT)
    if behaviour_logp_BxT is not None:
        log_w_BxT = old_BxT - jax.lax.stop_gradient(behaviour_logp_BxT).astype(_F32)
        w_BxT = jnp.minimum(jnp.exp(log_w_BxT), tis_cap)
        loss_BxT = loss_BxT * w_BxT
        metrics["tis_weight_sum"] = _token_sum(w_BxT, mask_BxT)
        metrics["tis_capped_frac_sum"] = _token_sum(jnp.exp(log_w_BxT) > tis_cap, mask_BxT)
    loss = aggregate(
        loss_BxT,
        mask_BxT,
        aggregation=aggregation,
        normalizer=normalizer,
        segment_ids_BxT=segment_ids_BxT,
    )
    metrics |= {
        "pg_loss": jax.lax.stop_gradient(loss),
        "num_tokens": jnp.sum(mask_BxT),
        "clip_frac_sum": _token_sum(clip_BxT, mask_BxT),
        "ratio_sum": _token_sum(jax.lax.stop_gradient(ratio_BxT), mask_BxT),
        # k3 estimate of KL(pi_old || pi_theta) on tokens sampled from pi_old.
        "approx_kl_sum": _token_sum(kl_lib.k3(old_BxT, jax.lax.stop_gradient(logp_BxT)), mask_BxT),
    }
    return loss, metrics


def dapo(*args: jax.Array, clip_eps_high: float = 0.28, **kwargs: Any) -> tuple[jax.Array, Metrics]:
    """DAPO clip-higher (Yu et al. 2025): `ppo_clip` with eps_high > eps_low.

    Same formula and arguments as `ppo_clip`; the defaults are DAPO's
    (eps_low = 0.2, eps_high = 0.28, token-level `token_mean` aggregation).
    """
    return ppo_clip(*args, clip_eps_high=clip_eps_high, **kwargs)


# What help() and inspect show: `ppo_clip`'s arguments with DAPO's default eps_high.
_PPO_CLIP = inspect.signature(ppo_clip)
dapo.__signature__ = _PPO_CLIP.replace(
    parameters=[
        p.replace(default=0.28) if p.name == "clip_eps_high" else p
        for p in _PPO_CLIP.parameters.values()
    ]
)


PolicyLossFn = Callable[..., tuple[jax.Array, Metrics]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip, "dapo": dapo}


def kl_loss(
    logp_BxT: jax.Array,
    ref_logp_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    normalizer: jax.Array | float,
    aggregation: str = "token_mean",
    estimator: str = "k3",
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """KL(pi_theta || pi_ref) penalty: aggregate of k_est(log pi_theta, log pi_ref).

    See `algorithms.kl` for the estimators (`k1`, `k2`, `k3`).
    """
    kl_BxT = kl_lib.KL_ESTIMATORS[estimator](logp_BxT, ref_logp_BxT)
    loss = aggregate(
        kl_BxT,
        mask_BxT,
        aggregation=aggregation,
        normalizer=normalizer,
        segment_ids_BxT=segment_ids_BxT,
    )
    return loss, {"kl_loss": jax.lax.stop_gradient(loss)}


def entropy_bonus(
    entropy_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    normalizer: jax.Array | float,
    aggregation: str = "token_mean",
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Aggregated entropy H (to be *subtracted*: loss -= entropy_coef * H)."""
    ent = aggregate(
        entropy_BxT,
        mask_BxT,
        aggregation=aggregation,
        normalizer=normalizer,
        segment_ids_BxT=segment_ids_BxT,
    )
    return ent, {"entropy": jax.lax.stop_gradient(ent)}


def value_loss(
    values_BxT: jax.Array,
    old_values_BxT: jax.Array,
    returns_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    normalizer: jax.Array | float,
    aggregation: str = "token_mean",
    clip_eps: float | None = 0.2,
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO clipped value loss.

    l_t = 0.5 max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -eps, eps) - R_t)^2),
    or 0.5 (V_t - R_t)^2 with `clip_eps=None`. R_t are the GAE returns.

    Returns:
      `(loss, metrics)` with `vf_loss` (already / N) and `vf_clip_frac_sum`.
    """
    values_BxT = values_BxT.astype(_F32)
    ret_BxT = jax.lax.stop_gradient(returns_BxT).astype(_F32)
    loss_BxT = jnp.square(values_BxT - ret_BxT)
    metrics: Metrics = {}
    if clip_eps is not None:
        old_BxT = jax.lax.stop_gradient(old_values_BxT).astype(_F32)
        v_clip_BxT = old_BxT + jnp.clip(values_BxT - old_BxT, -clip_eps, clip_eps)
        clipped_BxT = jnp.square(v_clip_BxT - ret_BxT)
        metrics["vf_clip_frac_sum"] = _token_sum(clipped_BxT > loss_BxT, mask_BxT)
        loss_BxT = jnp.maximum(loss_BxT, clipped_BxT)
    loss = aggregate(
        0.5 * loss_BxT,
        mask_BxT,
        aggregation=aggregation,
        normalizer=normalizer,
        segment_ids_BxT=segment_ids_BxT,
    )
    metrics["vf_loss"] = jax.lax.stop_gradient(loss)
    return loss, metrics


def actor_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    normalizer: jax.Array | float,
    policy_loss: str = "ppo_clip",
    aggregation: str = "token_mean",
    policy_options: Mapping[str, Any] | None = None,
    behaviour_logp_BxT: jax.Array | None = None,
    tis_cap: float | None = None,
    ref_logp_BxT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_BxT: jax.Array | None = None,
    entropy_coef: float = 0.0,
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Policy loss + kl_coef * KL(pi || pi_ref) - entropy_coef * H, all with one N.

    `policy_loss` names an entry of `POLICY_LOSSES`; `policy_options` are its
    keyword hyper-parameters (`clip_eps_low`, `clip_eps_high`, `dual_clip_c`).
    The KL term is the in-loss penalty (GRPO style); KL in the reward goes to
    the advantage functions instead. `segment_ids_BxT` names the sequences of
    packed rows (module docstring) for every term.

    Returns:
      `(loss, metrics)`: scalar S_micro / N and the merged additive metrics.
    """
    seq = {"segment_ids_BxT": segment_ids_BxT}
    loss, metrics = POLICY_LOSSES[policy_loss](
        logp_BxT,
        old_logp_BxT,
        advantages_BxT,
        mask_BxT,
        normalizer=normalizer,
        aggregation=aggregation,
        behaviour_logp_BxT=behaviour_logp_BxT,
        tis_cap=tis_cap,
        **seq,
        **(policy_options or {}),
    )
    if kl_coef:
        if ref_logp_BxT is None:
            raise ValueError("kl_coef > 0 needs ref_logp_BxT")
        kl, kl_metrics = kl_loss(
            logp_BxT,
            ref_logp_BxT,
            mask_BxT,
            normalizer=normalizer,
            aggregation=aggregation,
            estimator=kl_estimator,
            **seq,
        )
        loss, metrics = loss + kl_coef * kl, metrics | kl_metrics
    if entropy_coef:
        if entropy_BxT is None:
            raise ValueError("entropy_coef > 0 needs entropy_BxT")
        ent, ent_metrics = entropy_bonus(
            entropy_BxT, mask_BxT, normalizer=normalizer, aggregation=aggregation, **seq
        )
        loss, metrics = loss - entropy_coef * ent, metrics | ent_metrics
    metrics["loss"] = jax.lax.stop_gradient(loss)
    return loss, metrics


def finalize_metrics(
    summed: Mapping[str, Any], normalizer_total: jax.Array | float = 1.0
) -> dict[str, Any]:
    """Micro-batch-summed metrics -> batch means; one implementation for host and device.

    `x_sum` becomes `x = x_sum / max(num_tokens, 1)`; `num_tokens` is kept;
    every other key (loss terms, each already divided by the normaliser given
    to its micro-batch) is divided by `normalizer_total`: 1 when the
    micro-batches were given the global N, the summed `normalizer_part`s when
    they were given 1 (the trainer's `apply`).

    The array namespace follows the inputs: inside `jax.jit` (or on device
    arrays) it computes with `jax.numpy` and returns arrays; on host values
    (numpy, Python floats) with numpy, returning Python floats.

    Args:
      summed: metrics summed over the micro-batches of one step.
      normalizer_total: the divisor of the non-token metrics.

    Returns:
      A flat dict of the finalized metrics.
    """
    on_device = any(isinstance(v, jax.Array) for v in (*summed.values(), normalizer_total))
    xp = jnp if on_device else np
    num_tokens = xp.maximum(xp.asarray(summed.get("num_tokens", 0.0), xp.float32), 1.0)
    out: dict[str, Any] = {}
    for key, value in summed.items():
        if key.endswith("_sum"):
            out[key[: -len("_sum")]] = value / num_tokens
        elif key == "num_tokens":
            out[key] = value
        else:
            out[key] = value / normalizer_total
    return out if on_device else {k: float(np.asarray(v)) for k, v in out.items()}
