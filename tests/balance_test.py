"""Tests of Algorithm 1 and the elastic rule (scheduling/balance.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from streamrl_jax.scheduling import balance, lengths
from streamrl_podplan.simulation import hardware, scoring, simulator, stages
from streamrl_podplan.simulation.scenario import Scenario


def test_single_pool_balances_the_stages():
    # max(100/x, 300/y) over x + y <= 8 is 50 at (2, 6); (1, 7) gives 100, (3, 5) gives 60.
    best, cands = balance.split_single_pool(8, lambda x: 100 / x, lambda y: 300 / y)
    assert (best.gen_devices, best.train_devices) == (2, 6)
    assert best.step_time == pytest.approx(50)
    assert len(cands) == sum(8 - x for x in range(1, 8))


def test_single_pool_respects_instance_size_and_infeasible_training():
    # x in {2, 4, 6, 8}; y < 4 cannot hold the training state.
    def p_train(y):
        return math.inf if y < 4 else 240 / y

    best, _ = balance.split_single_pool(10, lambda x: 120 / x, p_train, gen_unit=2)
    assert (best.gen_devices, best.train_devices) == (4, 6)  # max(30, 40)
    with pytest.raises(ValueError, match="no split"):
        balance.split_single_pool(4, lambda x: 1.0, p_train, gen_unit=2)


def test_single_pool_frees_devices_a_saturated_stage_cannot_use():
    best, _ = balance.split_single_pool(
        16, lambda x: max(10.0, 40 / x), lambda y: max(10.0, 80 / y)
    )
    assert (best.gen_devices, best.train_devices, best.freed) == (4, 8, 4)


@pytest.mark.parametrize(
    "p_gen, p_train, want",
    [
        (lambda x: 80 / x, lambda y: 40 / y, (8, 4, 0)),  # balanced: nothing to shrink
        (lambda x: 40 / x, lambda y: 40 / y, (4, 4, 4)),  # generation faster: 4 gen freed
        (lambda x: 80 / x, lambda y: 10 / y, (8, 1, 3)),  # training faster: 3 train freed
        (lambda x: 30 / x, lambda y: 40 / y, (3, 4, 5)),  # 30/3 = 10 = T_train: not above it
    ],
)
def test_two_pools_shrink_the_faster_stage(p_gen, p_train, want):
    s = balance.shrink_two_pools(8, 4, p_gen, p_train)
    assert (s.gen_devices, s.train_devices, s.freed) == want
    assert s.step_time == pytest.approx(max(p_gen(8), p_train(4)))


def test_single_pool_on_the_simulator_cost_model_matches_its_own_split():
    sc = Scenario(
        mode="stream_sync",
        model=hardware.get_model("qwen2.5-7b"),
        hw=hardware.get_hardware("h100"),
        devices=16,
        trace=lengths.paper_trace(5_000),
        global_batch=128,
    )
    costs = simulator.roofline_costs(sc)
    batches, history, _ = simulator.draw_batches(sc)
    probe = stages.ProbeBatch(*batches[0], history, simulator.plan_kwargs(sc))
    p_gen, p_train = stages.simulator_profiles(costs, sc.tp, probe)
    ours, _ = balance.split_single_pool(16, p_gen, p_train, gen_unit=sc.tp)
    theirs, _ = stages.choose_split(costs, 16, sc.granularity, sc.tp, probe)
    assert ours.step_time == pytest.approx(max(theirs.t_gen, theirs.t_train))


def test_table_profile():
    p = balance.table_profile([2, 4], [10.0, 6.0])
    assert p(1) == math.inf and p(2) == 10.0 and p(4) == 6.0
    assert p(8) == pytest.approx(3.0)  # beyond the table: time ~ 1 / devices
    assert 6.0 < p(3) < 10.0


def test_elastic_rule_fires_exactly_when_delta_reaches_delta_prime():
    ctl = balance.ElasticController(2, 4)  # ideal saving: delta' = t_gen / 3
    assert not ctl.observe(0, t_gen=9.0, t_train=6.01).add  # delta 2.99 < 3
    assert ctl.instances == 2
    d = ctl.observe(1, t_gen=9.0, t_train=6.0)  # delta 3 == delta' 3
    assert d.add and d.delta == pytest.approx(d.delta_prime) and ctl.instances == 3
    assert not ctl.observe(2, t_gen=5.0, t_train=9.0).add  # generation ahead: delta < 0
    assert ctl.observe(3, t_gen=100.0, t_train=1.0).add
    last = ctl.observe(4, t_gen=100.0, t_train=1.0)
    assert not last.add and last.reason == "no reserved instance left" and ctl.instances == 4
    assert [d.step for d in ctl.log] == [0, 1, 2, 3, 4]
    flat = balance.ElasticController(1, 4, saving=lambda _k, _t: 0.0)
    assert not flat.observe(0, t_gen=10.0, t_train=1.0).add  # nothing to gain: never add


def test_elastic_rule_on_growing_lengths_with_a_profile_saving():
    """Output lengths grow 15 % a step; generation work W / k (+ a fixed 2 s) against a
    20 s trainer. Every decision adds exactly when delta >= delta' and instances remain."""
    p_inst = balance.table_profile([1, 2, 4, 8], [8.0, 4.4, 2.6, 1.7])  # sub-linear scaling
    ctl = balance.ElasticController(1, 6, balance.profile_saving(p_inst))
    work = 15.0
    for step in range(20):
        t_gen = work * p_inst(ctl.instances) / p_inst(1) + 2.0
        ctl.observe(step, t_gen, 20.0)
        work *= 1.15
    for d in ctl.log:
        assert d.add == (d.delta >= d.delta_prime > 0 and d.instances < 6), d
    counts = [d.instances for d in ctl.log]
    assert counts[0] == 1 and counts[-1] > 1 and np.all(np.diff(counts) >= 0)


def test_elastic_validation():
    with pytest.raises(ValueError, match="max_instances"):
        balance.ElasticController(3, 2)


def test_three_stages_balance_generation_scoring_and_training():
    # max(100/x, 200/z, 300/y) with x + z + y <= 12: all three at 50 on (2, 4, 6).
    best, cands = balance.split_three_stages(
        12, lambda x: 100 / x, lambda z: 200 / z, lambda y: 300 / y
    )
    assert (best.gen_devices, best.score_devices, best.train_devices) == (2, 4, 6)
    assert best.step_time == pytest.approx(50) and best.freed == 0
    assert len(cands) == sum(12 - x - z for x in range(1, 12) for z in range(1, 12 - x))
    # A free scorer takes one device; the other two split the rest as Algorithm 1 does.
    free, _ = balance.split_three_stages(9, lambda x: 100 / x, lambda z: 0.0, lambda y: 300 / y)
    two, _ = balance.split_single_pool(8, lambda x: 100 / x, lambda y: 300 / y)
    assert free.score_devices == 1
    assert (free.gen_devices, free.train_devices) == (two.gen_devices, two.train_devices)
    assert free.bottleneck in ("generation", "training")


def test_three_stages_name_a_scoring_bottleneck_and_infeasible_pools():
    slow, _ = balance.split_three_stages(
        6, lambda x: 10 / x, lambda z: 400 / z, lambda y: 10 / y, score_unit=2
    )
    assert slow.score_devices == 4 and slow.bottleneck == "scoring"
    with pytest.raises(ValueError, match="no split"):
        balance.split_three_stages(3, lambda x: 1.0, lambda z: math.inf, lambda y: 1.0)


def test_three_stages_rebalanced_from_one_steps_seconds():
    # A run's measured seconds at its sizes, each stage as ideal data parallelism: from
    # 2 / 1 / 1 devices at 10 / 40 / 10 s, 1 / 2 / 1 gives max(20, 20, 10) = 20 s (half
    # the step): a generation device goes to the scorer.
    split = balance.rebalance_three_stages((2, 1, 1), (10.0, 40.0, 10.0))
    assert (split.gen_devices, split.score_devices, split.train_devices) == (1, 2, 1)
    assert split.step_time == pytest.approx(20.0) and split.bottleneck != "training"
    # Balanced already: the current split is its own answer (its prediction the measured).
    same = balance.rebalance_three_stages((2, 2, 4), (10.0, 10.0, 10.0), units=(2, 2, 1))
    assert (same.gen_devices, same.score_devices, same.train_devices) == (2, 2, 4)
    assert same.step_time == pytest.approx(10.0)
    with pytest.raises(ValueError, match="scoring has 3 devices in units of 2"):
        balance.rebalance_three_stages((2, 3, 1), (1.0, 1.0, 1.0), units=(1, 2, 1))


def test_a_scorer_on_the_trainer_or_as_a_stage_never_beats_no_scorer():
    # 7B on 24 H100 at 5K: the scorer's forward (a PRM of the policy's size) over the
    # probe batch, by hand; either placement costs at least the two-stage step, and the
    # stage's split holds all three stages within the pod. On 16 (two nodes) there is no
    # room for a stage of its own: the scorer goes on the trainer.
    sc = Scenario(
        mode="stream_async",
        model=hardware.get_model("qwen2.5-7b"),
        hw=hardware.get_hardware("h100"),
        devices=24,
        trace=lengths.paper_trace(5_000),
        global_batch=128,
        iterations=1,
        warmup=0,
    )
    plan = scoring.three_stage_plan(sc, forwards=2)
    prompt, resp = simulator.draw_batches(sc)[0][0]
    tokens = (prompt + resp).astype(np.float64)
    flops = 2 * float(sc.model.forward_flops(tokens, tokens / 2).sum())
    s = plan.stage
    want = flops / (s.score_devices * sc.hw.peak_flops * sc.params.train_mfu)
    assert s.t_score == pytest.approx(want)
    assert s.gen_devices + s.score_devices + s.train_devices <= 24
    assert plan.on_trainer[2] >= plan.two.step_time - 1e-9
    assert s.step_time >= plan.two.step_time - 1e-9
    assert plan.row()["best"] in ("stage", "on_trainer")
    small = scoring.three_stage_plan(dataclasses.replace(sc, devices=16))
    assert small.stage is None and small.row()["best"] == "on_trainer"
