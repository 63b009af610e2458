"""DAPO's soft overlong punishment: the piecewise values and that it reaches the advantages."""

import collections

import numpy as np
import pytest
from support import pack_small, scored_sample, sync_gate

from streamrl_jax import config as config_lib
from streamrl_jax.algorithms.overlong import OverlongPenalty, soft_overlong_penalty
from streamrl_jax.config import ConfigError


def test_piecewise_values():
    # L_max = 48, buffer 16, p = 1: 0 up to 32 tokens, linear 33..47, -1 at 48 (or cut).
    lengths = np.array([0, 20, 32, 33, 40, 47, 48, 10])
    truncated = np.array([0, 0, 0, 0, 0, 0, 1, 1], bool)
    got = soft_overlong_penalty(lengths, truncated, max_len=48, buffer=16, penalty=1.0)
    want = [0, 0, 0, -1 / 16, -8 / 16, -15 / 16, -1, -1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = soft_overlong_penalty(lengths, truncated, max_len=48, buffer=16, penalty=0.5)
    np.testing.assert_allclose(got, 0.5 * np.asarray(want), rtol=1e-6)
    # A buffer as long as the cap penalises every token; a stopped response of 48 tokens
    # (the cap, ending on its stop token) gets the full penalty too.
    got = soft_overlong_penalty([0, 12, 24, 48], [0, 0, 0, 0], max_len=48, buffer=48, penalty=1)
    np.testing.assert_allclose(got, [0, -0.25, -0.5, -1.0], rtol=1e-6)
    with pytest.raises(ValueError, match="overlong buffer"):
        soft_overlong_penalty([1], [0], max_len=8, buffer=0, penalty=1.0)


def test_the_penalty_reaches_the_advantages_and_the_stats():
    # One group, equal scores: without the penalty every advantage is 0; with it the
    # shorter response is ahead (advantage > 0) and the truncated one behind.
    def group():
        return [
            [
                scored_sample(0, 0, 1.0, version=2, length=3),
                scored_sample(0, 1, 1.0, version=2, length=8),
            ]
        ]

    def adv(batch):
        rows = batch.loss_mask.sum(axis=1) > 0
        return [batch.advantages[r][batch.loss_mask[r]] for r in np.flatnonzero(rows)]

    plain = pack_small(group(), sync_gate(), collections.defaultdict(list))
    assert all(np.all(a == 0) for a in adv(plain))
    stats = collections.defaultdict(list)
    overlong = OverlongPenalty(max_len=8, buffer=4, penalty=1.0)
    shaped = pack_small(group(), sync_gate(), stats, overlong=overlong)
    short, long = adv(shaped)
    assert np.all(short > 0) and np.all(long < 0)
    np.testing.assert_allclose(short[0], -long[0], rtol=1e-5)  # GRPO over (1, 0)
    assert stats["overlong_penalty"] == [0.0, -1.0]
    assert stats["reward"] == [1.0, 1.0]  # the outcome score, reported apart
    rows = shaped.loss_mask.sum(axis=1) > 0
    np.testing.assert_allclose(sorted(shaped.rewards[rows].sum(axis=1)), [0.0, 1.0])


def test_config_fields_and_their_checks():
    cd = config_lib.defaults().to_dict()
    cd["algorithm"] |= {"overlong_buffer": 16, "overlong_penalty": 0.5}
    cfg = config_lib.from_config_dict(cd)
    assert OverlongPenalty.from_config(
        cfg.algorithm, cfg.generation.max_new_tokens
    ) == OverlongPenalty(128, 16, 0.5)
    default = config_lib.from_config_dict(config_lib.defaults().to_dict())
    assert OverlongPenalty.from_config(default.algorithm, 128) is None
    cd["algorithm"]["overlong_buffer"] = 129
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer"):
        config_lib.from_config_dict(cd)
    cd["algorithm"] |= {"overlong_buffer": 4, "overlong_penalty": -1.0}
    with pytest.raises(ConfigError, match="algorithm.overlong_penalty"):
        config_lib.from_config_dict(cd)
