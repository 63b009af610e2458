"""OpenEnv environments, unchanged (environments/openenv.py): the adapter over the
offline OpenEnv environment (environments/openenv_arithmetic.py), in-process and
played through the run's endpoint by the official openai client."""

import numpy as np
import pytest
import reasoning_gym
from support import agent_config, pipeline_threads, policy_run_lengths, run_recording

from streamrl_jax.config import ConfigError
from streamrl_jax.environments import make_environment
from streamrl_jax.environments.openenv import OpenEnvEnvironment
from streamrl_jax.environments.openenv_arithmetic import evaluate
from streamrl_jax.environments.protocol import Services
from streamrl_jax.environments.tool_calls import FORMATS
from streamrl_jax.errors import UserError

PATH = "streamrl_jax.environments.openenv_arithmetic:ArithmeticToolsEnvironment"
TASK = dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"],
    allow_parentheses=False, allow_negation=False,
)  # fmt: skip
ENTRY = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1, **TASK)[0]
META = {"entry": ENTRY, "prompt_id": 0}  # 'Calculate 4 - 1.' -> '3'


def _env(fmt="simple", path=PATH, **kw):
    return OpenEnvEnvironment(path, {}, FORMATS[fmt], Services(None, None), **kw)


def _call(fmt, expression):
    if fmt == "simple":
        return f"<tool_call>calculator: {expression}</tool_call>"
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'  # noqa: E501


@pytest.mark.parametrize("fmt", ["simple", "hermes"])
def test_tools_run_in_the_openenv_environment_and_its_answer_tool_scores(fmt):
    env = _env(fmt)
    start = env.start(ENTRY["question"], META)
    assert "calculator" in start.messages[0]["content"]
    assert "submit_answer" not in start.messages[0]["content"]  # the answer tool is the end
    assert start.messages[1] == {"role": "user", "content": ENTRY["question"]}
    turn = env.step(start.state, "let me see " + _call(fmt, "4 - 1"), META)
    assert (turn.reward, turn.done, turn.observation) == (0.0, False, [
        {"role": "tool", "content": "3"}])  # fmt: skip
    assert env.open_sessions() == 1
    bad = env.step(turn.state, _call(fmt, "9 ** 9 ** 9") + "<tool_call>nope</tool_call>", META)
    assert bad.info.tool_failures == 1 and bad.info.malformed_calls == 1
    assert bad.observation[0]["content"].startswith("error: ")
    assert bad.state["session"] == turn.state["session"]
    done = env.step(bad.state, "It is <answer>3</answer>", META)
    assert (done.reward, done.done, done.info.correct, done.info.answer) == (1.0, True, True, "3")
    assert env.open_sessions() == 0  # the session ends with its episode


def test_a_wrong_answer_scores_zero_and_a_limit_ends_the_session():
    env = _env()
    start = env.start(ENTRY["question"], META)
    wrong = env.step(start.state, "<answer>4</answer>", META)
    assert (wrong.reward, wrong.done, wrong.info.correct) == (0.0, True, False)
    turn = env.step(env.start(ENTRY["question"], META).state, _call("simple", "1+1"), META)
    assert env.open_sessions() == 1
    env.end(turn.state)  # the episode hit a limit
    assert env.open_sessions() == 0
    with pytest.raises(RuntimeError, match="session .* is gone"):
        env.step(turn.state, "<answer>3</answer>", META)


def test_the_calculator_is_parsed_never_evaluated():
    assert evaluate("12 * (3 + 4)") == "84" and evaluate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 10", "1 / 0", "9" * 30, "x" * 300, "[1]"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_bad_openenv_settings_are_refused_by_name():
    with pytest.raises(UserError, match="expected 'module:Class'"):
        _env(path="nocolon")
    with pytest.raises(UserError, match="cannot import 'no_such_module'"):
        _env(path="no_such_module:X")
    with pytest.raises(UserError, match="has no 'Nope'"):
        _env(path="streamrl_jax.environments.openenv_arithmetic:Nope")
    with pytest.raises(UserError, match="openenv_answer_tool='answer'.*offers"):
        _env(answer_tool="answer")
    cfg = agent_config(environment__name="openenv", environment__openenv=PATH,
                       environment__openenv_kwargs="[1]")  # fmt: skip
    with pytest.raises(UserError, match="openenv_kwargs must be a JSON object"):
        make_environment(cfg.environment, FORMATS["simple"], Services(None, None))
    for over, match in [
        ({"environment__openenv": ""}, "name 'openenv' runs"),
        ({"pipeline__rollout": "episodes+partial", "pipeline__lag_policy": "drop",
          "pipeline__partial_budget_tokens": 16, "pipeline__max_lag": 2},
         "OpenEnv session is state a checkpoint cannot hold"),
        ({"warmup__steps": 1}, "gives no demonstrations"),
    ]:  # fmt: skip
        base = {"environment__name": "openenv", "environment__openenv": PATH}
        with pytest.raises(ConfigError, match=match):
            agent_config(**(base | over))


def test_an_openenv_environments_episodes_train_through_the_endpoint(tmp_path):
    # The OpenEnv environment played by scaffolds with the official openai client through
    # the run's endpoint: its rewards are the episodes' returns, what trains is the
    # endpoint's record, and every session is closed when the run ends. One decode shape
    # (`pipeline.deterministic`): the engine's programs are agents_test.py's and
    # episodes_test.py's runs'.
    cfg = agent_config(
        environment__name="openenv",
        environment__openenv=PATH,
        pipeline__rollout="agents+full",
        pipeline__mode="stream_sync",
        pipeline__deterministic=True,
        eval__num_problems=2,
    )
    result, seen = run_recording(cfg, tmp_path)
    p = cfg.pipeline
    train = [s for s in seen if not s.tag.is_eval]
    assert len(train) == p.steps * p.prompts_per_step * p.group_size
    for s in seen:
        ep = s.metadata["episode"]
        assert ep["outcome"] in ("done", "turn_limit", "episode_tokens"), ep
        assert ep["return"] in (0.0, 1.0)  # submit_answer's score
        mask = np.ones(len(s.response), bool) if s.policy_mask is None else s.policy_mask
        assert len(policy_run_lengths(mask)) == ep["turns"] >= 1  # one turn: all policy
        np.testing.assert_array_equal(s.logprobs[~mask], 0.0)
    assert all("episode_turns" in r for r in result.steps)
    assert not pipeline_threads()
