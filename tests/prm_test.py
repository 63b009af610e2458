"""Implicit process rewards (algorithms/prm.py, learner/prm.py): the maths against a hand
computation, and the PRM as a learner target in a run (it starts as pi_ref, so the first
step is the run without it; it trains, and it resumes bit for bit)."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import tiny_config

from streamrl_jax import pipeline as run_lib
from streamrl_jax.algorithms import prm
from streamrl_jax.errors import UserError
from streamrl_jax.pipeline.resume import CONSUMED
from streamrl_jax.rewards.vowels import vowel_reward

# One packed row: a prompt (segment 0), sequence 1 with 3 trained positions, sequence 2
# with 2; then padding. loss_mask marks the positions whose next token is trained.
SEG = np.array([[0, 0, 1, 1, 1, 1, 2, 2, 2, 0]], np.int32)
MASK = np.array([[0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], bool)
PRM = np.array([[0, -1.0, -2.0, -0.5, 0, 0, -3.0, -1.0, 0, 0]], np.float32)
REF = np.array([[0, -1.5, -1.0, -0.5, 0, 0, -2.0, -2.0, 0, 0]], np.float32)
REWARD = np.array([[0, 0, 0, 1.0, 0, 0, 0, 0.25, 0, 0]], np.float32)  # at each last position
BETA = 0.5


def _loss_mask_and_segments():
    # Trained position t predicts token t + 1: sequence 1's positions 1-3 are in segment
    # 1 at their token (2-4), as the trainer's batches lay them out.
    seg = SEG.copy()
    seg[0, 1] = 1
    seg[0, 6] = 2
    return MASK, seg


def test_process_rewards_returns_and_the_implicit_loss_by_hand():
    mask, seg = _loss_mask_and_segments()
    r = np.asarray(prm.process_rewards(PRM, REF, mask, BETA))
    want_r = BETA * (PRM - REF) * mask  # [0.25, -0.5, 0] and [-0.5, 0.5]
    np.testing.assert_allclose(r, want_r, atol=0)
    rtg = np.asarray(prm.returns_to_go(r, mask, seg))
    want = np.zeros_like(r)
    want[0, [1, 2, 3]] = [0.25 - 0.5 + 0, -0.5 + 0, 0]
    want[0, [6, 7]] = [-0.5 + 0.5, 0.5]
    np.testing.assert_allclose(rtg, want, atol=1e-7)
    # s_1 = -0.25 (label 1), s_2 = 0 (label 0.25); seq_mean_token_mean: each weighs 1.
    s = np.array([-0.25, 0.0])
    y = np.array([1.0, 0.25])
    per_seq = np.log1p(np.exp(s)) - y * s
    loss, metrics = prm.implicit_prm_loss(
        PRM, REF, REWARD, mask, seg, beta=BETA, normalizer=2.0, aggregation="seq_mean_token_mean"
    )
    np.testing.assert_allclose(float(loss), per_seq.sum() / 2, rtol=1e-6)
    # sequence 1 disagrees (s_1 < 0, label 1), sequence 2 agrees (s_2 = 0, label 0.25 < 1/2):
    # its 2 positions
    assert float(metrics["agree_sum"]) == 2
    # token_mean: each sequence weighs its trained positions (3 and 2)
    tok, _ = prm.implicit_prm_loss(
        PRM, REF, REWARD, mask, seg, beta=BETA, normalizer=5.0, aggregation="token_mean"
    )
    np.testing.assert_allclose(float(tok), (3 * per_seq[0] + 2 * per_seq[1]) / 5, rtol=1e-6)
    # The gradient raises log pi_prm of the correct sequence's tokens.
    grad = jax.grad(
        lambda p: prm.implicit_prm_loss(
            p, REF, REWARD, mask, seg, beta=BETA, normalizer=2.0, aggregation="token_mean"
        )[0]
    )(jnp.asarray(PRM))
    assert (np.asarray(grad)[0, [1, 2, 3]] < 0).all()
    assert (np.asarray(grad)[~mask] == 0).all()


def test_the_leave_one_out_baseline_by_hand():
    # Three sequences of one group (sequence 1 and 2 in row 0 as above, a third in row
    # 1) and a fourth alone in its group: K = 3, the means m_1 = -0.25 / 3, m_2 = 0,
    # m_3 = 0.3; each reward becomes r * 3/2 - (m_1 + m_2 + m_3) / 2. The lone
    # sequence keeps its reward. Padding stays 0.
    mask, seg = _loss_mask_and_segments()
    r0 = np.asarray(prm.process_rewards(PRM, REF, mask, BETA))[0]
    r = np.zeros((2, 10), np.float32)
    r[0] = r0
    r[1, [1, 2]] = [0.2, 0.4]  # sequence 3: mean 0.3
    r[1, [5]] = [0.7]  # sequence 4, another group
    m = np.zeros((2, 10), bool)
    m[0] = mask[0]
    m[1, [1, 2, 5]] = True
    sg = np.zeros((2, 10), np.int32)
    sg[0] = seg[0]
    sg[1, 1:4] = 1
    sg[1, 5:7] = 2
    groups = np.full((2, 10), -1, np.int32)
    groups[0, 1:9] = 7
    groups[1, 1:4] = 7
    groups[1, 5:7] = 3
    got = np.asarray(prm.leave_one_out(r, m, sg, groups))
    means = -0.25 / 3 + 0.0 + 0.3
    want = np.where(m, r * 1.5 - means / 2, 0.0)
    want[1, 5] = 0.7
    np.testing.assert_allclose(got, want, atol=1e-6)
    # A group whose samples the PRM credits alike (constant, equal means) adds nothing.
    flat = np.where(m, 0.5, 0.0).astype(np.float32)
    alike = np.asarray(prm.leave_one_out(flat, m, sg, groups))
    np.testing.assert_allclose(alike[m & (groups == 7)], 0.0, atol=1e-6)


def _arrays(state):
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state.params))]


def _cfg(**overrides):
    base = dict(
        pipeline__mode="stream_async",
        pipeline__deterministic=True,
        checkpoint__every=1,
        eval__num_problems=0,
        algorithm__prm_coef=1.0,
        algorithm__prm_beta=0.5,
        algorithm__prm_learning_rate=1e-3,
    )
    return tiny_config(**(base | overrides))


def test_the_prm_starts_as_the_reference_trains_and_resumes_exactly(tmp_path):
    ref = run_lib.run(_cfg(pipeline__steps=2), str(tmp_path / "ref"), reward_fn=vowel_reward)
    # pi_prm = pi_ref at the start: every process reward is 0, the first step is the
    # run's without the PRM.
    off = run_lib.run(
        _cfg(pipeline__steps=1, algorithm__prm_coef=0.0), str(tmp_path / "off"),
        reward_fn=vowel_reward,
    )  # fmt: skip
    for key in ("loss", "grad_norm", "reward"):
        assert ref.steps[0][key] == off.steps[0][key], key
    assert "prm" not in off.target_states
    # It trains: one optimizer step a batch, its loss and gradient in the row.
    assert int(jax.device_get(ref.target_states["prm"].step)) == 2
    for row in ref.steps:
        assert np.isfinite(row["prm_loss"]) and row["prm_grad_norm"] > 0
        assert 0 <= row["prm_agree"] <= 1
    # Its state is part of every checkpoint: the run stopped after its 1st step (its
    # checkpoint 1 and consumed-prompt log, which the resume cuts back to the
    # checkpoint's steps), then a resumed 2nd, bit for bit.
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "ref" / CONSUMED, workdir / CONSUMED)
    os.symlink(tmp_path / "ref" / "checkpoints" / "1", workdir / "checkpoints" / "1")
    resumed = run_lib.run(_cfg(pipeline__steps=2), str(workdir), reward_fn=vowel_reward)
    assert resumed.start_batch == 1 and len(resumed.steps) == 1
    for got, want in (
        (resumed.state, ref.state),
        (resumed.target_states["prm"], ref.target_states["prm"]),
    ):
        for a, b in zip(_arrays(got), _arrays(want), strict=True):
            np.testing.assert_array_equal(a, b)
    # A checkpoint written with the PRM is not resumed without it.
    with pytest.raises(ValueError, match="prm: True -> False"):
        run_lib.run(_cfg(pipeline__steps=3, algorithm__prm_coef=0.0), str(workdir))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(algorithm__advantage="gae"), "GAE replaces the advantages"),
        ("lora", "not built for a LoRA policy"),
    ],
)
def test_what_the_prm_does_not_combine_with_is_refused_by_name(overrides, message):
    if overrides == "lora":
        lora = dataclasses.asdict(tiny_config().trainer.lora) | {"rank": 4}
        overrides = dict(trainer__lora=lora)
    with pytest.raises(UserError, match=message):
        _cfg(**overrides)
