"""The pipeline end to end on `quickstart:tiny`: four modes, exactness, staleness, failures.

A random tiny model never earns the task reward, so these runs use a dense,
verifiable stand-in (`vowel_reward`: the fraction of vowels in the decoded
response), which differs between samples of a group, so advantages and
parameter updates are non-zero.
"""

import dataclasses
import os
import threading
import time
from unittest import mock

import jax
import numpy as np
import pytest
from support import (
    assert_partial_rollout_kept_its_bound,
    batch_prompt_ids,
    drawn_prompt_ids,
    param_arrays,
    pipeline_threads,
    run_recording,
    tiny_config,
)

from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.generation.engine import Engine
from streamrl_jax.metrics import read_jsonl
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.trainer.step import NonFiniteError, Trainer

_RESULTS = {}


def _run(mode, tmp_path_factory, **overrides):
    key = (mode, tuple(sorted(overrides.items())))
    if key not in _RESULTS:
        cfg = tiny_config(pipeline__mode=mode, **overrides)
        workdir = str(tmp_path_factory.mktemp(mode))
        _RESULTS[key] = (run_lib.run(cfg, workdir, reward_fn=vowel_reward), workdir)
    return _RESULTS[key]


# stream_async's case runs with -m extended (the suite's budget): the default suite's
# stream_async run is `test_stream_async_trains_exactly_s_versions_behind`, and what this
# test reads of a run's metrics is the same code in every mode.
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(m, marks=pytest.mark.extended) if m == "stream_async" else m
        for m in config_lib.MODES
    ],
)
def test_each_mode_runs_two_steps(mode, tmp_path_factory):
    # Colocated mode's programs run on both devices (tensor-parallel decode, FSDP steps):
    # nobody else's, so it decodes one shape (`pipeline.deterministic`) instead of
    # compiling the decode buckets its batches meet; the other modes keep the buckets.
    det = {"pipeline__deterministic": True} if mode == "colocated" else {}
    if mode == "colocated":
        # Trainers of equal statics share their jits (`trainer.step._compile`): a run after
        # another with the same programs compiles nothing. Without JAX's in-memory caches,
        # this run's first micro-batch traces its trainer's steps (checked below).
        jax.clear_caches()
    result, workdir = _run(mode, tmp_path_factory, **det)
    cfg = tiny_config()
    assert len(result.steps) == 2
    assert result.samples == 2 * cfg.pipeline.prompts_per_step * cfg.pipeline.group_size
    assert all(np.isfinite(row["loss"]) for row in result.steps)
    assert set(result.evals) == {0, 2}  # initial and final weights, greedy
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert {r["step"] for r in rows if "reward" in r} == {0, 1}
    # Every value a finding: no NaN placeholders (e.g. the ranker's loss before any refresh).
    assert all(np.isfinite(v) for r in rows for k, v in r.items() if k != "time")
    for r in (r for r in rows if "reward" in r):
        assert 0.0 <= r["gen_busy"] <= 1.0 and 0.0 <= r["train_busy"] <= 1.0
        assert r["stream_wait_s"] >= 0.0 and r["stream_backpressure_s"] >= 0.0
        assert r["optimizer_steps"] == 1.0
        assert 0.0 <= r["compile_s"] <= r["step_s"]  # the trainer thread's, inside the step
        # The step-time breakdown: the trainer's parts sum to the step's wall time.
        parts = [r[f"time/{k}_s"] for k in ("train", "wait", "sync", "compile", "other")]
        assert min(parts) >= 0.0 and sum(parts) == pytest.approx(r["step_s"], rel=1e-6)
        assert r["time/generate_s"] == pytest.approx(r["gen_busy"] * r["step_s"])
    if mode == "colocated":
        step0 = next(r for r in rows if r.get("step") == 0 and "reward" in r)
        assert step0["compile_s"] > 0  # its first micro-batch compiled the trainer's step
    assert os.path.exists(os.path.join(workdir, "trace.json"))
    assert not pipeline_threads()


def test_training_changes_the_parameters(tmp_path_factory):
    result, _ = _run("stream_sync", tmp_path_factory)
    assert all(row["grad_norm"] > 0 for row in result.steps)


def test_stream_sync_equals_disaggregated_batch(tmp_path_factory):
    # Same seeds, same samples (an engine's samples depend only on weights, prompt and
    # seed); streaming changes the micro-batch split and the order of the gradient sum.
    # Tolerance: float32 summation order over 2 steps of Adam, 1e-5 absolute, except that
    # Adam turns the order's rounding on a near-zero gradient (g / (sqrt(v) + eps)) into
    # a step of up to the learning rate: a handful of elements (2 of 3.3M seen) may move
    # further, never more than 2 steps of lr.
    stream, _ = _run("stream_sync", tmp_path_factory)
    batch, _ = _run("disaggregated_batch", tmp_path_factory)
    diff = np.concatenate(
        [
            np.abs(a - b).ravel()
            for a, b in zip(param_arrays(stream), param_arrays(batch), strict=True)
        ]
    )
    assert np.count_nonzero(diff > 1e-5) <= 1e-5 * diff.size, np.sort(diff)[-20:]
    assert diff.max() <= 2 * tiny_config().optimizer.learning_rate
    assert [r["reward"] for r in stream.steps] == [r["reward"] for r in batch.steps]


def test_stream_async_trains_exactly_s_versions_behind(tmp_path_factory):
    # Also PPO mini-batches: 2 optimizer steps per global batch, one published version.
    result, _ = _run(
        "stream_async", tmp_path_factory, pipeline__steps=3, eval__every=1, pipeline__mini_batches=2
    )
    assert [r["optimizer_steps"] for r in result.steps] == [2.0, 2.0, 2.0]
    assert int(jax.device_get(result.state.step)) == 6
    # g(b) = max(0, b - 1): steps 0 and 1 train on W_0, step 2 on W_1.
    assert [sorted(set(v)) for v in result.trained_versions] == [[0], [0], [1]]
    assert result.steps[2]["staleness"] == 1.0
    # Batches 0 and 1 share W_0: one eval per version (0, 1), then the final weights (3).
    assert sorted(result.evals) == [0, 1, 3]
    assert all(e["num_problems"] == 4 for e in result.evals.values())


def test_inflight_records_per_token_versions_within_the_bound(tmp_path):
    # In-flight weight updates: batch b+1 starts as soon as W_b is published, without
    # draining batch b; every token records its version; nothing beyond max_lag trains.
    cfg = tiny_config(
        pipeline__mode="stream_async",
        pipeline__weight_update="inflight",
        pipeline__steps=3,
        eval__num_problems=0,
    )
    result, seen = run_recording(cfg, tmp_path)
    p = cfg.pipeline
    assert result.samples == 3 * p.prompts_per_step * p.group_size
    assert len(seen) == result.samples
    for s in seen:
        v, b = s.versions(), s.tag.batch
        assert s.token_versions is not None and len(v) == s.num_tokens
        assert np.all(np.diff(v) >= 0)  # a slot only ever moves to newer weights
        # Submitted with W_{b-1} (W_0 for b = 0); no token newer than W_b (published
        # only after step b trained the whole batch): lag b - oldest <= max_lag = s = 1.
        assert v[0] == max(0, b - 1) and v[-1] <= b
    assert all(r["lag_max"] <= 1.0 and r["dropped_stale"] == 0.0 for r in result.steps)
    assert min(r["mixed_versions"] for r in result.steps) >= 0.0
    assert not pipeline_threads()


# -m extended (the suite's budget): the default suite's partial rollout end to end is
# resume_test.py's `test_resume_with_partial_samples_in_flight_is_exact`, whose
# uninterrupted run (the same rounds, deterministic) asserts what this test does.
@pytest.mark.extended
@pytest.mark.parametrize("weight_update", ["boundary", "inflight"])
def test_partial_rollout_trains_every_group_once_within_the_bound(weight_update, tmp_path):
    # Rounds of 6 tokens: the tiny model's 16-token samples take 3 rounds (lag 3 =
    # max_lag), so steps 0 and 1 train nothing and later steps train carried groups.
    cfg = tiny_config(
        pipeline__mode="stream_async",
        pipeline__weight_update=weight_update,
        pipeline__rollout="partial",
        pipeline__partial_budget_tokens=6,
        pipeline__max_lag=3,
        pipeline__steps=4,
        eval__num_problems=0,
    )
    result, seen = run_recording(cfg, tmp_path)
    consumed = read_jsonl(os.path.join(str(tmp_path), "consumed.jsonl"))
    ids = [i for r in consumed for i in r["prompt_ids"]]
    drawn = {i for ids in drawn_prompt_ids(cfg, 4) for i in ids}
    g = cfg.pipeline.group_size
    assert_partial_rollout_kept_its_bound(result.steps, ids, drawn, result.samples, g, seen)
    assert not pipeline_threads()


def _assert_fails_fast(cfg, tmp_path, component, patch=None, reward=vowel_reward):
    with pytest.raises(Exception) as info:
        if patch is None:
            run_lib.run(cfg, str(tmp_path), reward_fn=reward)
        else:
            with patch:
                run_lib.run(cfg, str(tmp_path), reward_fn=reward)
    # Fast: the failure itself ended the run (through the failure latch), not a wait that
    # ran into the stall bound (`pipeline.timeout_s`: a `MailboxTimeout` "timed out after
    # ...", shown in a `PipelineError`); checked by the error's kind, not a wall clock
    err = info.value
    assert not isinstance(err, TimeoutError), err
    assert "Timeout" not in str(err) and "timed out" not in str(err), err
    assert not pipeline_threads()
    return err


def test_reward_failure_ends_the_run_naming_it(tmp_path):
    def broken(text, metadata):
        raise ValueError("reward exploded")

    err = _assert_fails_fast(tiny_config(eval__num_problems=0), tmp_path, "reward", reward=broken)
    assert isinstance(err, run_lib.PipelineError) and err.component == "reward function"
    assert "reward exploded" in str(err)


def test_engine_failure_ends_the_run_naming_it(tmp_path):
    patch = mock.patch.object(Engine, "step", side_effect=RuntimeError("engine exploded"))
    err = _assert_fails_fast(tiny_config(eval__num_problems=0), tmp_path, "engine", patch=patch)
    assert isinstance(err, run_lib.PipelineError) and err.component == "generation service"
    assert "engine exploded" in str(err)


# -m extended (the suite's budget): the default suite's trainer failure ending a run fast
# is resume_test.py's `test_resume_with_partial_samples_in_flight_is_exact` (its trainer
# dies mid-run: that error, no thread left) and learners_test.py's first-to-fail test.
@pytest.mark.extended
def test_trainer_failure_ends_the_run(tmp_path):
    patch = mock.patch.object(Trainer, "accumulate", side_effect=RuntimeError("trainer exploded"))
    err = _assert_fails_fast(tiny_config(eval__num_problems=0), tmp_path, "trainer", patch=patch)
    assert "trainer exploded" in str(err)


def test_nonfinite_skip_counts_and_watchdog_reports_a_stall(tmp_path):
    # Batch 0's rewards are NaN: its update is skipped and counted, batch 1 trains.
    # One reward call sleeps past pipeline.watchdog_s: the watchdog names the stage.
    slept = threading.Event()
    cfg = tiny_config(eval__num_problems=0, pipeline__watchdog_s=0.5, pipeline__nonfinite="skip")
    batch0 = set(batch_prompt_ids(cfg, 0))

    def reward(text, metadata):
        if metadata["prompt_id"] in batch0 and not slept.is_set():
            slept.set()
            time.sleep(2.0)
        r = vowel_reward(text, metadata)
        return (
            r
            if metadata["prompt_id"] not in batch0
            else RewardResult(
                score=float("nan"), correct=False, extracted_answer=None, format_ok=True
            )
        )

    result = run_lib.run(cfg, str(tmp_path), reward_fn=reward)
    assert [r["nonfinite"] for r in result.steps] == [1.0, 0.0]
    assert result.steps[-1]["watchdog_alerts"] >= 1
    assert int(jax.device_get(result.state.step)) == 1  # the skipped update did not count


def test_nonfinite_stop_ends_the_run_naming_the_step(tmp_path):
    def nan_reward(text, metadata):
        return RewardResult(
            score=float("nan"), correct=False, extracted_answer=None, format_ok=True
        )

    cfg = tiny_config(eval__num_problems=0, pipeline__nonfinite="stop")
    err = _assert_fails_fast(cfg, tmp_path, "trainer", reward=nan_reward)
    assert isinstance(err, NonFiniteError) and "step 0" in str(err)


def test_a_bad_registry_name_fails_before_anything_is_built(tmp_path):
    # A config made in code (not through from_config_dict) is validated by run() too.
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, advantage="gea"))
    built = mock.patch("streamrl_jax.pipeline.lifecycle.build", side_effect=AssertionError)
    with built, pytest.raises(ValueError, match="algorithm.advantage='gea'; expected one of"):
        run_lib.run(cfg, str(tmp_path))
