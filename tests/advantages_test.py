"""Advantage estimators against plain NumPy references and hand-computed GAE."""

import functools
import inspect

import jax
import numpy as np
import pytest

from streamrl_jax.algorithms import advantages as adv_lib


def _run(fn, *arrays, **static):
    """jit(fn) on explicitly transferred inputs, no implicit transfer allowed."""
    fn_jit = jax.jit(functools.partial(fn, **static))
    arrays = jax.device_put(arrays)
    with jax.transfer_guard("disallow"):
        out = fn_jit(*arrays)
    return jax.device_get(out)


def _batch(seed: int = 0, num_groups: int = 3, group_size: int = 4, T: int = 7):
    """Shuffled groups (streamed arrival), right-padded masks, one padding row."""
    rng = np.random.default_rng(seed)
    B = num_groups * group_size + 1
    ids = np.repeat(np.arange(num_groups), group_size).astype(np.int32)
    ids = np.concatenate([ids, [0]]).astype(np.int32)  # last row: padding
    perm = rng.permutation(B)
    ids = ids[perm]
    valid = np.ones(B, np.float32)
    valid[np.argmax(perm == B - 1)] = 0.0
    rewards = rng.normal(size=B).astype(np.float32)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0] = 0  # an empty response
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    kl = rng.normal(scale=0.1, size=(B, T)).astype(np.float32)
    return rewards, mask, ids, valid, kl


def _ref_group_stats(scores, ids, valid):
    mean, std, count = (np.zeros_like(scores) for _ in range(3))
    for g in np.unique(ids):
        members = (ids == g) & (valid > 0)
        vals = scores[members]
        sel = ids == g
        count[sel] = len(vals)
        mean[sel] = vals.mean() if len(vals) else 0.0
        std[sel] = vals.std(ddof=1) if len(vals) > 1 else 0.0
    return count, mean, std


def _call(fn):
    """Adapts the keyword-only API to positional jit inputs."""
    return lambda r, m, g, v, k, **kw: fn(r, m, g, valid_B=v, kl_BxT=k, **kw)


def _ref_seq_scores(rewards, mask, kl, kl_coef):
    return rewards - kl_coef * (kl * mask).sum(axis=1)


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_matches_numpy(kl_coef):
    rewards, mask, ids, valid, kl = _batch()
    got = _run(_call(adv_lib.grpo), rewards, mask, ids, valid, kl, kl_coef=kl_coef, eps=1e-6)
    scores = _ref_seq_scores(rewards, mask, kl, kl_coef)
    _, mean, std = _ref_group_stats(scores, ids, valid)
    want = ((scores - mean) / (std + 1e-6) * valid)[:, None] * mask
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dr_grpo_matches_numpy():
    rewards, mask, ids, valid, kl = _batch(1)
    got = _run(_call(adv_lib.dr_grpo), rewards, mask, ids, valid, kl)
    _, mean, _ = _ref_group_stats(rewards, ids, valid)
    np.testing.assert_allclose(got, ((rewards - mean) * valid)[:, None] * mask, atol=1e-6)


def test_rloo_is_leave_one_out_mean():
    rewards, mask, ids, valid, kl = _batch(2)
    got = _run(_call(adv_lib.rloo), rewards, mask, ids, valid, kl)
    want = np.zeros_like(rewards)
    for i in range(len(rewards)):
        others = (ids == ids[i]) & (valid > 0) & (np.arange(len(rewards)) != i)
        if valid[i] > 0 and others.any():
            want[i] = rewards[i] - rewards[others].mean()
    np.testing.assert_allclose(got, want[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_group_of_one_gets_zero_advantage():
    rewards = np.array([3.0, 1.0, 2.0], np.float32)
    mask = np.ones((3, 2), np.float32)
    ids = np.array([0, 1, 1], np.int32)
    for fn in (adv_lib.grpo, adv_lib.rloo, adv_lib.dr_grpo):
        got = _run(fn, rewards, mask, ids)
        assert np.all(got[0] == 0.0), fn.__name__
        assert np.all(got[1] != 0.0), fn.__name__


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_are_streamable(name):
    """Advantages of a micro-batch of complete groups equal the full-batch rows."""
    rewards, mask, ids, valid, kl = _batch(3)
    fn = _call(adv_lib.ADVANTAGES[name])
    full = _run(fn, rewards, mask, ids, valid, kl)
    part = np.isin(ids, [0, 2])
    sub = _run(fn, rewards[part], mask[part], ids[part], valid[part], kl[part])
    np.testing.assert_allclose(sub, full[part], rtol=1e-5, atol=1e-6)


def _ref_reinforce_pp(rewards, mask, valid, kl, kl_coef, gamma, eps):
    mask = mask * valid[:, None]
    B, T = mask.shape
    ret = np.zeros((B, T), np.float32)
    for i in range(B):
        valid_t = np.nonzero(mask[i])[0]
        tok_r = -kl_coef * kl[i] * mask[i]
        if len(valid_t):
            tok_r[valid_t[-1]] += rewards[i]
        running = 0.0
        for t in valid_t[::-1]:
            running = tok_r[t] + gamma * running
            ret[i, t] = running
    vals = ret[mask > 0]
    return (ret - vals.mean()) / (vals.std() + eps) * mask


@pytest.mark.parametrize("kl_coef,gamma", [(0.0, 1.0), (0.1, 0.9)])
def test_reinforce_pp_matches_numpy(kl_coef, gamma):
    rewards, mask, ids, valid, kl = _batch(4)
    got = _run(
        _call(adv_lib.reinforce_pp), rewards, mask, ids, valid, kl, kl_coef=kl_coef, gamma=gamma
    )
    want = _ref_reinforce_pp(rewards, mask, valid, kl, kl_coef, gamma, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_gae_hand_computed():
    """gamma=0.9, lam=0.8, reward on the last valid token, one padding token.

    t=2: delta = 1 + 0.9*0 - 0.6 = 0.4;               A2 = 0.4
    t=1: delta = 0 + 0.9*0.6 - 0.4 = 0.14;            A1 = 0.14 + 0.72*0.4 = 0.428
    t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;           A0 = -0.14 + 0.72*0.428 = 0.16816
    returns = A + V = [0.66816, 0.828, 1.0, 0 (pad)]
    """
    rewards = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
    values = np.array([[0.5, 0.4, 0.6, 9.0]], np.float32)  # 9.0: garbage under padding
    mask = np.array([[1, 1, 1, 0]], np.float32)
    adv, ret = _run(adv_lib.gae, rewards, values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [[0.16816, 0.428, 0.4, 0.0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0.66816, 0.828, 1.0, 0.0]], atol=1e-6)


def _ref_gae(r, v, m, gamma, lam):
    B, T = r.shape
    adv = np.zeros((B, T), np.float64)
    for i in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(T)):
            if m[i, t] == 0:
                continue
            delta = r[i, t] + gamma * next_v - v[i, t]
            next_a = delta + gamma * lam * next_a
            next_v = v[i, t]
            adv[i, t] = next_a
    return adv, (adv + v) * m


def test_gae_matches_numpy_with_padding():
    rng = np.random.default_rng(5)
    B, T = 5, 9
    rewards, mask, *_ = _batch(5, num_groups=1, group_size=B - 1, T=T)
    values = rng.normal(size=(B, T)).astype(np.float32)
    tok_r = _run(adv_lib.last_token_rewards, rewards, mask)
    tok_r = tok_r + rng.normal(scale=0.1, size=(B, T)).astype(np.float32) * mask
    adv, ret = _run(adv_lib.gae, tok_r, values, mask, gamma=0.99, lam=0.95)
    want_adv, want_ret = _ref_gae(tok_r, values, mask, 0.99, 0.95)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)


def test_last_token_rewards():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]], np.float32)
    got = _run(adv_lib.last_token_rewards, np.array([2.0, 5.0, -1.0], np.float32), mask)
    np.testing.assert_array_equal(got, [[0, 2, 0], [0, 0, 0], [0, 0, -1]])


def test_registry_names():
    assert set(adv_lib.ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp"}


def test_estimators_show_the_common_signature_plus_their_options():
    common = ["rewards_B", "mask_BxT", "group_ids_B", "valid_B", "num_groups", "kl_BxT", "kl_coef"]
    options = {"grpo": ["eps"], "dr_grpo": [], "rloo": [], "reinforce_pp": ["gamma", "eps"]}
    for name, fn in adv_lib.ADVANTAGES.items():
        assert fn.__name__ == name
        assert list(inspect.signature(fn).parameters) == common + options[name], name
    rewards, mask, ids, *_ = _batch()
    with pytest.raises(TypeError, match="eps"):
        adv_lib.dr_grpo(rewards, mask, ids, eps=1e-6)  # not an option of Dr.GRPO


def test_gae_with_segments_restarts_every_sequence():
    # Rows 0-1 and 2-3 side by side in one row each: each sequence is its own episode.
    rng = np.random.default_rng(6)
    B, T = 4, 6
    mask = (np.arange(T)[None, :] < np.array([[6], [3], [0], [4]])).astype(np.float32)
    rewards = rng.normal(size=(B, T)).astype(np.float32) * mask
    values = rng.normal(size=(B, T)).astype(np.float32)
    want_adv, want_ret = _run(adv_lib.gae, rewards, values, mask, gamma=0.9, lam=0.8)
    pack = lambda x: np.concatenate([x[0::2], x[1::2]], axis=1)
    segments = np.broadcast_to(np.repeat(np.int32([1, 2]), T)[None], (B // 2, 2 * T))
    got = _run(
        lambda r, v, m, s: adv_lib.gae(r, v, m, gamma=0.9, lam=0.8, segment_ids_BxT=s),
        pack(rewards),
        pack(values),
        pack(mask),
        np.ascontiguousarray(segments),
    )
    np.testing.assert_allclose(got[0], pack(want_adv), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], pack(want_ret), rtol=1e-6, atol=1e-6)
    # Without segment ids the first sequence would bootstrap from the second.
    chained, _ = _run(adv_lib.gae, pack(rewards), pack(values), pack(mask), gamma=0.9, lam=0.8)
    assert np.abs(chained - pack(want_adv)).max() > 1e-3
