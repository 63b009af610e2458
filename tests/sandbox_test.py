"""Reward scoring in confined worker processes (rewards/sandbox.py, rewards/pool.py).

The scorers here are module-level functions, so the spawned workers import them
by name; each asserts what model text scored in a sandbox can and cannot do. Every
worker imports this module to find its scorer: what only the tests use (JAX, the
pipeline, the suite's helpers) is imported in the tests, not on every worker's start.
"""

import multiprocessing
import os
import time

import pytest

from streamrl_jax.rewards import sandbox
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.rewards.sandbox import Limits, RewardTimeout, RewardWorkerDied, SandboxPool
from streamrl_jax.rewards.vowels import vowel_reward

LIMITS = Limits(timeout_s=3.0, memory_mb=1024)


def _result(score: float, answer: str = "") -> RewardResult:
    return RewardResult(score=score, correct=score >= 1, extracted_answer=answer, format_ok=True)


def probe(text: str, metadata: dict) -> RewardResult:
    """Runs `text` as the worst scorers do (eval), reporting what it could do."""
    try:
        out = repr(eval(text))  # noqa: S307 - the point of the test
    except BaseException as e:  # noqa: BLE001
        out = f"refused: {type(e).__name__}: {e}"
    return _result(0.0, out)


def die(text: str, metadata: dict) -> RewardResult:
    if text == "die":
        os._exit(3)
    return _result(1.0, str(os.getpid()))


@pytest.fixture(scope="module")
def countdown():
    import reasoning_gym

    from streamrl_jax.rewards.tasks import TaskReward  # its workers import reasoning-gym

    entry = reasoning_gym.create_dataset("countdown", size=1, seed=0)[0]
    fn = TaskReward(score_answer=reasoning_gym.get_score_answer_fn("countdown"))
    return fn, {"task": "countdown", "entry": entry, "prompt_id": "countdown/0"}


def test_an_evaluated_answer_cannot_write_outside_its_scratch_directory(countdown, tmp_path):
    fn, meta = countdown
    target = tmp_path / "pwned"
    pool = SandboxPool(fn, workers=1, limits=LIMITS)
    try:
        # The countdown scorer `eval`s the answer (it created this file in the trainer's
        # process before the sandbox); here the write is refused and the answer scores 0.
        payload = f"<answer>__import__('pathlib').Path({str(target)!r}).touch()</answer>"
        result = pool.submit(payload, meta).result(60)
        assert result.score == 0.0 and not target.exists()
        right = pool.submit(f"<answer>{meta['entry']['answer']}</answer>", meta).result(60)
        assert right.score == 1.0  # the same worker still scores honest answers
    finally:
        pool.close()
    assert not os.path.exists(pool.root)  # scratch directories are removed


def test_a_worker_sees_no_secret_and_cannot_reach_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMRL_AUTHKEY", "trainer-secret")
    pool = SandboxPool(probe, workers=1, limits=LIMITS)
    try:
        ask = lambda text: pool.submit(text, {}).result(60).extracted_answer  # noqa: E731
        assert ask("__import__('os').environ.get('STREAMRL_AUTHKEY')") == "None"
        # The trainer's memory and environment through /proc: refused (Landlock scopes
        # ptrace-like access to the worker's own domain).
        parent = os.getpid()
        assert ask(f"open('/proc/{parent}/environ', 'rb').read()").startswith("refused")
        assert ask("open('/proc/self/environ', 'rb').read()").startswith("refused")
        assert ask(f"__import__('os').kill({parent}, 0)").startswith("refused")
        assert ask("__import__('os').system('true')").startswith("refused")
        assert ask("__import__('socket').create_connection(('127.0.0.1', 9))").startswith("refused")
        assert ask(f"open({str(tmp_path / 'x')!r}, 'w')").startswith("refused")
        assert not (tmp_path / "x").exists()
        # Its own scratch directory is writable.
        assert ask("open('note.txt', 'w').write('ok')") == "2"
    finally:
        pool.close()


def test_the_run_key_file_is_hidden_from_workers(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / "run.key").write_text("k" * 64)
    (tmp_path / "visible.txt").write_text("ok")
    monkeypatch.setenv("STREAMRL_AUTHKEY_FILE", str(keys / "run.key"))
    pool = SandboxPool(probe, workers=1, limits=LIMITS)
    try:
        ask = lambda text: pool.submit(text, {}).result(60).extracted_answer  # noqa: E731
        if not ask("open('/proc/self/environ', 'rb').read()").startswith("refused"):
            pytest.skip("no Landlock on this kernel: the worker reads what its user reads")
        assert ask(f"open({str(keys / 'run.key')!r}).read()").startswith("refused")
        assert ask(f"open({str(tmp_path / 'visible.txt')!r}).read()") == "'ok'"  # siblings
    finally:
        pool.close()


def test_readable_roots_cover_everything_but_the_hidden_paths(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "c").mkdir()
    (tmp_path / "d").mkdir()
    roots = sandbox.readable_roots([str(tmp_path / "a" / "b"), "/proc"])
    assert "/proc" not in roots and "/" not in roots
    assert str(tmp_path / "a" / "c") in roots and str(tmp_path / "d") in roots
    assert not any(r == str(tmp_path / "a" / "b") or r.startswith(str(tmp_path / "a" / "b") + "/")
                   for r in roots)  # fmt: skip
    assert not any(str(tmp_path).startswith(r.rstrip("/") + "/") for r in roots)  # no ancestor


def test_a_runaway_answer_costs_one_timeout_and_the_worker_is_replaced(countdown):
    fn, meta = countdown
    pool = SandboxPool(fn, workers=1, limits=LIMITS)
    try:
        # The runaway never finishes: `RewardTimeout` is the pool's deadline (its worker
        # killed), not the outer wait (a `TimeoutError`), whose bound only stops a stall
        # (generous: a spawned worker's start on a loaded machine counts in it)
        with pytest.raises(RewardTimeout, match="no result within 3 s"):
            pool.submit("<answer>9**9**9**9</answer>", meta).result(240)
        right = pool.submit(f"<answer>{meta['entry']['answer']}</answer>", meta).result(60)
        assert right.score == 1.0
    finally:
        pool.close()


def test_a_dead_worker_is_replaced():
    pool = SandboxPool(die, workers=1, limits=LIMITS)
    try:
        before = pool.submit("live", {}).result(60).extracted_answer
        with pytest.raises(RewardWorkerDied):
            pool.submit("die", {}).result(60)
        after = pool.submit("live", {}).result(60).extracted_answer
        assert before != after  # another process
    finally:
        pool.close()


def test_the_pool_counts_timeouts_and_scores_them_zero(countdown):
    fn, meta = countdown
    with RewardPool(fn, num_workers=2, on_error="zero", sandbox=LIMITS) as pool:
        bad, good = "<answer>9**9**9**9</answer>", f"<answer>{meta['entry']['answer']}</answer>"
        results = pool.map([(bad, meta), (good, meta)], timeout_s=60)
        assert [r.score for r in results] == [0.0, 1.0]
        assert "RewardTimeout" in results[0].error
        assert pool.num_timeouts == 1 and pool.num_errors == 1


def slow_vowels(text: str, metadata: dict, hung: frozenset = frozenset()) -> RewardResult:
    """The vowel reward, but the scorer of the prompts in `hung` never returns."""
    if metadata["prompt_id"] in hung:
        time.sleep(3600)
    return vowel_reward(text, metadata)


def test_the_run_goes_on_past_hung_scorers(tmp_path):
    import functools

    import numpy as np
    from support import batch_prompt_ids, pipeline_threads, tiny_config

    from streamrl_jax import pipeline

    cfg = tiny_config(
        eval__num_problems=0,
        data__reward_sandbox="process",
        data__reward_timeout_s=1.0,
        data__reward_errors="zero",
    )
    # One group's scorers hang (the first prompt of batch 0: both its samples, each a
    # timeout that kills and replaces its worker); the run goes on to its second step.
    hung = frozenset({batch_prompt_ids(cfg, 0)[0]})
    result = pipeline.run(cfg, str(tmp_path), reward_fn=functools.partial(slow_vowels, hung=hung))
    assert len(result.steps) == 2 and not pipeline_threads()
    assert not multiprocessing.active_children()  # the workers, hung or not, are gone
    timeouts = result.steps[-1]["reward_timeouts"]
    assert timeouts >= 1 and result.steps[-1]["reward_errors"] == timeouts
    assert all(np.isfinite(r["loss"]) for r in result.steps)
