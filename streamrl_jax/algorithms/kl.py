"""Per-token KL estimators between the policy pi and a reference policy pi_ref.

Direction and meaning (Schulman, "Approximating KL divergence", 2020). Tokens
`x_t` are sampled from the policy (pi, or the behaviour policy that the PPO
ratio corrects towards pi). With

    log r_t = log pi_ref(x_t | x_<t) - log pi(x_t | x_<t),     r_t = pi_ref / pi,

all three estimate the reverse KL  KL(pi || pi_ref) = E_{x ~ pi}[log pi - log pi_ref]:

* k1 = -log r = log pi - log pi_ref: unbiased, high variance, can be negative.
  (Written "log r" with r = pi/pi_ref in some texts; the sign here is chosen so
  that k1 estimates KL(pi || pi_ref) with r = pi_ref/pi.)
* k2 = 0.5 (log r)^2: biased (exact to second order when pi ~ pi_ref), low
  variance, >= 0. Its gradient under on-policy sampling is the gradient of
  KL(pi || pi_ref), which is why it is the usual choice as a *loss*.
* k3 = r - 1 - log r: unbiased (E_pi[r] = 1), low variance, >= 0; the GRPO
  paper's KL term.

Gradients flow through `logp` only; `ref_logp` is a constant.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _log_ratio(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """log r = log pi_ref - log pi, in f32."""
    ref = jax.lax.stop_gradient(ref_logp_BxT).astype(jnp.float32)
    return ref - logp_BxT.astype(jnp.float32)


def k1(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k1 = -log r = log pi - log pi_ref, f32[B, T]."""
    return -_log_ratio(logp_BxT, ref_logp_BxT)


def k2(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k2 = 0.5 (log r)^2, f32[B, T]."""
    return 0.5 * jnp.square(_log_ratio(logp_BxT, ref_logp_BxT))


def k3(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k3 = r - 1 - log r with r = pi_ref / pi, f32[B, T]."""
    log_r = _log_ratio(logp_BxT, ref_logp_BxT)
    return jnp.expm1(log_r) - log_r  # expm1: no cancellation when pi ~ pi_ref


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
}
