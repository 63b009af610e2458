"""The chained calculator (environments/chained_calculator.py): its two-operand tool, its
steps and demonstrations, and its episodes the same tokens in a run and through the
endpoint with OpenAI tool calling (a scripted policy: scripted_policy.py), up to the
episode budget."""

from __future__ import annotations

import numpy as np
import pytest
from scripted_policy import TOKEN, Scripted

from streamrl_jax.data import tokenize
from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.agents_sdk import openai_agents_scaffold
from streamrl_jax.endpoint.client import EndpointClient
from streamrl_jax.endpoint.scaffolds import AgentTask, environment_scaffold
from streamrl_jax.endpoint.server import Endpoint, EndpointServer
from streamrl_jax.endpoint.turns import Context, Turns
from streamrl_jax.endpoint.verifiers_env import verifiers_scaffold
from streamrl_jax.environments import EpisodeKit, EpisodeLimits
from streamrl_jax.environments import chained_calculator as chained
from streamrl_jax.environments.protocol import Services
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.environments.tools import ToolResult, calculate
from streamrl_jax.generation.types import GenerationRequest
from streamrl_jax.model import function_calls
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.pipeline.rollouts import EpisodeRecord, answer, episode_outcome
from streamrl_jax.rewards.tasks import TaskDataset, TaskReward

CHAIN = {"chain_sum": {"min_terms": 4, "max_terms": 5, "min_digits": 3, "max_digits": 3}}
TURN = 72  # generation.max_new_tokens: a turn's cap, in-process and at the endpoint


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


def _env(tok, step_credit=0.0):
    def tools(name, arguments):
        try:
            return ToolResult(calculate(arguments))
        except ValueError as e:
            return ToolResult(f"error: {e}", "raised")

    score = TaskReward()
    services = Services(tools=tools, score=lambda text, md: score(text, md))
    return chained.ChainedCalculator(function_calls.of_tokenizer(tok), services, step_credit)


def _problem(i=0):
    return TaskDataset("chain_sum", seed=2, size=8, task_configs=CHAIN)[i]


@pytest.mark.parametrize(
    "arguments, want",
    [({"a": 478, "op": "+", "b": 718}, "478 + 718 = 1196"),
     ({"a": "12", "op": "-", "b": 30}, "12 - 30 = -18"),
     ({"a": 7, "op": "/", "b": 2}, "7 / 2 = 3.5"),
     ({"a": 2.5, "op": "*", "b": 4}, "2.5 * 4 = 10")],
)  # fmt: skip
def test_calculate_takes_two_numbers_and_an_operator(arguments, want):
    assert calculate(arguments) == want


@pytest.mark.parametrize(
    "arguments, why",
    [({"a": 1, "op": "+"}, "b must be a number"), ({"a": 1, "op": "^", "b": 2}, "op must be"),
     ({"a": True, "op": "+", "b": 2}, "a must be a number"), ({"a": 1, "op": "/", "b": 0},
     "division by zero"), ({"a": 1e16, "op": "+", "b": 1}, "beyond"),
     ({"a": "1+1", "op": "+", "b": 1}, "is not a number"),
     ({"a": 1, "op": "+", "b": 1, "c": 2}, "unknown arguments")],
)  # fmt: skip
def test_calculate_refuses_what_is_not_two_bounded_numbers(arguments, why):
    with pytest.raises(ValueError, match=why):
        calculate(arguments)


def test_a_demonstration_chains_the_calls_and_scores_full_marks(tok):
    # The demonstration's calls, run through the environment's own steps, get the
    # results it shows and end with the task's answer, scored 1.
    env, p = _env(tok), _problem()
    demo = env.demonstration(p.question, p.metadata)
    terms = p.metadata["entry"]["metadata"]["num_terms"]
    assert len(demo) == 2 * (terms - 1) + 1
    state = env.start(p.question, p.metadata).state
    for said, shown in zip(demo[0::2], demo[1::2], strict=False):
        step = env.step(state, said["content"], p.metadata)
        assert not step.done and step.observation == [shown] and step.info.tool_calls == 1
        state = step.state
    final = env.step(state, demo[-1]["content"], p.metadata)
    assert final.done and final.reward == 1.0 and final.info.correct
    assert demo[-1]["content"] == f"Left: none\n<answer>{p.answer}</answer>"
    # Each call comes after the terms still left: the question's, one fewer each turn.
    expression = p.metadata["entry"]["metadata"]["expression"]
    lefts = [m["content"].split("\n", 1)[0].removeprefix("Left: ") for m in demo[0:-1:2]]
    assert lefts[0] == expression.split(" ", 1)[1]
    assert all(a.endswith(" " + b) for a, b in zip(lefts, lefts[1:], strict=False))


def test_each_correct_step_of_the_chain_earns_its_share_of_the_step_credit(tok):
    # With step_credit 0.5, the calls of the demonstration earn 0.5 in all (an equal share
    # each); a call that is not the next step (a wrong operand, a term out of order, the
    # same step again) earns nothing and the chain waits where it was.
    env, p = _env(tok, step_credit=0.5), _problem()
    demo = env.demonstration(p.question, p.metadata)
    calls = [m["content"] for m in demo if m["role"] == "assistant"][:-1]
    share = 0.5 / len(calls)
    state = env.start(p.question, p.metadata).state
    first = env.step(state, calls[0], p.metadata)
    assert first.reward == pytest.approx(share) and first.state["steps"] == 1
    again = env.step(first.state, calls[0], p.metadata)  # the first step once more
    assert again.reward == 0.0 and again.state["steps"] == 1
    skipped = env.step(again.state, calls[2], p.metadata)  # a step out of order
    assert skipped.reward == 0.0 and skipped.state["steps"] == 1
    assert skipped.state["calls"] == 3
    total, state = first.reward, skipped.state
    for call in calls[1:]:
        step = env.step(state, call, p.metadata)
        total, state = total + step.reward, step.state
    final = env.step(state, demo[-1]["content"], p.metadata)
    assert total == pytest.approx(0.5) and final.reward == 1.0
    # Once the chain is done, a call (the last step again, or any other) costs a share:
    # an episode that keeps calling ranks below the one that answers.
    extra = env.step(state, calls[-1], p.metadata)
    assert extra.reward == pytest.approx(-share) and extra.state["steps"] == len(calls)


def test_an_unreadable_call_is_said_and_an_answer_without_calls_is_scored(tok):
    env, p = _env(tok), _problem()
    state = env.start(p.question, p.metadata).state
    bad = env.step(state, '<tool_call>\n{"name": "calculate", "arguments": {"a": 1,\n', p.metadata)
    assert not bad.done and bad.info.malformed_calls == 1 and bad.observation[0]["role"] == "user"
    other = env.step(
        state, '<tool_call>\n{"name": "sum", "arguments": {}}\n</tool_call>', p.metadata
    )
    assert not other.done and other.info.malformed_calls == 1  # a function not offered
    wrong = env.step(state, "<answer>7</answer>", p.metadata)
    assert wrong.done and wrong.reward == 0.0 and wrong.info.answered


def _through_endpoint(tok, env, p, script, scaffold, limits):
    """`p`'s episode played by `scaffold` through an endpoint with `limits`, the scripted
    policy writing `script` one text a turn: the scaffold's result, the episode's record."""
    backend = Scripted(tok)
    backend.script = list(script)
    endpoint = Endpoint(Turns(Context(tok, 1024, 2048)), backend, TOKEN, limits=limits)
    server = EndpointServer(endpoint)
    client = EndpointClient(server.start(), TOKEN)
    try:
        make = {"environment": environment_scaffold, "openai_agents": openai_agents_scaffold,
                "verifiers": verifiers_scaffold}[scaffold]  # fmt: skip
        play = make(env, "policy", max_turns=6)
        eid = client.open()
        result = play(AgentTask(p.question, p.metadata), client.openai(eid))
        return result, endpoint.book.close(eid)
    finally:
        server.stop()


@pytest.mark.parametrize("scaffold", ["environment", "openai_agents", "verifiers"])
def test_an_episode_is_the_same_tokens_in_a_run_and_through_the_endpoint(tok, scaffold):
    # A scaffold plays the environment through the endpoint with OpenAI tool calling
    # (`tools`, `tool_calls`, `tool` messages by id): the environment's own loop, an
    # OpenAI Agents SDK agent (its Runner, its function tool), or verifiers' tool
    # environment loop (its chat program, streamed, its MCP tools); the policy (scripted)
    # writes the demonstration's calls. The record's first prompt is the run's (`data.tokenize` with
    # the environment's functions), and every token the environment added is what the
    # run's renderer adds for the same observations.
    env, p = _env(tok), _problem(1)
    demo = env.demonstration(p.question, p.metadata)
    script = [m["content"] for m in demo if m["role"] == "assistant"]
    result, record = _through_endpoint(tok, env, p, script, scaffold, api.Limits())
    calls = len(demo) // 2
    assert result.reward == 1.0 and result.correct and result.tool_calls == calls
    messages = lambda problem: env.start(problem.question, problem.metadata).messages  # noqa: E731
    in_run = tokenize(p, tok, messages=messages, tools=env.functions)
    assert list(record.sample.prompt) == list(in_run.tokens)
    s, renderer = record.sample, TurnRenderer(tok, env.convention)
    env_tokens, at = [], 0
    for k, m in enumerate(demo):
        if m["role"] == "tool":
            env_tokens += renderer.observation([m], tok.token_to_id("<|im_end|>"))
            at = k
    assert at and list(s.response[~s.policy_mask]) == env_tokens
    end = tok.token_to_id("<|im_end|>")
    sampled = [
        t for m in demo if m["role"] == "assistant" for t in [*tok.encode(m["content"]), end]
    ]
    np.testing.assert_array_equal(s.policy_token_ids(), sampled)


def _in_process(tok, env, p, script, budget):
    """`p`'s episode in-process as a run plays it (the first request capped at TURN, then
    `rollouts.answer` on each ended turn: the next turn, or how the episode ended), the
    scripted policy writing `script` one text a turn: its last sample and its outcome."""
    limits = EpisodeLimits(max_turns=6, turn_tokens=TURN, episode_tokens=budget)
    kit = EpisodeKit(env, TurnRenderer(tok, env.convention), limits, 1, None)
    policy = Scripted(tok)
    policy.script = list(script)
    messages = lambda problem: env.start(problem.question, problem.metadata).messages  # noqa: E731
    prompt = tokenize(p, tok, messages=messages, tools=env.functions).tokens
    request = GenerationRequest(
        request_id="in-process", prompt=list(prompt), max_new_tokens=TURN, metadata=p.metadata
    )
    ep = EpisodeRecord(state=env.start(p.question, p.metadata).state)
    try:
        while True:
            sample = policy.submit(request).result()
            ep.turns += 1
            how = answer(kit, sample, ep)
            if isinstance(how, str):
                return sample, episode_outcome(sample, ep, how, 0)
            request = how
    finally:
        kit.close()


def _turn_starts(sample):
    """Where each policy turn begins in the response."""
    m = sample.policy_mask
    return [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]


@pytest.mark.parametrize("left", ["none", "a_cut_call"])
@pytest.mark.parametrize("scaffold", ["environment", "openai_agents", "verifiers"])
def test_an_episode_that_reaches_its_budget_ends_through_the_endpoint_as_in_process(
    tok, scaffold, left
):
    # The budget (environment.max_episode_tokens, the endpoint's Limits.episode_tokens)
    # runs out before the third turn: with nothing left of it ("none": the third turn
    # would start at the budget) or with the first tokens of a call left (the third turn
    # is cut there, unreadable, and the environment's answer to it leaves none). The
    # scaffold's episode through the endpoint is the in-process episode: the same
    # tokens, the same return and tool calls, and it ends "episode_tokens" where the
    # in-process one does (the endpoint refuses the request past the budget).
    env, p = _env(tok), _problem(1)
    demo = env.demonstration(p.question, p.metadata)
    script = [m["content"] for m in demo if m["role"] == "assistant"]
    whole, played = _in_process(tok, env, p, script, 4096)
    assert played["outcome"] == "done" and len(script) > 3  # unbounded: every turn
    # the third turn's first tokens: the terms left and a call's opening, unclosed
    third = script[2]
    opening = len(tok.encode(third[: third.index("<tool_call>")] + '<tool_call>\n{"name"'))
    budget = _turn_starts(whole)[2] + (0 if left == "none" else opening)
    sample, want = _in_process(tok, env, p, script, budget)
    assert want["outcome"] == "episode_tokens" and want["tool_calls"] == 2
    assert want["turns"] == (2 if left == "none" else 3)
    assert len(sample.response) - _turn_starts(sample)[-1] == (
        len(tok.encode(script[1])) + 1 if left == "none" else opening
    )
    limits = api.Limits(max_tokens=TURN, episode_tokens=budget)
    result, record = _through_endpoint(tok, env, p, script, scaffold, limits)
    assert result.outcome == "episode_tokens"
    got = (result.reward, result.tool_calls, result.malformed_calls)
    assert got == (want["return"], want["tool_calls"], want["malformed_calls"])
    assert record.turns == want["turns"]
    s = record.sample
    np.testing.assert_array_equal(s.prompt, sample.prompt)
    np.testing.assert_array_equal(s.response, sample.response)
    np.testing.assert_array_equal(s.policy_mask, sample.policy_mask)
    np.testing.assert_array_equal(s.logprobs, sample.logprobs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(environment__step_credit=0.5), "environment.name='calculator'"),
        (dict(environment__name="chained_calculator", environment__step_credit=1.5),
         "environment.step_credit must be in \\[0, 1\\], got 1.5"),
    ],
)  # fmt: skip
def test_step_credit_is_for_environments_that_tell_a_correct_step(overrides, message):
    from support import agent_config

    from streamrl_jax.errors import UserError

    with pytest.raises(UserError, match=message):
        agent_config(**overrides)
