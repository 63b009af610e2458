"""On-policy distillation (`algorithms/distill.py`, `algorithm.distill_teacher`): the
per-token term is log pi_student - log pi_teacher, a teacher equal to the student gives
zero loss and zero gradient, and the main job distils from another run's checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import policy_samples

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.algorithms import distill
from streamrl_jax.config import OptimizerSection
from streamrl_jax.metrics import read_jsonl
from streamrl_jax.model import config as model_config
from streamrl_jax.trainer import TrainerConfig, make_batch, make_policy_trainer


def test_the_per_token_term_is_the_student_minus_the_teacher_log_prob():
    rng = np.random.default_rng(0)
    adv, s, t = (rng.normal(size=(3, 7)).astype(np.float32) for _ in range(3))
    mask = rng.random((3, 7)) < 0.7
    got = distill.with_teacher(adv, mask, s, t, jnp.float32(0.5))
    want = adv - 0.5 * np.where(mask, s - t, 0.0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(distill.reverse_kl(s, t, mask))[~mask], 0.0)


def test_a_teacher_equal_to_the_student_gives_zero_loss_and_gradient():
    tcfg = TrainerConfig(
        optimizer=OptimizerSection(learning_rate=1e-3, max_grad_norm=0.0),
        seq_buckets=(32,),
        batch_buckets=(4,),
    )
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    trainer = make_policy_trainer(model_config.tiny(), tcfg, mesh)
    state = trainer.init_state(0)
    host = make_batch(
        **policy_samples(advantages=np.zeros(4, np.float32)), seq_buckets=(32,), batch_buckets=(4,)
    )

    def gradient(teacher_params):
        dev = trainer.place_batch(host)
        student = trainer.logprobs(state.params, dev)
        # the trainer's own log-probs as pi_old: the ratio is 1, as in an on-policy step
        dev = dev.replace(old_logp=student)
        teacher = trainer.logprobs(teacher_params, dev)
        adv = distill.with_teacher(dev.advantages, dev.loss_mask, student, teacher, 1.0)
        acc, metrics = trainer.accumulate(
            state, trainer.init_accumulator(), dev.replace(advantages=adv), trainer.scalar(1.0)
        )
        norm = np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(acc.grads)))
        return float(metrics["loss"]), norm

    loss, norm = gradient(state.params)
    assert loss == 0.0 and norm == 0.0
    other = jax.tree.map(lambda x: x * 1.25, state.params)  # a different teacher
    loss, norm = gradient(other)
    assert norm > 0.0


def test_the_main_job_distils_from_another_runs_checkpoint(tmp_path):
    from support import tiny_config

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.rewards.vowels import vowel_reward

    teacher_run = tmp_path / "teacher"
    # No held-out evaluation: what it would add is lifecycle_test's; each run is one step.
    cfg = tiny_config(pipeline__steps=1, warmup__steps=0, checkpoint__every=1, eval__num_problems=0)
    run_lib.run(cfg, str(teacher_run), reward_fn=vowel_reward)
    student = tiny_config(
        pipeline__steps=1, warmup__steps=0, eval__num_problems=0,
        algorithm__distill_teacher=str(teacher_run / "checkpoints"), algorithm__distill_coef=0.5,
    )  # fmt: skip
    result = run_lib.run(student, str(tmp_path / "student"), reward_fn=vowel_reward)
    assert len(result.steps) == 1
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in result.steps)
    # Each row reports the student's mean per-token reverse KL to the teacher (a one-step
    # trained teacher differs from the student's start); a run without a teacher has none.
    assert all(np.isfinite(r["distill_reverse_kl"]) for r in result.steps)
    assert all(r["distill_reverse_kl"] != 0 for r in result.steps)
    rows = read_jsonl(str(tmp_path / "student" / "metrics.jsonl"))
    assert any("distill_reverse_kl" in r for r in rows)
    plain = read_jsonl(str(teacher_run / "metrics.jsonl"))
    assert not any("distill_reverse_kl" in r for r in plain)
    with pytest.raises(Exception, match="distill_teacher: .* does not exist"):
        bad = tiny_config(pipeline__steps=1, algorithm__distill_teacher=str(tmp_path / "none"))
        run_lib.run(bad, str(tmp_path / "bad"), reward_fn=vowel_reward)
