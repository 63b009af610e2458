"""Checkpoint and exact resume of the pipeline (docs/checkpoint.md), on `quickstart:tiny`.

One uninterrupted stream_async run (deterministic mode, a checkpoint every step) is
the reference. A second run is stopped three times at different points, each by an
injected failure that ends the run with a named error:

1. mid-generation (a reward call of batch 1 raises: batch 1 is half generated,
   batch 2 is being generated on W_1 in the background);
2. mid-accumulation (the trainer's third micro-batch of batch 2 raises);
3. right after an optimizer step (the weight sync of W_4 raises, after batch 3's
   update: that update is lost with the process and recomputed on resume),

and resumed from its workdir each time. The resumed run must end with exactly
the reference parameters (bitwise: deterministic mode fixes the summation order,
and regenerated samples are bit-identical) and have trained every drawn prompt
exactly once.
"""

import dataclasses
import os
import re
import shutil
import signal
import threading
import time
from unittest import mock

import jax
import numpy as np
import pytest
from support import (
    assert_partial_rollout_kept_its_bound,
    batch_prompt_ids,
    consumed_log,
    drawn_prompt_ids,
    param_arrays,
    pipeline_threads,
    run_recording,
    tiny_config,
    trainer_dies_on_call,
)

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.checkpoint.trees import is_prng_key
from streamrl_jax.pipeline.resume import CONSUMED, read_consumed
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.weight_sync import WeightSync

STEPS = 5


def _cfg(**overrides):
    base = dict(
        pipeline__mode="stream_async",
        pipeline__steps=STEPS,
        pipeline__deterministic=True,
        checkpoint__every=1,
        checkpoint__keep=10,
        eval__num_problems=0,
    )
    return tiny_config(**(base | overrides))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("reference"))
    return run_lib.run(_cfg(), workdir, reward_fn=vowel_reward), workdir


@pytest.mark.extended  # the default suite's ~10 min budget; `-m extended` runs it
def test_resume_after_three_stops_gives_the_reference_parameters(reference, tmp_path):
    ref, ref_dir = reference
    workdir = str(tmp_path)
    cfg = _cfg()

    # 1. mid-generation: a reward call of batch 2 raises (generated on W_1 while
    # batch 1 trains): the samples of its group 1.
    doomed = batch_prompt_ids(cfg, 2)[1]

    def flaky_reward(text, metadata):
        if metadata["prompt_id"] == doomed:
            raise RuntimeError("reward died")
        return vowel_reward(text, metadata)

    with pytest.raises(run_lib.PipelineError, match="reward died") as info:
        run_lib.run(cfg, workdir, reward_fn=flaky_reward)
    assert info.value.component == "reward function"
    assert not pipeline_threads()
    steps, _ = consumed_log(workdir)
    assert steps == list(range(len(steps))) and len(steps) <= 2  # batch 2 never trained

    # 2. mid-accumulation: the 3rd micro-batch after resuming (batch 2's first) raises.
    with trainer_dies_on_call(3), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(cfg, workdir, reward_fn=vowel_reward)
    assert not pipeline_threads()
    steps, _ = consumed_log(workdir)
    assert steps == list(range(len(steps))) and len(steps) <= 4

    # 3. right after an optimizer step: the background sync of W_4 (after batch 3's
    # update) raises; batch 3 is trained again on resume.
    real_start = WeightSync.start

    def start(self, params, version, on_done=None):
        if version == 4:
            raise RuntimeError("weight sync died")
        return real_start(self, params, version, on_done=on_done)

    with (
        mock.patch.object(WeightSync, "start", start),
        pytest.raises(run_lib.PipelineError, match="weight sync died") as info,
    ):
        run_lib.run(cfg, workdir, reward_fn=vowel_reward)
    assert info.value.component == "weight sync"
    assert not pipeline_threads()

    # Resume to the end.
    result = run_lib.run(cfg, workdir, reward_fn=vowel_reward)
    assert result.start_batch == 3
    assert len(result.steps) == STEPS - 3

    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(workdir)
    ref_steps, ref_counts = consumed_log(ref_dir)
    assert steps == ref_steps == list(range(STEPS))
    assert counts == ref_counts  # the same prompts, each as often as uninterrupted
    assert sum(counts.values()) == STEPS * cfg.pipeline.prompts_per_step


def _host(tree):
    """Host arrays of a tree's leaves (a typed PRNG key as its key data)."""
    return [
        np.asarray(jax.random.key_data(x) if is_prng_key(x) else x)
        for x in jax.device_get(jax.tree.leaves(tree))
    ]


def test_a_checkpoint_restores_onto_another_training_mesh(reference):
    # Checkpoint level: the reference's last checkpoint (written from one training
    # device) read as a resume reads it into the learner of a run with FSDP over 2
    # training devices: every array lands in that mesh's sharding (the large ones split
    # over both devices) and the state is the reference's final state bitwise. The run
    # that resumes there and trains on: `test_resume_onto_another_training_mesh` (-m
    # extended); the step on a 2-device mesh itself is the sharding tests'.
    from streamrl_jax.pipeline import components as build_lib

    ref, ref_dir = reference
    learner = build_lib.build(_cfg(mesh__train_devices=2), warm=False).learner
    like, _ = learner.checkpoint()
    ckpt = ckpt_lib.Checkpointer(os.path.join(ref_dir, "checkpoints"))
    try:
        assert ckpt.latest_step() == STEPS
        restored = ckpt.restore(STEPS, abstract_state=ckpt_lib.abstract_tree(like)).state
    finally:
        ckpt.close()
    learner.restore(restored, {})
    got = jax.tree.leaves(learner.state)
    for x, want in zip(got, jax.tree.leaves(like), strict=True):
        assert x.sharding == want.sharding
    assert any(len(x.sharding.device_set) == 2 and not x.sharding.is_fully_replicated for x in got)
    for a, b in zip(_host(learner.state), _host(ref.state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.extended  # -m extended; the default suite keeps the restore onto another mesh
# (`test_a_checkpoint_restores_onto_another_training_mesh`) and exact resume (sigterm's)
def test_resume_onto_another_training_mesh(reference, tmp_path):
    # The reference run's checkpoint 3, resumed with FSDP over 2 training devices:
    # re-sharded on load; the remaining steps' sums run in another order (sharded
    # reductions), so parameters match to float32 accuracy (1e-5 absolute).
    ref, ref_dir = reference
    workdir = str(tmp_path)
    src = ckpt_lib.Checkpointer(os.path.join(ref_dir, "checkpoints"))
    assert 3 in src.all_steps()
    os.makedirs(os.path.join(workdir, "checkpoints"))
    os.symlink(src.step_directory(3), os.path.join(workdir, "checkpoints", "3"))
    src.close()
    result = run_lib.run(_cfg(mesh__train_devices=2), workdir, reward_fn=vowel_reward)
    assert result.start_batch == 3
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_init_from_takes_another_runs_weights(reference, tmp_path):
    ref, ref_dir = reference
    cfg = _cfg(pipeline__steps=1, checkpoint__every=0)
    cfg = dataclasses.replace(cfg, init_from=os.path.join(ref_dir, "checkpoints"))
    from streamrl_jax.pipeline import components as build_lib

    c = build_lib.build(cfg)
    got = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(c.learner.state.params))]
    for a, b in zip(got, param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_with_another_mode_is_refused(reference, tmp_path):
    _, ref_dir = reference
    with pytest.raises(ValueError, match="mode: 'stream_async' -> 'stream_sync'"):
        run_lib.run(_cfg(pipeline__mode="stream_sync"), ref_dir, reward_fn=vowel_reward)


def test_sigterm_saves_the_last_boundary_and_the_resume_is_exact(reference, tmp_path):
    ref, _ = reference
    workdir = str(tmp_path)
    consumed = os.path.join(workdir, CONSUMED)

    def terminate_after_two_steps():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(consumed) and len(read_consumed(consumed)) >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=terminate_after_two_steps, daemon=True)
    killer.start()
    stopped = run_lib.run(_cfg(), workdir, reward_fn=vowel_reward)
    killer.join(5)
    assert stopped.stopped and not pipeline_threads()
    assert 2 <= len(stopped.steps) < STEPS and stopped.checkpoints[-1] == len(stopped.steps)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler uninstalled
    result = run_lib.run(_cfg(), workdir, reward_fn=vowel_reward)
    assert result.start_batch == len(stopped.steps) and not result.stopped
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_write_failure_names_the_writer(tmp_path):
    with (
        mock.patch.object(ckpt_lib.Checkpointer, "save", side_effect=OSError("disk full")),
        pytest.raises(run_lib.PipelineError, match="disk full") as info,
    ):
        run_lib.run(_cfg(pipeline__steps=2), str(tmp_path), reward_fn=vowel_reward)
    assert info.value.component == "checkpoint writer"
    assert not pipeline_threads()


@pytest.mark.extended  # the default suite's ~10 min budget; `-m extended` runs it
def test_resume_with_the_critic_is_exact(tmp_path):
    # The critic's TrainState is part of the checkpoint: 2 steps, then a resumed 3rd,
    # equal bit for bit to 3 uninterrupted steps (deterministic micro-batches).
    gae = dict(algorithm__advantage="gae")
    ref = run_lib.run(_cfg(pipeline__steps=3, **gae), str(tmp_path / "ref"), reward_fn=vowel_reward)
    workdir = str(tmp_path / "run")
    run_lib.run(_cfg(pipeline__steps=2, **gae), workdir, reward_fn=vowel_reward)
    resumed = run_lib.run(_cfg(pipeline__steps=3, **gae), workdir, reward_fn=vowel_reward)
    assert resumed.start_batch == 2 and len(resumed.steps) == 1
    for got, want in (
        (resumed.state, ref.state),
        (resumed.target_states["critic"], ref.target_states["critic"]),
    ):
        for a, b in zip(_params_of(got), _params_of(want), strict=True):
            np.testing.assert_array_equal(a, b)
    # A checkpoint written with the critic is not resumed without it.
    with pytest.raises(ValueError, match="critic: True -> False"):
        run_lib.run(_cfg(pipeline__steps=4), workdir, reward_fn=vowel_reward)


def _params_of(state):
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state.params))]


@pytest.mark.extended  # the default suite's ~10 min budget; `-m extended` runs it
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, caplog):
    # Checkpoint 3's state is damaged (a torn write, a bad disk): the run resumes from
    # checkpoint 2, warns naming both, and still ends at the reference parameters.
    ref, ref_dir = reference
    workdir = str(tmp_path)
    run_lib.run(_cfg(pipeline__steps=3), workdir, reward_fn=vowel_reward)
    state = os.path.join(workdir, "checkpoints", "3", "state")
    for folder, _, files in os.walk(state):
        for name in files:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"torn")
    with caplog.at_level("WARNING"):
        result = run_lib.run(_cfg(), workdir, reward_fn=vowel_reward)
    assert result.start_batch == 2
    warned = [r.getMessage() for r in caplog.records if "does not read back" in r.getMessage()]
    assert warned and "checkpoints/3" in warned[0] and "checkpoints/2" in warned[0]
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    assert consumed_log(workdir) == consumed_log(ref_dir)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"pipeline__prompts_per_step": 2}, "prompts_per_step: 4 -> 2"),
        ({"pipeline__staleness": 2}, "staleness: 1 -> 2"),
        ({"data__train_seed": 7}, "data.train_seed: 1 -> 7"),
    ],
)
def test_resume_refuses_another_schedule_or_data_naming_old_and_new(
    reference, tmp_path, override, message
):
    _, ref_dir = reference
    with pytest.raises(ValueError, match=re.escape(message)):
        run_lib.run(_cfg(**override), ref_dir, reward_fn=vowel_reward)


PARTIAL = dict(pipeline__rollout="partial", pipeline__partial_budget_tokens=6, pipeline__max_lag=3)


def test_resume_with_partial_samples_in_flight_is_exact(tmp_path):
    # Partial rollout (rounds of 6 tokens; the tiny model's samples take 3): killed
    # mid-step with paused samples in flight, then resumed twice; the paused samples
    # (tokens, per-token versions and log-probs) come back from the checkpoint and are
    # continued, so the run ends with the uninterrupted run's parameters bit for bit
    # and has trained the same prompts, each once.
    ref_dir, workdir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref, seen = run_recording(_cfg(**PARTIAL), ref_dir)
    assert sum(r["optimizer_steps"] for r in ref.steps) >= 2  # carried groups trained
    # The uninterrupted run as partial rollout promises it (lifecycle_test.py's partial
    # rollout test, -m extended, asserts the same of a run that is not deterministic):
    # rounds of 6 tokens, the tiny model's 16-token samples take 3 rounds (lag 3 =
    # max_lag), so steps 0 and 1 train nothing and later steps train carried groups, every
    # drawn group at most once, every sample whole, its versions within the bound.
    ref_ids = [i for r in read_consumed(os.path.join(ref_dir, CONSUMED)) for i in r["prompt_ids"]]
    drawn = {i for ids in drawn_prompt_ids(_cfg(**PARTIAL), STEPS) for i in ids}
    group_size = _cfg().pipeline.group_size
    assert_partial_rollout_kept_its_bound(ref.steps, ref_ids, drawn, ref.samples, group_size, seen)

    # 1. stopped at the end of step 1: nothing trained yet, every sample in flight. The
    # uninterrupted run's checkpoint 2 and its consumed-prompt log (the resume cuts the
    # log back to the checkpoint's steps) are what that stop leaves.
    ckpt = ckpt_lib.Checkpointer(os.path.join(ref_dir, "checkpoints"))
    carried = ckpt.read_metadata(2)["rollout"]
    os.makedirs(os.path.join(workdir, "checkpoints"))
    shutil.copy(os.path.join(ref_dir, CONSUMED), os.path.join(workdir, CONSUMED))
    os.symlink(ckpt.step_directory(2), os.path.join(workdir, "checkpoints", "2"))
    ckpt.close()
    # Paused into round 2: batch 0's samples after two rounds, batch 1's after one.
    lengths = sorted({len(x["response"]) for x in carried["paused"]})
    assert lengths == [6, 12]
    assert all(len(x["versions"]) == len(x["logprobs"]) for x in carried["paused"])

    # 2. the trainer dies on its 2nd micro-batch after the resume (step 2 or 3).
    with trainer_dies_on_call(2), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(_cfg(**PARTIAL), workdir, reward_fn=vowel_reward)
    assert not pipeline_threads()

    result = run_lib.run(_cfg(**PARTIAL), workdir, reward_fn=vowel_reward)
    assert result.start_batch >= 2
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(workdir)
    ref_steps, ref_counts = consumed_log(ref_dir)
    assert steps == ref_steps == list(range(STEPS))
    assert counts == ref_counts and set(counts.values()) == {1}
