"""OpenEnv environments, unchanged (environments/openenv.py): the adapter over the
offline OpenEnv environment (environments/openenv_arithmetic.py), its MCP tools as
OpenAI functions, in-process and played through the run's endpoint by the official
openai client, an OpenAI Agents SDK agent and verifiers' loop (a scripted policy:
scripted_policy.py)."""

import json

import numpy as np
import pytest
import reasoning_gym
from support import agent_config, pipeline_threads, policy_run_lengths, run_recording

from streamrl_jax.config import ConfigError
from streamrl_jax.environments import make_environment
from streamrl_jax.environments.openenv import UNREADABLE, OpenEnvEnvironment
from streamrl_jax.environments.openenv_arithmetic import evaluate
from streamrl_jax.environments.protocol import Services
from streamrl_jax.errors import UserError
from streamrl_jax.model import function_calls

PATH = "streamrl_jax.environments.openenv_arithmetic:ArithmeticToolsEnvironment"
TASK = dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"],
    allow_parentheses=False, allow_negation=False,
)  # fmt: skip
ENTRY = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1, **TASK)[0]
META = {"entry": ENTRY, "prompt_id": 0}  # 'Calculate 4 - 1.' -> '3'


def _env(convention="hermes", path=PATH, **kw):
    conv = function_calls.CONVENTIONS[convention]
    return OpenEnvEnvironment(path, {}, conv, Services(None, None), **kw)


def _call(convention, *expressions):
    calls = [function_calls.Call(f"c{i}", "calculator", json.dumps({"expression": e}))
             for i, e in enumerate(expressions)]  # fmt: skip
    return function_calls.CONVENTIONS[convention].write(calls)


@pytest.mark.parametrize("convention", ["hermes", "llama3_json"])
def test_tools_run_in_the_openenv_environment_and_its_answer_tool_scores(convention):
    # Its MCP tools are OpenAI functions (their input schemas as the environment lists
    # them), called in the model's convention; the answer tool is the end, not offered.
    env = _env(convention)
    (calculator,) = env.functions
    assert calculator.name == "calculator"
    assert calculator.parameters["properties"]["expression"]["type"] == "string"
    start = env.start(ENTRY["question"], META)
    assert start.messages[1] == {"role": "user", "content": ENTRY["question"]}
    turn = env.step(start.state, _call(convention, "4 - 1", "2 * 3"), META)  # parallel calls
    assert (turn.reward, turn.done, turn.observation) == (0.0, False, [
        {"role": "tool", "content": "3"}, {"role": "tool", "content": "6"}])  # fmt: skip
    assert turn.info.tool_calls == 2 and env.open_sessions() == 1
    failed = env.step(turn.state, _call(convention, "9 ** 9 ** 9"), META)
    assert failed.info.tool_failures == 1 and failed.observation[0]["content"].startswith("error: ")
    bad = env.step(failed.state, _call(convention, "1").replace("calculator", "nope"), META)
    assert bad.info.malformed_calls == 1 and not bad.done  # a function not offered
    assert bad.observation == [{"role": "user", "content": UNREADABLE}]
    assert bad.state["session"] == turn.state["session"]
    done = env.step(bad.state, "It is <answer>3</answer>", META)
    assert (done.reward, done.done, done.info.correct, done.info.answer) == (1.0, True, True, "3")
    assert env.open_sessions() == 0  # the session ends with its episode


def test_a_wrong_answer_scores_zero_and_a_limit_ends_the_session():
    env = _env()
    start = env.start(ENTRY["question"], META)
    wrong = env.step(start.state, "<answer>4</answer>", META)
    assert (wrong.reward, wrong.done, wrong.info.correct) == (0.0, True, False)
    turn = env.step(env.start(ENTRY["question"], META).state, _call("hermes", "1+1"), META)
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
        make_environment(
            cfg.environment, function_calls.CONVENTIONS["hermes"], Services(None, None)
        )
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


@pytest.mark.parametrize("scaffold", ["environment", "openai_agents", "verifiers"])
def test_an_openenv_episode_is_the_same_tokens_in_a_run_and_through_the_endpoint(scaffold):
    # Each scaffold plays the OpenEnv environment with OpenAI tool calling (its MCP tool
    # as `tools`, the call back as `tool_calls`, the result as a `tool` message): the
    # record's first prompt is the run's, the environment's tokens are what the run's
    # renderer adds, and the return is the environment's answer tool's score.
    from scripted_policy import TOKEN, Scripted

    from streamrl_jax.data import tokenize
    from streamrl_jax.endpoint.agents_sdk import openai_agents_scaffold
    from streamrl_jax.endpoint.client import EndpointClient
    from streamrl_jax.endpoint.scaffolds import AgentTask, environment_scaffold
    from streamrl_jax.endpoint.server import Endpoint, EndpointServer
    from streamrl_jax.endpoint.turns import Context, Turns
    from streamrl_jax.endpoint.verifiers_env import verifiers_scaffold
    from streamrl_jax.environments.render import TurnRenderer
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.tokenizer import Tokenizer
    from streamrl_jax.rewards.tasks import TaskDataset

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    env = OpenEnvEnvironment(PATH, {}, function_calls.of_tokenizer(tok), Services(None, None))
    p = TaskDataset("basic_arithmetic", seed=1, size=4, task_configs={"basic_arithmetic": TASK})[0]
    script = [_call("hermes", "1 + 1"), f"<answer>{p.answer}</answer>"]
    backend = Scripted(tok)
    backend.script = list(script)
    endpoint = Endpoint(Turns(Context(tok, 1024, 2048)), backend, TOKEN)
    server = EndpointServer(endpoint)
    client = EndpointClient(server.start(), TOKEN)
    make = {"environment": environment_scaffold, "openai_agents": openai_agents_scaffold,
            "verifiers": verifiers_scaffold}[scaffold]  # fmt: skip
    try:
        eid = client.open()
        result = make(env, "policy", 4)(AgentTask(p.question, p.metadata), client.openai(eid))
        record = endpoint.book.close(eid)
    finally:
        server.stop()
    assert (result.reward, result.correct, result.tool_calls) == (1.0, True, 1)
    assert env.open_sessions() == 0
    messages = lambda problem: env.start(problem.question, problem.metadata).messages  # noqa: E731
    in_run = tokenize(p, tok, messages=messages, tools=env.functions)
    s, end = record.sample, tok.token_to_id("<|im_end|>")
    assert list(s.prompt) == list(in_run.tokens)
    renderer = TurnRenderer(tok, env.convention)
    assert list(s.response[~s.policy_mask]) == renderer.observation(
        [{"role": "tool", "content": "2"}], end
    )
    np.testing.assert_array_equal(
        s.policy_token_ids(), [t for text in script for t in [*tok.encode(text), end]]
    )


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
        generation__max_prompt_len=288,  # (configs/agent.py:openenv's: its tool's schema)
        model__max_context=384,
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
