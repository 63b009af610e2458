"""Tests of per-slot sampling: filters, distributions, log-probs, key folding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.generation import sampling
from streamrl_jax.generation.types import SamplingParams

V = 6
LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)  # sorted, distinct


@jax.jit
def _draw_many(logits_V, seed, temperature, top_k, top_p, n):
    """n draws of one request (token indices 0..n-1) under the given parameters."""
    b = n.shape[0]
    return sampling.sample_tokens(
        jnp.broadcast_to(logits_V, (b, logits_V.shape[0])),
        jnp.broadcast_to(seed, (b, 2)),
        n,
        jnp.full((b,), temperature),
        jnp.full((b,), top_k, jnp.int32),
        jnp.full((b,), top_p),
    )


def draw(temperature=1.0, top_k=0, top_p=1.0, n=4000, logits=LOGITS, seed=3):
    out = _draw_many(
        jnp.asarray(logits),
        jnp.asarray(sampling.request_key_data(seed)),
        jnp.float32(temperature),
        jnp.int32(top_k),
        jnp.float32(top_p),
        jnp.arange(4000, dtype=jnp.int32),  # one shape: one compilation
    )
    return tuple(x[:n] for x in jax.device_get(out))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_request_key_matches_prng_key():
    for seed in (0, 7, 2**31 - 1):
        want = jax.device_get(jax.random.key_data(jax.random.PRNGKey(seed)))
        np.testing.assert_array_equal(sampling.request_key_data(seed), want)


def test_greedy_is_argmax_with_model_logprob():
    tokens, logp, slogp = draw(temperature=0.0, n=8)
    np.testing.assert_array_equal(tokens, 0)
    np.testing.assert_allclose(logp, np.log(softmax(LOGITS))[0], rtol=1e-6)
    np.testing.assert_array_equal(slogp, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_its_distribution(temperature):
    tokens, logp, slogp = draw(temperature=temperature)
    want = softmax(LOGITS / temperature)
    freq = np.bincount(tokens, minlength=V) / len(tokens)
    np.testing.assert_allclose(freq, want, atol=0.03)
    # Behaviour log-prob: unmodified model distribution; sampling log-prob: tempered.
    np.testing.assert_allclose(logp, np.log(softmax(LOGITS))[tokens], rtol=1e-5)
    np.testing.assert_allclose(slogp, np.log(want)[tokens], rtol=1e-5, atol=1e-6)


def test_top_k_keeps_the_k_largest_renormalised():
    tokens, logp, slogp = draw(top_k=2)
    assert set(np.unique(tokens)) == {0, 1}
    want = softmax(LOGITS[:2])
    freq = np.bincount(tokens, minlength=2)[:2] / len(tokens)
    np.testing.assert_allclose(freq, want, atol=0.03)
    np.testing.assert_allclose(slogp, np.log(want)[tokens], rtol=1e-5)
    np.testing.assert_allclose(logp, np.log(softmax(LOGITS))[tokens], rtol=1e-5)


def test_top_k_one_is_greedy_even_when_hot():
    tokens, _, slogp = draw(temperature=5.0, top_k=1, n=64)
    np.testing.assert_array_equal(tokens, 0)
    np.testing.assert_allclose(slogp, 0.0, atol=1e-6)


@pytest.mark.parametrize("top_p, support", [(0.3, 1), (0.6, 2), (0.8, 3), (1.0, 6)])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, support):
    # probabilities ~[0.56, 0.21, 0.13, 0.08, 0.03, 0.004]: cumulative 0.56, 0.77, 0.89, ...
    tokens, _, _ = draw(top_p=top_p, n=3000)
    assert set(np.unique(tokens)) == set(range(support))


def test_top_k_then_top_p():
    filtered = jax.device_get(
        sampling.sampling_logits(
            jnp.asarray(LOGITS)[None],
            jnp.ones((1,), jnp.float32),
            jnp.full((1,), 3, jnp.int32),
            jnp.full((1,), 0.8, jnp.float32),
        )
    )[0]
    # top-3 renormalised: [0.63, 0.23, 0.14] -> cumulative 0.63, 0.86: two survive.
    assert np.isfinite(filtered).tolist() == [True, True, False, False, False, False]


def test_draws_depend_only_on_key_and_position_not_on_row_or_batch_mates():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 32)).astype(np.float32))
    keys = np.stack([sampling.request_key_data(s) for s in (11, 12, 13, 14)])
    pos = np.array([0, 5, 9, 2], np.int32)
    temp = np.array([1.0, 0.7, 1.3, 1.0], np.float32)
    top_k = np.array([0, 10, 0, 5], np.int32)
    top_p = np.array([1.0, 0.9, 0.8, 1.0], np.float32)
    args = [logits, keys, pos, temp, top_k, top_p]
    fn = jax.jit(sampling.sample_tokens)
    full = jax.device_get(fn(*[jnp.asarray(a) for a in args]))
    perm = np.array([2, 0, 3, 1])
    permuted = jax.device_get(fn(*[jnp.asarray(np.asarray(a)[perm]) for a in args]))
    for f, p in zip(full, permuted, strict=True):
        np.testing.assert_allclose(np.asarray(f)[perm], p, rtol=1e-6)
    alone = jax.device_get(fn(*[jnp.asarray(np.asarray(a)[1:2]) for a in args]))
    assert alone[0][0] == full[0][1]


def test_sampling_params_validation_names_fields():
    for bad, field in [
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_k=1.5), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(stop_ids=(300,)), "stop_ids"),
    ]:
        with pytest.raises(ValueError, match=field):
            bad.validate(vocab_size=256, max_stop_ids=4)
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5, stop_ids=(1,)).validate(256, 4)


def test_inverse_cdf_picks_the_interval_holding_u_across_blocks():
    # 600 entries (three blocks, the last one partial); mass on 5 entries spread over them.
    v = 600
    logits = np.full((v,), -np.inf, np.float32)
    support = np.array([3, 255, 256, 511, 599])
    logits[support] = np.log(np.array([0.1, 0.2, 0.3, 0.15, 0.25], np.float32))
    edges = np.cumsum([0.1, 0.2, 0.3, 0.15, 0.25])
    us, want = [], []
    for lo, hi, tok in zip(np.r_[0.0, edges[:-1]], edges, support, strict=True):
        us += [lo + 1e-4, (lo + hi) / 2, hi - 1e-4]
        want += [tok] * 3
    us += [0.0, np.nextafter(np.float32(1), np.float32(0))]
    want += [3, 599]
    got = sampling.inverse_cdf(
        jnp.broadcast_to(jnp.asarray(logits), (len(us), v)), jnp.asarray(us, jnp.float32)
    )
    np.testing.assert_array_equal(jax.device_get(got), want)


def test_inverse_cdf_never_picks_a_masked_entry():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, 1000)).astype(np.float32)
    logits[:, rng.random(1000) < 0.9] = -np.inf  # about 100 survivors per row
    u = np.linspace(0.0, 1.0, 64, endpoint=False, dtype=np.float32)
    u[-1] = np.nextafter(np.float32(1), np.float32(0))
    got = jax.device_get(sampling.inverse_cdf(jnp.asarray(logits), jnp.asarray(u)))
    assert np.all(np.isfinite(logits[np.arange(64), got]))


def test_argmax_is_the_first_maximum():
    x = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0], [-np.inf, -3.0, -np.inf, -3.0]])
    np.testing.assert_array_equal(jax.device_get(sampling.argmax(jnp.asarray(x))), [1, 0, 1])
    y = np.random.default_rng(2).normal(size=(8, 49152)).astype(np.float32)
    np.testing.assert_array_equal(
        jax.device_get(sampling.argmax(jnp.asarray(y))), np.argmax(y, axis=-1)
    )
