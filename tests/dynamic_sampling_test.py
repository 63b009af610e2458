"""DAPO dynamic sampling (pipeline/rollouts/dynamic_sampling.py): as a unit on a fake
stream (judge, refill, take, finish), then end to end on `quickstart:tiny`: uniform
groups are skipped, counted and replaced, the version contract holds, and resume stays
exact.

The end-to-end reward gives every sample of a third of the prompts (by a hash of the
prompt id) the same score (a group without variance) and the vowel fraction to the rest.
"""

import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
import zlib
from unittest import mock

import numpy as np
import pytest
from support import (
    consumed_log,
    group_of_scores,
    param_arrays,
    pipeline_threads,
    rollout_context,
    tiny_config,
    trainer_dies_on_call,
)

from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.metrics import read_jsonl
from streamrl_jax.pipeline import micro_batches
from streamrl_jax.pipeline.resume import CONSUMED, read_consumed
from streamrl_jax.pipeline.rollouts.dynamic_sampling import DynamicSampling
from streamrl_jax.rewards.vowels import vowel_reward


def uniform(prompt_id: str) -> bool:
    return zlib.crc32(prompt_id.encode()) % 3 == 0


def some_uniform_reward(text, metadata):
    if uniform(metadata["prompt_id"]):
        r = vowel_reward("", metadata)
        return r.__class__(score=0.5, correct=False, extracted_answer=None, format_ok=True)
    return vowel_reward(text, metadata)


def _cfg(**overrides):
    base = dict(
        pipeline__steps=3,
        pipeline__rollout="dynamic_sampling",
        eval__num_problems=0,
    )
    return tiny_config(**(base | overrides))


def _trained_groups():
    """Patches pack_groups to record (batch, prompt id, rewards) of every trained group."""
    seen, real = [], micro_batches.pack_groups

    def pack(step, groups, **kwargs):
        for g in groups:
            tag = g[0].sample.tag
            seen.append((tag.batch, tag.prompt_id, [s.reward.score for s in g]))
        return real(step, groups, **kwargs)

    return seen, mock.patch.object(micro_batches, "pack_groups", pack)


# ------------------------------------------------------------------ on a fake stream


def _unit(**pipeline):
    ctx = rollout_context(
        **{
            "rollout": "dynamic_sampling",
            "group_size": 2,
            "prompts_per_step": 3,
            "min_groups": 1,
            "micro_batch_groups": 2,
            "dynamic_sampling_max_draws": 4,
        }
        | pipeline
    )
    return ctx, DynamicSampling(ctx)


def _score(ro, batch, group, scores, prompt_id):
    for s in group_of_scores(batch, group, scores, prompt_id):
        ro.scored(s)


def test_uniform_groups_are_judged_refilled_and_skipped():
    ctx, ro = _unit()
    prompts = ro.draw(0)  # groups 0..2: p0, p1, p2
    assert [q.problem.prompt_id for q in prompts] == ["p0", "p1", "p2"]
    submitted = []

    def submit(more, first):
        submitted.append((first, [q.problem.prompt_id for q in more]))
        # The refills are judged as they come: p3 uniform again, p4 informative.
        for i, q in enumerate(more):
            scores = [0.0, 1.0] if q.problem.prompt_id == "p4" else [1.0, 1.0]
            _score(ro, 0, first + i, scores, q.problem.prompt_id)

    _score(ro, 0, 0, [0.0, 1.0], "p0")  # informative: into the stream
    _score(ro, 0, 1, [1.0, 1.0], "p1")  # all right: skipped
    _score(ro, 0, 2, [0.0, 0.0], "p2")  # all wrong: skipped
    assert ctx.stream.depth()["ready_groups"] == 1
    ro.settle(0, submit, lambda: False)
    # Two missing -> two drawn (p3, p4: groups 3, 4); one still missing -> p5, then p6,
    # the last of the 4 draws.
    assert submitted == [(3, ["p3", "p4"]), (5, ["p5"]), (6, ["p6"])]
    out = ro.outcome(0)
    assert out.informative == [0, 4] and out.skipped == [1, 2, 3, 5, 6] and out.draws == 4
    taken = [g[0].sample.tag.group for groups in ro.micro_batches(0, 0) for g in groups]
    assert sorted(taken) == [0, 4]
    finished = ro.finish(0)
    assert finished.metrics == {"groups_skipped": 5.0, "dynamic_draws": 4.0, "dynamic_short": 1.0}
    assert finished.consumed == ["p1", "p2", "p3", "p5", "p6"]  # skipped: consumed too
    assert ro.plannable(0, 3) is None and ro.state(1) == {} and ro.restore(1, {}) == []


def test_the_trainer_streams_informative_groups_before_the_batch_settles():
    ctx, ro = _unit(dynamic_sampling_max_draws=0)
    ro.draw(0)
    got = []
    thread = threading.Thread(target=lambda: got.extend(ro.micro_batches(0, 0)))
    thread.start()
    _score(ro, 0, 1, [0.0, 1.0], "p1")  # streamed at once (min_groups = 1)
    _score(ro, 0, 0, [1.0, 1.0], "p0")
    _score(ro, 0, 2, [0.0, 0.0], "p2")
    ro.settle(0, lambda more, first: pytest.fail("no draws left"), lambda: False)
    thread.join(5)
    assert [[g[0].sample.tag.group for g in groups] for groups in got] == [[1]]


def test_a_failure_ends_the_refill_wait_and_a_stall_is_named():
    ctx, ro = _unit(timeout_s=0.3)
    ro.draw(0)
    with pytest.raises(TimeoutError, match=r"batch 0: 0 of 3 groups judged"):
        ro.settle(0, lambda more, first: None, lambda: False)
    ctx.latch.fail("reward function", RuntimeError("boom"))
    ro.settle(0, lambda more, first: None, lambda: False)  # returns: the run failed


class MemoryVerdicts:
    """The run's verdicts in memory (`rollouts.Verdicts`; across processes they live in
    the coordination service, `processes/verdicts.py`)."""

    def __init__(self):
        self.values, self.drawn, self.cv = {}, {}, threading.Condition()

    def publish(self, batch, group, informative, prompt_id):
        with self.cv:
            self.values[(batch, group)] = (informative, prompt_id)
            self.cv.notify_all()

    def read(self, batch):
        with self.cv:
            return {g: v for (b, g), v in self.values.items() if b == batch}

    def wait(self, batch, group, timeout_s):
        with self.cv:
            self.cv.wait_for(lambda: (batch, group) in self.values, timeout_s)

    def forget(self, batch):
        with self.cv:
            self.values = {k: v for k, v in self.values.items() if k[0] != batch}

    def settled(self, batch, draws):
        self.drawn[batch] = draws


# Group -> scores: p0 and p4 vary (informative), every other prompt's group is uniform.
_SCORES = {"p0": [0.0, 1.0], "p4": [0.0, 1.0]}


def test_generation_processes_and_trainers_decide_the_same_rounds_from_shared_verdicts():
    # Two generation processes, each judging the groups it owns (even / odd indices),
    # and a training process: every one decides batch 0's refill rounds from all the
    # published verdicts, so all draw the same prompts (those of the one-process unit
    # test above), and the trainer takes the informative groups, consumes the others.
    board, submitted = MemoryVerdicts(), {0: [], 1: []}
    pipeline = dict(where="generator", verdicts=board)

    def generator(k):
        ctx, _ = _unit()
        scored = {}

        def score(sample):
            future = concurrent.futures.Future()
            future.set_result(scored.pop(sample.request_id))
            return future

        ro = DynamicSampling(dataclasses.replace(ctx, **pipeline, score=score))

        def submit(prompts, first):
            submitted[k].append((first, [q.problem.prompt_id for q in prompts]))
            judge(prompts, first)

        def judge(prompts, first):
            for i, q in enumerate(prompts):
                pid = q.problem.prompt_id
                if (first + i) % 2 == k:  # this process's share
                    for s in group_of_scores(0, first + i, _SCORES.get(pid, [1.0, 1.0]), pid):
                        scored[s.sample.request_id] = s
                        ro.returned(s.sample)

        judge(ro.draw(0), 0)
        return threading.Thread(target=ro.settle, args=(0, submit, lambda: False))

    threads = [generator(0), generator(1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    rounds = [(3, ["p3", "p4"]), (5, ["p5"]), (6, ["p6"])]
    assert submitted == {0: rounds, 1: rounds}
    assert board.read(0) == {g: (g in (0, 4), f"p{g}") for g in range(7)}

    ctx, _ = _unit()
    trainer = DynamicSampling(dataclasses.replace(ctx, where="trainer", verdicts=board))
    ctx.prompts.draw(0, 3)  # the step's start draws the originals (TrainingLink)
    for g in (0, 1, 4):  # what it received so far (the rest of its groups may come later)
        _score(trainer, 0, g, _SCORES.get(f"p{g}", [1.0, 1.0]), f"p{g}")
    taken = [g[0].sample.tag.group for groups in trainer.micro_batches(0, 0) for g in groups]
    assert sorted(taken) == [0, 4] and ctx.prompts.drawn[0] == [f"p{i}" for i in range(7)]
    finished = trainer.finish(0)
    assert finished.consumed == ["p1", "p2", "p3", "p5", "p6"]
    assert finished.metrics["dynamic_draws"] == 4.0 and board.drawn == {0: 4}

    # A trainer whose own judgment contradicts the published verdict fails, naming it.
    ctx, _ = _unit()
    trainer = DynamicSampling(dataclasses.replace(ctx, where="trainer", verdicts=board))
    ctx.prompts.draw(1, 3)
    board.publish(1, 1, False, "p1")
    with pytest.raises(RuntimeError, match="batch 1 group 1: this process judged it informative"):
        _score(trainer, 1, 1, [0.0, 1.0], "p1")  # before it read the board: checked there
        list(itertools.islice(trainer.micro_batches(1, 0), 1))


def test_under_a_judge_the_trainers_publish_the_verdicts_the_generation_process_reads():
    # With a judge in the reward only the training side knows which groups vary: the
    # trainer judges the groups it receives and publishes the verdicts, the generation
    # process (which holds no judge, so scores nothing) decides its refill rounds from
    # them: the same rounds as above.
    board, submitted = MemoryVerdicts(), []
    ctx, _ = _unit()
    trainer = DynamicSampling(
        dataclasses.replace(ctx, where="trainer", verdicts=board, trainers_judge=True)
    )
    ctx.prompts.draw(0, 3)  # the step's start draws the originals (TrainingLink)
    gctx, _ = _unit()
    generator = DynamicSampling(
        dataclasses.replace(gctx, where="generator", verdicts=board, trainers_judge=True)
    )
    for s in group_of_scores(0, 0, [0.0, 1.0], "p0"):
        assert generator.returned(s.sample).sample is s.sample  # (nothing scored here)
    generator.draw(0)
    thread = threading.Thread(
        target=generator.settle,
        args=(0, lambda prompts, first: submitted.append(first), lambda: False),
    )
    thread.start()
    for groups, rounds in (((0, 1, 2), 1), ((3, 4), 2), ((5,), 3), ((6,), 3)):
        for g in groups:
            _score(trainer, 0, g, _SCORES.get(f"p{g}", [1.0, 1.0]), f"p{g}")
        deadline = time.monotonic() + 10
        while len(submitted) < rounds and time.monotonic() < deadline:
            time.sleep(0.01)
    thread.join(10)
    assert submitted == [3, 5, 6] and not thread.is_alive()
    assert board.read(0) == {g: (g in (0, 4), f"p{g}") for g in range(7)}
    taken = [g[0].sample.tag.group for groups in trainer.micro_batches(0, 0) for g in groups]
    assert sorted(taken) == [0, 4]
    assert trainer.finish(0).consumed == ["p1", "p2", "p3", "p5", "p6"]


def test_a_refill_generated_for_another_prompt_than_the_trainer_drew_is_named():
    # The trainer checks each refill group against the prompt its own mirror of the
    # round drew (the prompts as the rollout drew them: a curriculum's passed-over ones
    # are not among them), whichever comes first, the group or the mirror.
    board = MemoryVerdicts()
    ctx, _ = _unit()
    trainer = DynamicSampling(dataclasses.replace(ctx, where="trainer", verdicts=board))
    ctx.prompts.draw(0, 3)
    for g in range(3):  # every original uniform: a round of 3 (p3, p4, p5)
        board.publish(0, g, False, f"p{g}")
    board.publish(0, 3, False, "elsewhere")  # generated for another prompt than p3
    with pytest.raises(RuntimeError, match="batch 0 group 3: generated for prompt elsewhere, "):
        list(itertools.islice(trainer.micro_batches(0, 0), 1))
    ctx, _ = _unit(timeout_s=1.0)
    trainer = DynamicSampling(dataclasses.replace(ctx, where="trainer", verdicts=board))
    ctx.prompts.draw(1, 3)
    for g in range(3):
        board.publish(1, g, False, f"p{g}")
    with pytest.raises(TimeoutError, match="batch 1"):  # mirrors the round, then waits
        list(itertools.islice(trainer.micro_batches(1, 0), 1))
    assert ctx.prompts.drawn[1] == [f"p{i}" for i in range(6)]
    with pytest.raises(RuntimeError, match="batch 1 group 4: generated for prompt p9, the "):
        _score(trainer, 1, 4, [1.0, 1.0], "p9")


# One end-to-end mode by default (the policy's parts run as units above); the others are
# extended (`-m extended`: the suite's 8-minute budget).
_SLOW = {"colocated", "disaggregated_batch", "stream_sync"}


@pytest.mark.parametrize(
    "mode",
    [pytest.param(m, marks=pytest.mark.extended) if m in _SLOW else m for m in config_lib.MODES],
)
def test_uniform_groups_are_skipped_counted_and_replaced(mode, tmp_path):
    cfg = _cfg(pipeline__mode=mode)
    p = cfg.pipeline
    seen, patch = _trained_groups()
    with patch:
        result = run_lib.run(cfg, str(tmp_path), reward_fn=some_uniform_reward)
    assert not pipeline_threads()
    rows = [r for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "reward" in r]
    consumed = [r["prompt_ids"] for r in read_consumed(os.path.join(tmp_path, CONSUMED))]
    assert len(rows) == len(consumed) == p.steps
    skipped_total = 0
    for b, (row, ids) in enumerate(zip(rows, consumed, strict=True)):
        trained = [pid for batch, pid, _ in seen if batch == b]
        # The batch stays full: prompts_per_step informative groups (the draws suffice).
        assert row["dynamic_short"] == 0.0
        assert len(trained) == p.prompts_per_step
        assert row["samples"] == p.prompts_per_step * p.group_size
        # Every consumed prompt was either trained or skipped, once; the skipped ones
        # are replaced by as many draws.
        assert len(ids) == len(set(ids)) == p.prompts_per_step + row["dynamic_draws"]
        assert row["groups_skipped"] == row["dynamic_draws"] == len(ids) - len(trained)
        assert set(trained) <= set(ids)
        # The rigged prompts are all skipped (others only if their rewards tie).
        assert {pid for pid in ids if uniform(pid)} <= set(ids) - set(trained)
        skipped_total += row["groups_skipped"]
    # Skipped groups never reach the trainer; every trained one has reward variance.
    assert all(not uniform(pid) and np.ptp(r) > 0 for _, pid, r in seen)
    assert skipped_total > 0  # the rig bit
    # DESIGN.md §2: every trained sample was generated with W_g(b), refills included.
    s = p.staleness if mode == "stream_async" else 0
    for b, versions in enumerate(result.trained_versions):
        assert set(versions) == {max(0, b - s)}, (b, versions)


@pytest.mark.extended  # the unit test above covers a batch whose draws run out
def test_draws_run_out_the_step_trains_what_it_has(tmp_path):
    cfg = _cfg(pipeline__mode="stream_sync", pipeline__dynamic_sampling_max_draws=0)
    seen, patch = _trained_groups()
    with patch:
        result = run_lib.run(cfg, str(tmp_path), reward_fn=some_uniform_reward)
    n = cfg.pipeline.prompts_per_step
    for b, row in enumerate(result.steps):
        trained = sum(1 for batch, *_ in seen if batch == b)
        assert row["groups_skipped"] == n - trained and row["dynamic_draws"] == 0
        assert row["dynamic_short"] == float(trained < n)
        assert row["samples"] == trained * cfg.pipeline.group_size
    assert any(row["dynamic_short"] for row in result.steps)


# An extra case of bitwise resume (its default end-to-end run is resume_test's): what
# dynamic sampling adds to a resume runs as units above (a skipped prompt is consumed,
# the rollout keeps no state of its own: a resumed run draws and judges a batch again).
@pytest.mark.extended  # three runs of 4 steps
def test_resume_is_exact_and_consumes_each_prompt_once(tmp_path):
    # The resume_test pattern, stream_async deterministic, a checkpoint every step: one
    # uninterrupted reference, one run whose trainer dies in batch 2 and is resumed.
    cfg = _cfg(
        pipeline__mode="stream_async",
        pipeline__steps=4,
        pipeline__deterministic=True,
        checkpoint__every=1,
        checkpoint__keep=10,
    )
    ref_dir, workdir = str(tmp_path / "reference"), str(tmp_path / "resumed")
    ref = run_lib.run(cfg, ref_dir, reward_fn=some_uniform_reward)
    # Micro-batches of 2 groups: calls 1-2 are batch 0, 3-4 batch 1, 5 is batch 2's first.
    with trainer_dies_on_call(5), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(cfg, workdir, reward_fn=some_uniform_reward)
    assert not pipeline_threads()
    result = run_lib.run(cfg, workdir, reward_fn=some_uniform_reward)
    assert result.start_batch == 2
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(workdir)
    ref_steps, ref_counts = consumed_log(ref_dir)
    assert steps == ref_steps == list(range(4))
    assert counts == ref_counts and set(counts.values()) == {1}
    skipped = sum(r["groups_skipped"] for r in ref.steps)
    assert sum(counts.values()) == 4 * cfg.pipeline.prompts_per_step + skipped > 16
    assert [r["groups_skipped"] for r in result.steps] == [
        r["groups_skipped"] for r in ref.steps[2:]
    ]
