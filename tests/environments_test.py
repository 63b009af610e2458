"""Environments (streamrl_jax/environments/): tool-call formats, the calculator, the tool
runner's bounded failures in the sandbox, the shipped environments, turn rendering."""

import dataclasses
import json
import time

import pytest

from streamrl_jax.environments import (
    EpisodeLimits,
    EpisodeReward,
    Services,
    first_messages,
    make_environment,
    make_kit,
    reward_fn,
)
from streamrl_jax.environments import tools as tools_lib
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.environments.tool_calls import (
    FORMATS,
    MAX_CALLS,
    ToolSpec,
    resolve_format,
)
from streamrl_jax.environments.tools import CALCULATOR, ToolRunner, calculator
from streamrl_jax.errors import UserError
from streamrl_jax.rewards.sandbox import Limits, RewardTimeout
from streamrl_jax.rewards.tasks import TaskReward

SPECS = {"calculator": CALCULATOR}


# The sandbox's spawned tool workers import this module to find the tools below: the
# suite's helpers and the pipeline (JAX, the model, the trainer) are imported where a
# test uses them, not on every worker's start (the hung-tool test measured 20.7 s -> 7.8 s).
def agent_config(**overrides):
    from support import agent_config as config

    return config(**overrides)


def tiny_config(**overrides):
    from support import tiny_config as config

    return config(**overrides)


def _tokenizer(cfg):
    from streamrl_jax.pipeline import components

    return components.describe_model(cfg).tokenizer


def test_simple_and_hermes_calls_parse_and_bad_markup_is_counted():
    simple, hermes = FORMATS["simple"], FORMATS["hermes"]
    p = simple.parse("I'll compute. <tool_call>calculator: 12 - 7</tool_call>", SPECS)
    assert [(c.name, c.arguments) for c in p.calls] == [("calculator", {"expression": "12 - 7"})]
    assert p.malformed == 0 and p.any
    assert not simple.parse("<answer>5</answer>", SPECS).any
    bad = simple.parse("<tool_call>abacus: 1+1</tool_call><tool_call>no colon</tool_call>", SPECS)
    assert bad.calls == [] and bad.malformed == 2
    assert simple.parse("<tool_call>calculator: 1+1", SPECS).malformed == 1  # never closed
    many = "".join(f"<tool_call>calculator: {i}</tool_call>" for i in range(MAX_CALLS + 3))
    parsed = simple.parse(many, SPECS)
    assert len(parsed.calls) == MAX_CALLS and parsed.malformed == 3
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    assert hermes.parse(call, SPECS).calls[0].arguments == {"expression": "2*3"}
    as_string = (
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    )
    assert hermes.parse(as_string, SPECS).calls[0].arguments == {"expression": "1"}
    for junk in ("{not json", '{"name": "rm", "arguments": {}}', "[1, 2]", "1" * 3000):
        assert hermes.parse(f"<tool_call>{junk}</tool_call>", SPECS).malformed == 1, junk
    assert "calculator" in simple.describe([CALCULATOR])
    assert json.loads(hermes.describe([CALCULATOR]).split("<tools>\n")[1].split("\n</tools>")[0])


def test_a_tool_format_the_model_has_no_parser_for_is_a_config_error():
    assert resolve_format("auto", {"<tool_call>": 1, "</tool_call>": 2}).name == "hermes"
    assert resolve_format("auto", {"a": 1}).name == "simple"
    with pytest.raises(UserError, match="environment.tool_format='hermes'.*no <tool_call> token"):
        resolve_format("hermes", {"a": 1})
    with pytest.raises(UserError, match="environment.tool_format='xml'"):
        resolve_format("xml", {"a": 1})


@pytest.mark.parametrize(
    "expression,want",
    [("12 - 7", "5"), ("47 - 96", "-49"), ("2 * (3 + 4)", "14"), ("7 / 2", "3.5"),
     ("6 / 3", "2"), ("2 ** 10", "1024"), ("-3 + 1.5", "-1.5"), ("9 × 3", "27"), ("8 =", "8")],
)  # fmt: skip
def test_calculator_evaluates_arithmetic(expression, want):
    assert calculator({"expression": expression}) == want


@pytest.mark.parametrize(
    "expression,why",
    [("__import__('os')", "unsupported"), ("1/0", "division by zero"), ("9**9**9", "too large"),
     ("(" * 500 + "1" + ")" * 500, "longer than"), ("1 +", "cannot parse"), ("", "non-empty"),
     ("10**20 * 10**20", "out of range"), ("x + 1", "unsupported")],
)  # fmt: skip
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator({"expression": expression})


# Module-level tools: the sandbox's spawned workers import them by name.
def hang(arguments):
    time.sleep(60)


def flood(arguments):
    return "x" * 100_000


def boom(arguments):
    raise RuntimeError("tool bug " + "y" * 500)


def grab(arguments):
    import numpy as np

    return str(np.ones(10**9).sum())  # 8 GB: past the worker's address-space limit


def _spec(name):
    return ToolSpec(name, "a test tool", "x", "anything", "1")


def test_a_tool_that_hangs_floods_raises_or_dies_costs_one_bounded_counted_failure():
    fns = [("hang", hang), ("flood", flood), ("boom", boom), ("grab", grab)]
    tools = {n: (_spec(n), fn) for n, fn in [*fns, ("calculator", calculator)]}
    runner = ToolRunner(
        tools, sandbox=Limits(timeout_s=2.0, memory_mb=512), workers=2, max_output_chars=64
    )
    # The pool's futures, to see that the hung call ended at the configured deadline (its
    # worker killed by the pool) rather than by the tool returning after its 60 s sleep.
    futures = []
    submit = runner._pool.submit

    def spy(*args, **kwargs):
        futures.append(submit(*args, **kwargs))
        return futures[-1]

    runner._pool.submit = spy
    try:
        hung = runner("hang", {})
        assert hung.failure == "timeout" and "did not finish within 2 s" in hung.text
        # Bounded by the configured deadline, checked by which path ended the call, not by
        # a wall clock: the pool's deadline fired (`RewardTimeout`, the worker killed and
        # replaced). The runner answers at the pool's deadline or at its own outer wait
        # (deadline + 30 s, counted from submission: a worker's spawn on a loaded machine
        # can pass it), both a timeout; the wait here only bounds a stall of the test.
        assert isinstance(futures[0].exception(timeout=240), RewardTimeout)
        flooded = runner("flood", {})
        assert flooded.failure == "flooded" and flooded.text.startswith("x" * 64)
        assert len(flooded.text) < 120
        raised = runner("boom", {})
        assert raised.failure == "raised" and "tool bug" in raised.text and len(raised.text) < 220
        died = runner("grab", {})
        assert died.failure in ("died", "raised"), died  # MemoryError or killed: bounded
        ok = runner("calculator", {"expression": "2+2"})
        assert ok.failure is None and ok.text == "4"  # the pool recovered
        assert runner.calls == 5
        assert runner.failures["timeout"] == 1 and runner.failures["flooded"] == 1
        assert sum(runner.failures.values()) == 4
    finally:
        runner.close()


def _services() -> Services:
    task = TaskReward()

    def score(text, metadata):
        return task(text, metadata)

    runner = ToolRunner({"calculator": tools_lib.TOOLS["calculator"]}, sandbox=None)
    return Services(tools=runner, score=score)


def _metadata(question="Calculate 47 - 96.", answer="-49"):
    return {"task": "basic_arithmetic", "prompt_id": "t/0",
            "entry": {"question": question, "answer": answer, "metadata": {}}}  # fmt: skip


def test_calculator_environment_runs_calls_then_scores_the_answer():
    cfg = agent_config()
    env = make_environment(cfg.environment, FORMATS["simple"], _services())
    md = _metadata()
    start = env.start("Calculate 47 - 96.", md)
    assert start.messages[0]["role"] == "system" and "<tool_call>" in start.messages[0]["content"]
    assert start.messages[1] == {"role": "user", "content": "Calculate 47 - 96."}
    step = env.step(start.state, "<tool_call>calculator: 47 - 96</tool_call>", md)
    assert not step.done and step.reward == 0.0 and step.info.tool_calls == 1
    assert step.observation == [{"role": "tool", "content": "-49"}]
    bad = env.step(step.state, "<tool_call>calculator: 1/0</tool_call><tool_call>x</tool_call>", md)
    assert bad.info.tool_failures == 1 and bad.info.malformed_calls == 1
    assert "division by zero" in bad.observation[0]["content"]
    assert "could not be read" in bad.observation[1]["content"]
    final = env.step(bad.state, "<answer>-49</answer>", md)
    assert final.done and final.reward == 1.0 and final.info.correct and final.info.format_ok
    wrong = env.step(bad.state, "<answer>49</answer>", md)
    assert wrong.done and wrong.reward == 0.0 and not wrong.info.correct


def test_retry_environment_allows_n_attempts_with_a_discount():
    cfg = agent_config(environment__name="retry", environment__max_attempts=3)
    env = make_environment(cfg.environment, FORMATS["simple"], _services())
    md = _metadata()
    state = env.start("q", md).state
    first = env.step(state, "<answer>1</answer>", md)
    assert not first.done and first.observation[0]["content"] == "That is not correct. Try again."
    second = env.step(first.state, "<answer>-49</answer>", md)
    assert second.done and second.reward == 0.5 and second.info.correct
    state = first.state
    for _ in range(2):
        last = env.step(state, "<answer>2</answer>", md)
        state = last.state
    assert last.done and last.reward == 0.0 and state == {"attempts": 3}


def test_an_unknown_environment_is_refused_by_name():
    # The config refuses the name at start-up (config_test); the registry itself answers
    # a section built around it with one error naming the field and the known names.
    cfg = agent_config()
    section = dataclasses.replace(cfg.environment, name="weather")
    known = r"environment\.name='weather': no such environment; the known ones are calculator, retry, openenv"  # noqa: E501
    with pytest.raises(UserError, match=known):
        make_environment(section, FORMATS["simple"], _services())
    tokenizer = _tokenizer(cfg)
    with pytest.raises(UserError, match=known):
        first_messages(section, tokenizer)
    with pytest.raises(UserError, match=known):  # what a run builds: before any tool starts
        make_kit(section, tokenizer, TaskReward(), EpisodeLimits(2, 8, 32))


def test_without_an_environment_a_sample_keeps_its_tasks_messages_and_reward():
    cfg = agent_config()
    single = dataclasses.replace(cfg.environment, name="")
    assert first_messages(single, _tokenizer(cfg)) is None
    task = TaskReward()
    assert reward_fn(single, task) is task
    assert reward_fn(cfg.environment, task) == EpisodeReward(task)


def test_the_prompt_pipeline_renders_the_environments_first_messages():
    cfg = agent_config()
    tokenizer = _tokenizer(cfg)
    messages = first_messages(cfg.environment, tokenizer)

    class P:
        question, metadata = "Calculate 1 + 2.", _metadata("Calculate 1 + 2.", "3")

    got = messages(P())
    assert got[1]["content"] == "Calculate 1 + 2." and "calculator" in got[0]["content"]


def test_environment_turn_tokens_follow_the_chat_template():
    cfg = tiny_config()
    tok = _tokenizer(cfg)
    r = TurnRenderer(tok)
    end = tok.token_to_id("<|im_end|>")
    obs = [{"role": "tool", "content": "-49"}]
    after_stop = tok.decode(r.observation(obs, end), skip_special_tokens=False)
    assert after_stop == "\n<|im_start|>tool\n-49<|im_end|>\n<|im_start|>assistant\n"
    after_cut = tok.decode(r.observation(obs, None), skip_special_tokens=False)
    assert after_cut == "<|im_end|>" + after_stop
    # The policy's tokens + these are what rendering the whole conversation gives.
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "hi"}, *obs]  # fmt: skip
    whole = tok.apply_chat_template(convo)
    policy = tok.encode("hi") + [end]
    prefix = tok.apply_chat_template(convo[:2])
    assert tok.encode(prefix) + policy + r.observation(obs, end) == tok.encode(whole)


def test_episode_reward_scores_the_outcome_or_the_task():
    fn = EpisodeReward(TaskReward())
    md = _metadata()
    assert fn("<answer>-49</answer>", md).correct
    episode = {"return": 0.5, "correct": True, "format_ok": True, "answer": "-49"}
    r = fn("anything", {**md, "episode": episode})
    assert (r.score, r.correct, r.extracted_answer) == (0.5, True, "-49")
