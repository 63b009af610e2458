"""KL estimators against their definitions and the direction KL(pi || pi_ref)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.algorithms import kl


def _run(fn, *arrays, **static):
    fn_jit = jax.jit(functools.partial(fn, **static))
    arrays = jax.device_put(arrays)
    with jax.transfer_guard("disallow"):
        out = fn_jit(*arrays)
    return jax.device_get(out)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_estimators_match_definitions():
    rng = np.random.default_rng(0)
    logp, ref = rng.normal(-2.0, 1.0, size=(2, 3, 5)).astype(np.float32)
    log_r = ref.astype(np.float64) - logp  # r = pi_ref / pi
    want = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}
    for name, fn in kl.KL_ESTIMATORS.items():
        np.testing.assert_allclose(_run(fn, logp, ref), want[name], rtol=1e-5, err_msg=name)
    assert np.all(_run(kl.k3, logp, ref) >= 0)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_for_reverse_kl(name):
    """E_{x ~ pi}[k(x)] is exactly KL(pi || pi_ref), and not KL(pi_ref || pi)."""
    rng = np.random.default_rng(1)
    logp, ref = _log_softmax(rng.normal(size=(2, 6)).astype(np.float64)).astype(np.float32)
    p, q = np.exp(logp), np.exp(ref)
    reverse, forward = (p * (logp - ref)).sum(), (q * (ref - logp)).sum()
    expectation = (p * _run(kl.KL_ESTIMATORS[name], logp, ref)).sum()
    np.testing.assert_allclose(expectation, reverse, rtol=1e-4)
    assert abs(reverse - forward) > 1e-2  # the two directions are distinguishable here


def test_k2_gradient_is_reverse_kl_gradient():
    """grad_theta E_{x ~ sg(pi)}[k2] = grad_theta KL(pi_theta || pi_ref) (on-policy)."""
    rng = np.random.default_rng(2)
    logits, ref_logits = rng.normal(size=(2, 7)).astype(np.float32)

    def grads(z, z_ref):
        ref = jax.nn.log_softmax(z_ref)

        def surrogate(z):
            logp = jax.nn.log_softmax(z)
            return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * kl.k2(logp, ref))

        def exact(z):
            logp = jax.nn.log_softmax(z)
            return jnp.sum(jnp.exp(logp) * (logp - ref))

        return jax.grad(surrogate)(z), jax.grad(exact)(z)

    g_k2, g_exact = _run(grads, logits, ref_logits)
    np.testing.assert_allclose(g_k2, g_exact, rtol=1e-4, atol=1e-6)
    assert np.abs(g_exact).max() > 1e-3
