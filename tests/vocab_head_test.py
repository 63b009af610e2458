"""The blocked vocabulary head (model/vocab_head.py) against a plain log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.model.vocab_head import token_logprobs_entropy


def _plain(h, w, targets):
    logits = jnp.einsum("ne,ve->nv", h, w).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


# (positions, width, vocab, chunk, block): exact tiles; positions and vocabulary both
# ragged (the last chunk and the last tile padded); one tile and one chunk (block and
# chunk larger than the arrays).
SHAPES = [(24, 16, 96, 8, 32), (19, 8, 101, 4, 16), (5, 8, 40, 128, 2048)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_equal_the_plain_log_softmax(shape, dtype):
    n, e, v, chunk, block = shape
    rng = np.random.default_rng(n + v)
    h = jnp.asarray(rng.normal(size=(n, e)), dtype)
    w = jnp.asarray(rng.normal(size=(v, e)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    targets = targets.at[0].set(v - 1)  # the padded tile's last real entry

    def blocked(h, w):
        return token_logprobs_entropy(h, w, targets, chunk=chunk, block=block)

    def plain(h, w):
        return _plain(h, w, targets)

    g = jnp.asarray(rng.normal(size=n), jnp.float32)
    k = jnp.asarray(rng.normal(size=n), jnp.float32)

    @jax.jit
    def both(h, w, g, k):  # one program, not an eager op at a time
        out, vjp = jax.vjp(blocked, h, w)
        out_ref, vjp_ref = jax.vjp(plain, h, w)
        return out, out_ref, vjp((g, k)), vjp_ref((g, k))

    (lp, ent), (lp_ref, ent_ref), grads, grads_ref = both(h, w, g, k)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    grad_tol = 1e-5 if dtype == jnp.float32 else 5e-2
    assert lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, lp_ref, rtol=tol, atol=tol * float(jnp.abs(lp_ref).max()))
    np.testing.assert_allclose(ent, ent_ref, rtol=tol, atol=tol * float(jnp.abs(ent_ref).max()))
    # Both cotangents nonzero: the entropy's gradient is checked, not only the log-prob's.
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.dtype == want.dtype
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        assert scale > 0
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=0, atol=grad_tol * scale)


def test_jit_and_grad_of_a_loss():
    """Under jit and grad (how the trainer calls it) the gradient equals the plain one."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(33, 12)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(70, 12)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 70, 33), jnp.int32)

    def loss(fn, h, w):
        lp, ent = fn(h, w, targets)
        return jnp.sum(lp) - 0.1 * jnp.sum(ent)

    def blocked(h, w, t):
        return token_logprobs_entropy(h, w, t, chunk=8, block=16)

    got = jax.jit(jax.grad(lambda h, w: loss(blocked, h, w), argnums=(0, 1)))(h, w)
    want = jax.jit(jax.grad(lambda h, w: loss(_plain, h, w), argnums=(0, 1)))(h, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))
