"""The online difficulty curriculum (pipeline/rollouts/curriculum.py), on a fake stream:
the weights (reset by a group with signal, decayed by one without, never below the
floor), the draws (with the weight's probability, the rest passed over), exactly-once
accounting per epoch, and draws that depend only on the steps before g(b), so a
resumed run draws what the first one drew."""

import collections
import os

import numpy as np
import pytest
from support import ListPrompts, group_of_scores, pipeline_threads, rollout_context, tiny_config

from streamrl_jax import pipeline as run_lib
from streamrl_jax.pipeline.resume import CONSUMED, read_consumed
from streamrl_jax.pipeline.rollouts import make_rollout
from streamrl_jax.pipeline.rollouts.curriculum import Curriculum, Weights, accept_draw
from streamrl_jax.rewards.vowels import vowel_reward


def test_weights_decay_to_the_floor_reset_on_signal_and_apply_in_step_order():
    w = Weights(decay=0.5, floor=0.2)
    w.observe(1, [("a", False)])
    w.observe(0, [("a", False), ("b", True)])
    w.upto(1)  # step 0 only
    assert (w.get("a"), w.get("b"), w.get("c")) == (0.5, 1.0, 1.0)
    w.upto(2)
    assert w.get("a") == 0.25
    w.observe(2, [("a", False)])
    w.observe(3, [("a", True)])
    w.upto(3)
    assert w.get("a") == 0.2  # the floor
    w.upto(4)
    assert w.get("a") == 1.0  # a group with signal sets it back


def test_the_saved_weights_reproduce_the_draws_a_resumed_run_makes():
    # A checkpoint at boundary 4 of a run one step stale: the resumed run draws batch 4
    # with the weights as of g(4) = 3, even if the live run had moved further.
    w = Weights(decay=0.5, floor=0.01)
    for step in range(4):
        w.observe(step, [("a", False)])
    w.upto(4)  # the live draws of batch 5 (g = 4) already applied step 3
    saved = w.state(3)
    fresh = Weights(decay=0.5, floor=0.01)
    fresh.restore(saved)
    fresh.upto(3)
    assert fresh.get("a") == 0.125  # steps 0..2
    fresh.upto(4)
    assert fresh.get("a") == w.get("a") == 0.0625


def test_accept_draw_is_a_stable_uniform():
    u = [accept_draw(0, f"p{i}", i) for i in range(2000)]
    assert u == [accept_draw(0, f"p{i}", i) for i in range(2000)]
    assert 0.45 < np.mean(u) < 0.55 and min(u) >= 0.0 and max(u) < 1.0
    assert accept_draw(1, "p0", 0) != accept_draw(0, "p0", 0)


def _curriculum(prompts, **pipeline):
    ctx = rollout_context(
        prompts=prompts,
        **{
            "rollout": "curriculum+full",
            "mode": "stream_sync",
            "group_size": 2,
            "prompts_per_step": 4,
            "min_groups": 4,
            "micro_batch_groups": 4,
            "curriculum_decay": 0.25,
            "curriculum_floor": 0.1,
        }
        | pipeline,
    )
    return ctx, make_rollout(ctx.pipeline.rollout, ctx)


def _step(ctx, ro, b, solved):
    """Batch b drawn, its groups scored (`solved(prompt_id)` -> the group's scores),
    trained and finished; returns (drawn ids, the step's outcome)."""
    drawn = [q.problem.prompt_id for q in ro.draw(b)]
    for g, pid in enumerate(drawn):
        for s in group_of_scores(b, g, solved(pid), pid):
            ro.scored(s)
    trained = [grp[0].sample.tag.prompt_id for gs in ro.micro_batches(b, 0) for grp in gs]
    assert sorted(trained) == sorted(drawn)
    return drawn, ro.finish(b)


def test_each_prompt_is_consumed_once_per_epoch_and_uninformative_ones_drawn_less():
    # 40 prompts; the even ones are always solved (no signal), the odd ones half the time.
    prompts = ListPrompts(size=40)
    ctx, ro = _curriculum(prompts)
    assert isinstance(ro, Curriculum)

    def solved(pid):
        return [1.0, 1.0] if int(pid[1:]) % 2 == 0 else [0.0, 1.0]

    consumed, drawn_in = [], collections.Counter()
    for b in range(30):
        drawn, out = _step(ctx, ro, b, solved)
        consumed += drawn + out.consumed  # trained and passed-over prompts of the step
        drawn_in.update("even" if int(p[1:]) % 2 == 0 else "odd" for p in drawn)
        assert set(out.consumed).isdisjoint(drawn)
        assert out.metrics["curriculum_passed"] == len(out.consumed)
    # Every prompt the pipeline dealt (epoch after epoch, each prompt once per epoch) is
    # consumed exactly once: trained, or passed over at the step of the batch that dealt it.
    dealt = [prompts.ids[j % 40] for j in range(prompts.next)]
    assert prompts.next >= 3 * 40 and collections.Counter(consumed) == collections.Counter(dealt)
    # The first epoch draws everything (weights start at 1); later ones pass the
    # always-solved prompts over most of the time, never below the floor's share.
    assert drawn_in["odd"] > 2 * drawn_in["even"] > 0


def test_a_resumed_curriculum_draws_what_the_first_run_drew():
    def solved(pid):
        return [1.0, 1.0] if int(pid[1:]) % 3 == 0 else [0.0, 1.0]

    prompts = ListPrompts(size=12)
    ctx, ro = _curriculum(prompts, mode="stream_async", staleness=1)
    for b in range(6):
        _step(ctx, ro, b, solved)
    saved, position = ro.state(6), prompts.next
    want = [_step(ctx, ro, b, solved)[0] for b in (6, 7, 8)]
    # A resumed run: the pipeline at batch 6's start, the curriculum from the checkpoint.
    again = ListPrompts(size=12)
    again.next = position
    ctx2, ro2 = _curriculum(again, mode="stream_async", staleness=1)
    assert ro2.restore(6, saved) == []
    assert [_step(ctx2, ro2, b, solved)[0] for b in (6, 7, 8)] == want


@pytest.mark.parametrize("inner", ["full", "dynamic_sampling"])
def test_the_curriculum_wraps_any_kind(inner):
    ctx, ro = _curriculum(ListPrompts(size=8), rollout=f"curriculum+{inner}")
    assert (
        type(ro.inner).__name__
        == {"full": "FullRollout", "dynamic_sampling": "DynamicSampling"}[inner]
    )
    assert ro.plannable(0, 4) is None


# The curriculum's default end-to-end run is the one across processes
# (multicontroller_features_test.py), whose one-process reference is this run over dynamic
# sampling; its consumed log is checked there the same way.
@pytest.mark.extended
def test_a_curriculum_run_consumes_each_prompt_once_per_epoch(tmp_path):
    # End to end on quickstart:tiny: 8 problems, 4 steps of 4 prompts. The vowel reward
    # never marks a sample correct, so every group is all wrong: after the first epoch
    # the curriculum passes prompts over, and consumed.jsonl still lists every prompt
    # the pipeline dealt once per epoch.
    cfg = tiny_config(
        pipeline__rollout="curriculum+full",
        pipeline__steps=4,
        data__train_size=8,
        eval__num_problems=0,
    )
    result = run_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    assert not pipeline_threads()
    rows = read_consumed(os.path.join(tmp_path, CONSUMED))
    assert [r["step"] for r in rows] == list(range(4))
    counts = collections.Counter(p for r in rows for p in r["prompt_ids"])
    epochs = sum(counts.values()) // 8
    assert epochs >= 2 and len(counts) == 8
    assert all(epochs <= n <= epochs + 1 for n in counts.values())
    passed = [row["curriculum_passed"] for row in result.steps]
    assert passed[0] == 0.0 and sum(passed) > 0  # all drawn at first, then passed over
    assert result.steps[-1]["curriculum_down"] > 0
