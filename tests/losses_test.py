"""Policy/value losses against NumPy references; gradient and decomposability properties."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax.algorithms import losses

AGGS = losses.AGGREGATIONS


def _run(fn, *arrays, **static):
    """jit(fn) on explicitly transferred inputs, no implicit transfer allowed."""
    fn_jit = jax.jit(functools.partial(fn, **static))
    arrays = jax.device_put(arrays)
    with jax.transfer_guard("disallow"):
        out = fn_jit(*arrays)
    return jax.device_get(out)


def _batch(seed: int = 0, B: int = 9, T: int = 6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0], lengths[1] = 0, T  # an empty response and a full one
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    old = rng.normal(-1.5, 0.5, size=(B, T)).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, size=(B, T))).astype(np.float32)
    behaviour = (old + rng.normal(0, 0.2, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32) * mask
    return logp, old, adv, mask, behaviour


def _ref_aggregate(loss, mask, aggregation):
    per_seq = (loss * mask).sum(axis=1)
    n_tok = mask.sum(axis=1)
    if aggregation == "token_mean":
        return per_seq.sum() / mask.sum()
    if aggregation == "seq_mean_token_sum":
        return per_seq.sum() / (n_tok > 0).sum()
    return (per_seq / np.maximum(n_tok, 1)).sum() / (n_tok > 0).sum()


def _ref_ppo(logp, old, adv, eps_low, eps_high, dual_c=None, behaviour=None, cap=None):
    ratio = np.exp(logp - old)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual_c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual_c * adv), loss)
    if behaviour is not None:
        loss = loss * np.minimum(np.exp(old - behaviour), cap)
    return loss


def _full_normalizer(mask, aggregation):
    return np.float32(_run(losses.normalizer_part, mask, aggregation=aggregation))


@pytest.mark.parametrize("aggregation", AGGS)
def test_aggregate_matches_numpy(aggregation):
    logp, _, _, mask, _ = _batch(1)
    n = _full_normalizer(mask, aggregation)
    agg = lambda x, m, norm: losses.aggregate(x, m, aggregation=aggregation, normalizer=norm)
    got = _run(agg, logp, mask, n)
    np.testing.assert_allclose(got, _ref_aggregate(logp, mask, aggregation), rtol=1e-5)


@pytest.mark.parametrize(
    "name,options",
    [
        ("ppo_clip", {}),
        ("ppo_clip", {"dual_clip_c": 3.0}),
        ("dapo", {}),
        ("dapo", {"clip_eps_low": 0.1, "clip_eps_high": 0.4, "tis": 2.0}),
    ],
)
@pytest.mark.parametrize("aggregation", AGGS)
def test_policy_loss_matches_numpy(name, options, aggregation):
    logp, old, adv, mask, behaviour = _batch(2)
    logp = old + 2.0 * (logp - old)  # wide ratios so that every clip branch is hit
    options = dict(options)
    cap = options.pop("tis", None)
    eps_low = options.get("clip_eps_low", 0.2)
    eps_high = options.get("clip_eps_high", 0.28 if name == "dapo" else 0.2)
    n = _full_normalizer(mask, aggregation)

    def fn(lp, o, a, m, b, norm):
        return losses.POLICY_LOSSES[name](
            lp,
            o,
            a,
            m,
            normalizer=norm,
            aggregation=aggregation,
            behaviour_logp_BxT=b if cap else None,
            tis_cap=cap,
            **options,
        )

    loss, metrics = _run(fn, logp, old, adv, mask, behaviour, n)
    ref = _ref_ppo(logp, old, adv, eps_low, eps_high, options.get("dual_clip_c"))
    if cap:
        ref = ref * np.minimum(np.exp(old - behaviour), cap)
    np.testing.assert_allclose(loss, _ref_aggregate(ref, mask, aggregation), rtol=1e-5)
    ratio = np.exp(logp - old)
    clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    assert clipped[mask > 0].sum() > 0
    np.testing.assert_allclose(metrics["clip_frac_sum"], (clipped * mask).sum())
    np.testing.assert_allclose(metrics["num_tokens"], mask.sum())
    if "dual_clip_c" in options:
        dual = (adv < 0) & (ratio > 3.0)
        assert (dual * mask).sum() > 0
        np.testing.assert_allclose(metrics["dual_clip_frac_sum"], (dual * mask).sum())


def _grad_wrt_logp(logp, old, adv, mask, n, **kw):
    def fn(lp, o, a, m, norm):
        return jax.grad(lambda x: losses.ppo_clip(x, o, a, m, normalizer=norm, **kw)[0])(lp)

    return _run(fn, logp, old, adv, mask, n)


def test_zero_advantage_gives_zero_gradient():
    logp, old, adv, mask, _ = _batch(3)
    g = _grad_wrt_logp(logp, old, np.zeros_like(adv), mask, np.float32(mask.sum()))
    assert np.all(g == 0.0)


def test_ratio_one_gives_plain_policy_gradient():
    """At rho = 1 (no clip active), dL/dlogp_it = -A_it m_it / N."""
    _, old, adv, mask, _ = _batch(4)
    n = np.float32(mask.sum())
    g = _grad_wrt_logp(old, old, adv, mask, n)
    np.testing.assert_allclose(g, -adv * mask / n, rtol=1e-6, atol=1e-7)
    assert np.abs(g).max() > 0


@pytest.mark.parametrize("aggregation,seed", [(agg, seed) for seed, agg in enumerate(AGGS)])
def test_microbatch_sum_equals_full_batch(aggregation, seed):
    """Loss and gradient summed over any split, with the global N, equal the full batch."""
    logp, old, adv, mask, behaviour = _batch(10 + seed, B=11)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(logp))  # arrival order
    cuts = np.sort(rng.choice(np.arange(1, len(logp)), size=3, replace=False))
    parts = np.split(order, cuts)  # micro-batches of unequal sizes

    def loss_and_grad(lp, o, a, m, b, norm):
        def loss_fn(x):
            return losses.actor_loss(
                x,
                o,
                a,
                m,
                normalizer=norm,
                policy_loss="dapo",
                aggregation=aggregation,
                policy_options={"dual_clip_c": 3.0},
                behaviour_logp_BxT=b,
                tis_cap=2.0,
                ref_logp_BxT=o,
                kl_coef=0.1,
                entropy_BxT=jnp.exp(x),
                entropy_coef=0.01,
            )

        return jax.value_and_grad(loss_fn, has_aux=True)(lp)

    step = jax.jit(loss_and_grad)  # one compile: micro-batches are padded to B rows

    def run_part(rows, norm):
        """Micro-batch `rows` padded to B rows (garbage data, mask 0), like a shape bucket."""
        pad = len(logp) - len(rows)
        arrays = [np.concatenate([x[rows], 5.0 * np.ones_like(x[:pad])]) for x in (logp, old, adv)]
        arrays += [np.concatenate([mask[rows], np.zeros_like(mask[:pad])])]
        arrays += [np.concatenate([behaviour[rows], np.ones_like(behaviour[:pad])])]
        with jax.transfer_guard("disallow"):
            out = step(*jax.device_put((*arrays, np.float32(norm))))
        (loss, metrics), g = jax.device_get(out)
        return loss, metrics, g[: len(rows)]

    n_full = np.float32(sum(_full_normalizer(mask[p], aggregation) for p in parts))
    assert n_full == _full_normalizer(mask, aggregation)
    full_loss, full_metrics, full_grad = run_part(np.arange(len(logp)), n_full)
    sum_loss, grad, sum_metrics, late = 0.0, np.zeros_like(logp), {}, 0.0
    for p in parts:
        loss, metrics, grad[p] = run_part(p, n_full)
        sum_loss += loss
        for k, v in metrics.items():
            sum_metrics[k] = sum_metrics.get(k, 0.0) + v
        # N unknown until the end: normalizer=1 per micro-batch, divide the sum afterwards.
        late += run_part(p, 1.0)[0]
    np.testing.assert_allclose(sum_loss, full_loss, rtol=1e-5)
    np.testing.assert_allclose(late / n_full, full_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, full_grad, rtol=1e-5, atol=1e-8)
    assert np.abs(full_grad).max() > 0
    got, want = losses.finalize_metrics(sum_metrics), losses.finalize_metrics(full_metrics)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_value_loss_matches_numpy():
    rng = np.random.default_rng(6)
    _, _, _, mask, _ = _batch(6)
    values, old_values, returns = rng.normal(size=(3, *mask.shape)).astype(np.float32)
    fn = lambda v, o, r, m, n: losses.value_loss(v, o, r, m, normalizer=n, clip_eps=0.2)
    loss, metrics = _run(fn, values, old_values, returns, mask, np.float32(mask.sum()))
    v_clip = old_values + np.clip(values - old_values, -0.2, 0.2)
    per_tok = 0.5 * np.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
    np.testing.assert_allclose(loss, (per_tok * mask).sum() / mask.sum(), rtol=1e-5)
    assert 0 < metrics["vf_clip_frac_sum"] < mask.sum()


def test_bad_arguments_raise():
    logp, old, adv, mask = jax.device_put(_batch(8)[:4])
    with pytest.raises(ValueError, match="aggregation"):
        losses.aggregate(logp, mask, aggregation="mean", normalizer=logp.sum())
    with pytest.raises(ValueError, match="tis_cap"):
        losses.ppo_clip(logp, old, adv, mask, normalizer=logp.sum(), behaviour_logp_BxT=old)
    with pytest.raises(ValueError, match="dual_clip_c"):
        losses.ppo_clip(logp, old, adv, mask, normalizer=logp.sum(), dual_clip_c=0.5)


def test_finalize_metrics_is_one_implementation_on_host_and_device():
    summed = {"loss": 6.0, "pg_loss": 3.0, "num_tokens": 4.0, "ratio_sum": 2.0}
    host = losses.finalize_metrics(summed, 2.0)
    assert host == {"loss": 3.0, "pg_loss": 1.5, "num_tokens": 4.0, "ratio": 0.5}
    assert all(type(v) is float for v in host.values())
    arrays = {k: np.float32(v) for k, v in summed.items()}
    device = _run(losses.finalize_metrics, arrays, np.float32(2.0))  # traced: jax.numpy
    assert device.keys() == host.keys()
    for k, v in host.items():
        np.testing.assert_allclose(device[k], v, rtol=1e-6, err_msg=k)
    # No tokens: token means divide by max(num_tokens, 1), never by 0.
    assert losses.finalize_metrics({"num_tokens": 0.0, "ratio_sum": 0.0})["ratio"] == 0.0


def test_dapo_has_ppo_clips_arguments_with_clip_higher_default():
    dapo = inspect.signature(losses.dapo).parameters
    ppo = inspect.signature(losses.ppo_clip).parameters
    assert list(dapo) == list(ppo)
    assert (dapo["clip_eps_high"].default, ppo["clip_eps_high"].default) == (0.28, 0.2)


def _pack_pairs(*arrays_BxT):
    """Rows 2k and 2k+1 side by side in one row (B odd: the last row with zeros), and the
    segment ids (1 on the first half, 2 on the second) that name the two sequences."""
    out = []
    for x in arrays_BxT:
        if x.shape[0] % 2:
            x = np.concatenate([x, np.zeros_like(x[:1])])
        out.append(np.concatenate([x[0::2], x[1::2]], axis=1))
    b, t = out[0].shape
    segments = np.broadcast_to(np.repeat(np.int32([1, 2]), t // 2)[None], (b, t)).copy()
    return (*out, segments)


@pytest.mark.parametrize("aggregation", AGGS)
def test_packed_rows_aggregate_like_one_sequence_per_row(aggregation):
    # Two sequences per row, named by segment ids: the same loss and normaliser.
    logp, old, adv, mask, behaviour = _batch(3)
    packed = _pack_pairs(logp, old, adv, mask, behaviour)
    kw = dict(aggregation=aggregation, normalizer=7.0)
    want = _run(functools.partial(losses.ppo_clip, **kw), logp, old, adv, mask)
    got = _run(lambda *a: losses.ppo_clip(*a[:4], segment_ids_BxT=a[5], **kw), *packed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    n_seq = _run(losses.normalizer_part, mask, aggregation=aggregation)
    n_packed = _run(
        lambda m, s: losses.normalizer_part(m, aggregation, segment_ids_BxT=s), packed[3], packed[5]
    )
    assert n_seq == n_packed == _full_normalizer(mask, aggregation)
    if aggregation != "token_mean":
        assert n_packed == (mask.sum(axis=1) > 0).sum()  # sequences, not rows
