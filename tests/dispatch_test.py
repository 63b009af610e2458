"""Tests of the skew-aware dispatch (scheduling/dispatch.py): Algorithm 2 and LPT admission."""

from __future__ import annotations

import numpy as np
import pytest
from support import make_engine

from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.scheduling import dispatch

# The paper's measured 7B decode curve (H800), ms per token at batch size BS: flat to
# ~32, then about linear.
PAPER_PTL_7B = {1: 8.3, 2: 8.7, 4: 8.9, 8: 9.0, 16: 9.4, 32: 10.2, 64: 11.7, 128: 15.2}
PAPER = dispatch.PTLProfile(tuple(PAPER_PTL_7B), tuple(v / 1e3 for v in PAPER_PTL_7B.values()))


def fig6_lengths() -> np.ndarray:
    """The paper's Fig. 6: 2 long samples among 64 regular ones."""
    return np.array([2000, 2000] + [200] * 64)


def test_fig6_one_instance_gets_both_long_samples():
    true = fig6_lengths()
    d = dispatch.SkewAwareDispatcher(lambda _p: true.astype(float), PAPER)
    d.observe(np.tile(true, 3))
    plan = d.plan([[1]] * len(true), 2, [64, 64])
    assert plan.instance_per_request[0] == plan.instance_per_request[1]
    assert plan.long_instances == (plan.instance_per_request[0],)
    # The long instance admits the two long samples first (LPT).
    orders = plan.orders(2)
    assert orders[plan.long_instances[0]][:2] == [0, 1]
    assert sorted(i for o in orders for i in o) == list(range(len(true)))


def sum_vs_max_case(objective: str) -> dispatch.DispatchPlan:
    """40 prompts, 4 instances, PTL(BS) = BS s, caps 64 (one wave), L_long = 3, L_reg = 2.

    n_long = 8, n_reg = 32. Latency of a group = ceil(M / k) * ceil(M / k) ... per instance
    PTL(per) * L * 1 = per * L:
      k=1: long 8*3 = 24, regular ceil(32/3)=11 -> 11*2 = 22: sum 46, max 24
      k=2: long 4*3 = 12, regular 16*2 = 32: sum 44, max 32
      k=3: long 3*3 = 9, regular 32*2 = 64: sum 73, max 64
    so "sum" picks k=2 and "max" picks k=1.
    """
    recent = np.array([2] * 6 + [3] * 4)  # P50 = 2, P90 = 3
    scores = np.arange(40, 0, -1).astype(float)
    return dispatch.plan_from_scores(
        scores, recent, [64] * 4, lambda bs, _ctx: float(bs), objective=objective
    )


def test_sum_and_max_objectives_hand_made():
    by_sum, by_max = sum_vs_max_case("sum"), sum_vs_max_case("max")
    assert len(by_sum.long_instances) == 2 and by_sum.predicted_s["cost"] == pytest.approx(44)
    assert len(by_max.long_instances) == 1 and by_max.predicted_s["cost"] == pytest.approx(24)
    assert by_max.representative == (3.0, 2.0)
    # The predicted makespan is what "max" minimises; "sum" pays 32 for it here.
    assert max(by_sum.predicted_s["long"], by_sum.predicted_s["regular"]) == pytest.approx(32)
    # The 8 highest scores are the long tail.
    long_set = set(by_max.long_instances)
    assert {i for i in range(40) if by_max.instance_per_request[i] in long_set} == set(range(8))


def test_kv_memory_caps_the_batch():
    cfg = model_config.tiny()
    kv = dispatch.kv_bytes_per_token(cfg)
    assert kv == 2 * 2 * 2 * 16 * 4  # k+v, layers, kv heads, head dim, f32
    assert dispatch.kv_slot_cap(kv, kv * 100 * 3 + 5, 100) == 3
    dcfg = dispatch.DispatchConfig(kv_bytes_per_token=kv, kv_memory_bytes=kv * 100.0)
    d = dispatch.SkewAwareDispatcher(lambda p: np.array([len(x) for x in p], float), PAPER, dcfg)
    d.observe([10] * 10 + [100] * 2)  # P90 = 91: one sequence fits; P50 = 10: ten fit
    plan = d.plan([[1] * i for i in range(1, 21)], 2, [8, 8])
    # 4 long prompts on one instance with BS_max = 1 run in 4 waves.
    l_long = plan.representative[0]
    assert plan.predicted_s["long"] == pytest.approx(4 * PAPER(1, l_long / 2) * l_long)


def test_static_batch_costs_every_slot():
    ptl = dispatch.PTLProfile((1, 8), (1.0, 8.0))
    assert dispatch.instance_latency(2, 10.0, 8, ptl) == pytest.approx(2.0 * 10)
    assert dispatch.instance_latency(2, 10.0, 8, ptl, static_batch=True) == pytest.approx(80)


def test_heterogeneous_slots_long_tail_on_smallest_instance():
    scores = np.arange(50, 0, -1).astype(float)
    plan = dispatch.plan_from_scores(scores, np.arange(1, 101), [32, 4], PAPER)
    assert plan.long_instances == (1,)
    assert sum(i == 1 for i in plan.instance_per_request) == 10
    plan = dispatch.plan_from_scores(scores, np.arange(1, 101), [32, 4, 32], PAPER)
    assert plan.long_instances[0] == 1


def test_list_schedule_hand_made():
    # One slot each, 1 s per token: 10 -> A; 9 -> B (9 < 19); 8 -> B (17 < 18); the three
    # 1s -> A (11, 12, 13).
    where, finish = dispatch.list_schedule(np.array([10, 9, 8, 1, 1, 1]), [1, 1], [1.0, 1.0])
    assert where == [0, 1, 1, 0, 0, 0] and finish == [13.0, 17.0]
    # A two-slot instance at 2 s per token and a one-slot one at 1 s: ties go to index 0.
    where, finish = dispatch.list_schedule(np.array([4, 4, 4]), [2, 1], [2.0, 1.0])
    assert where == [1, 0, 0] and finish == [8.0, 4.0]


def test_expected_lengths_are_rank_quantiles():
    recent = np.arange(1, 101)
    q = [np.quantile(recent, x) for x in (0.875, 0.625, 0.375, 0.125)]
    est = dispatch.expected_lengths(np.array([1.0, 4.0, 3.0, 2.0]), recent)
    np.testing.assert_allclose(est, [q[3], q[0], q[1], q[2]])
    # Equal scores (a GRPO group; no ranker) share their ranks' mean.
    est = dispatch.expected_lengths(np.array([5.0, 5.0, 1.0, 1.0]), recent)
    np.testing.assert_allclose(est, [(q[0] + q[1]) / 2] * 2 + [(q[2] + q[3]) / 2] * 2)
    np.testing.assert_allclose(dispatch.expected_lengths(np.zeros(4), recent), np.mean(q))


def test_lpt_planner_balances_predicted_work():
    """Two equal instances, flat PTL: the longest-ranked prompts alternate between them and
    the predicted makespan is the list schedule's."""
    scores = np.arange(8, 0, -1).astype(float)  # prompt 0 is predicted longest
    recent = np.array([10, 20, 30, 40, 50, 60, 70, 80])
    flat = dispatch.PTLProfile((1, 8), (1.0, 1.0))
    cfg = dispatch.DispatchConfig(planner="lpt", static_batch=True)
    d = dispatch.SkewAwareDispatcher(lambda _p: scores, flat, cfg)
    d.observe(recent)
    plan = d.plan([[1]] * 8, 2, [1, 1])
    est = dispatch.expected_lengths(scores, recent)
    where, finish = dispatch.list_schedule(est, [1, 1], [1.0, 1.0])
    assert plan.instance_per_request == where  # scores descending = submission order
    assert plan.predicted_s["cost"] == pytest.approx(max(finish))
    assert plan.instance_per_request[:2] == [0, 1] and plan.long_instances == ()
    assert plan.priority_per_request == scores.tolist()  # LPT admission inside instances
    loads = [sum(est[i] for i in range(8) if where[i] == k) for k in range(2)]
    assert abs(loads[0] - loads[1]) <= max(est) - min(est)
    with pytest.raises(ValueError, match="planner"):
        dispatch.DispatchConfig(planner="fastest")


def test_random_dispatcher_is_proportional_to_slots_and_fifo():
    plan = dispatch.RandomDispatcher(seed=0).plan([[1]] * 30, 2, [8, 4])
    counts = np.bincount(plan.instance_per_request, minlength=2)
    assert counts.tolist() == [20, 10]
    assert set(plan.priority_per_request) == {0.0}
    assert plan.orders(2)[1] == sorted(plan.orders(2)[1])  # FIFO: submission order
    with pytest.raises(ValueError, match="one slot count per instance"):
        dispatch.RandomDispatcher().plan([[1]], 2, [8])


def test_validation_and_profile(tmp_path):
    with pytest.raises(ValueError, match="objective"):
        dispatch.DispatchConfig(objective="mean")
    with pytest.raises(ValueError, match="recent_lengths is empty"):
        dispatch.plan_from_scores(np.ones(3), np.array([]), [4, 4], PAPER)
    path = tmp_path / "ptl.json"
    path.write_text('{"batch_sizes": [1, 4], "per_token_s": [0.01, 0.02]}')
    ptl = dispatch.PTLProfile.from_json(str(path))
    assert ptl(2) == pytest.approx(0.01 + 0.01 / 3)
    assert ptl(8) == pytest.approx(0.02 + 4 * 0.01 / 3)  # last slope extrapolated
    path.write_text('{"batch_sizes": [1]}')
    with pytest.raises(ValueError, match="per_token_s"):
        dispatch.PTLProfile.from_json(str(path))


@pytest.mark.parametrize("admission", ["lpt", "fifo"])
def test_engine_admits_longest_predicted_first(model, admission):
    """An LPT engine admits the plan's priorities in descending order, FIFO in order."""
    # The engine tests' tiny model and engine (4 slots): their compiled programs, read
    # from the compile cache when engine_test.py has run
    engine = make_engine(model, admission=admission)
    true = np.array([3, 20, 5, 12, 8, 16, 10, 18, 6, 14])
    n = len(true)
    d = dispatch.SkewAwareDispatcher(lambda _p: true.astype(float), PAPER)
    plan = d.plan([[1, 2]] * n, 1, [4])
    reqs = [
        GenerationRequest(
            request_id=i,
            prompt=[1, 2],
            max_new_tokens=4,
            forced_length=int(true[i]),
            sampling=SamplingParams.greedy(),
            priority=plan.priority_per_request[i],
        )  # fmt: skip
        for i in range(n)
    ]
    admit = {s.request_id: s.timings.admit for s in engine.run(reqs)}
    first = sorted(i for i in admit if admit[i] == min(admit.values()))
    if admission == "lpt":
        assert first == [1, 5, 7, 9]  # the four longest predicted
        for a in range(n):  # a longer prediction is never admitted after a shorter one
            for b in range(n):
                if true[a] > true[b]:
                    assert admit[a] <= admit[b], (a, b)
    else:
        assert first == [0, 1, 2, 3]
        assert all(admit[i] <= admit[i + 1] for i in range(n - 1))
