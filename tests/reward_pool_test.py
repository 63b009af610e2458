"""RewardPool: arrival order, error modes, malformed samples, timeouts."""

import random
import threading
import time

import pytest

from streamrl_jax.rewards import pool as pool_lib
from streamrl_jax.rewards import tasks
from streamrl_jax.rewards.base import RewardResult


class ScorerBug(RuntimeError):
    pass


def _echo_reward(text: str, metadata: dict) -> RewardResult:
    """Scores int(text); raises on "boom"; sleeps a little to scramble completion order."""
    time.sleep(random.Random(metadata["prompt_id"]).uniform(0.0, 0.01))
    if text == "boom":
        raise ScorerBug(f"cannot score {metadata['prompt_id']}")
    return RewardResult(score=float(text), correct=True, extracted_answer=text, format_ok=True)


def _samples(texts):
    return [(t, {"prompt_id": f"p{i}"}) for i, t in enumerate(texts)]


def test_map_returns_results_in_input_order():
    texts = [str(i) for i in range(40)]
    with pool_lib.RewardPool(_echo_reward, num_workers=4) as pool:
        results = pool.map(_samples(texts))
        assert [r.score for r in results] == [float(t) for t in texts]
        assert pool.pending() == 0 and pool.num_errors == 0


def test_raise_mode_propagates_to_the_waiter():
    with pool_lib.RewardPool(_echo_reward, on_error="raise") as pool:
        ok = pool.submit("3", {"prompt_id": "a"})
        bad = pool.submit("boom", {"prompt_id": "b"})
        assert ok.result(timeout=10).score == 3.0
        with pytest.raises(ScorerBug, match="cannot score b"):
            bad.result(timeout=10)
        with pytest.raises(ScorerBug):
            pool.map(_samples(["1", "boom", "2"]))
        assert pool.num_errors == 2


def test_zero_mode_scores_zero_and_counts():
    texts = ["1", "boom", "2", "boom", "5"]
    with pool_lib.RewardPool(_echo_reward, num_workers=3, on_error="zero") as pool:
        results = pool.map(_samples(texts))
        assert [r.score for r in results] == [1.0, 0.0, 2.0, 0.0, 5.0]
        assert [r.error is not None for r in results] == [False, True, False, True, False]
        assert "ScorerBug" in results[1].error and "p1" in results[1].error
        assert pool.num_errors == 2


def test_malformed_and_empty_outputs_score_zero_without_error():
    problem = tasks.TaskDataset("chain_sum", seed=0, size=1)[0]
    texts = [
        "",
        None,
        "<answer></answer>",
        "\x00\ufffd garbage",
        f"<answer>{problem.answer}</answer>",
    ]
    with pool_lib.RewardPool(tasks.TaskReward(), on_error="raise") as pool:
        results = pool.map([(t, problem.metadata) for t in texts])
        assert [r.score for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0]
        assert pool.num_errors == 0


def test_map_timeout_names_the_stuck_prompt():
    release = threading.Event()

    def blocked(text: str, metadata: dict) -> RewardResult:
        release.wait(timeout=30)
        return RewardResult(score=1.0, correct=True, extracted_answer=text, format_ok=True)

    pool = pool_lib.RewardPool(blocked)
    try:
        with pytest.raises(TimeoutError, match="reward pool.*p0"):
            pool.map(_samples(["x"]), timeout_s=0.05)
    finally:
        release.set()
        pool.close()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="on_error"):
        pool_lib.RewardPool(_echo_reward, on_error="ignore")
    with pytest.raises(ValueError, match="num_workers"):
        pool_lib.RewardPool(_echo_reward, num_workers=0)
