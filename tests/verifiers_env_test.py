"""verifiers' tool environment loop as a scaffold (endpoint/verifiers_env.py): how its
episodes end (the turn limit, the environment done, the context, a step's error) and an
unreadable final reply answered by the environment, with a scripted policy behind the
endpoint (scripted_policy.py). The episode's tokens against the in-process run:
chained_calculator_test.py."""

from __future__ import annotations

import json

import pytest
from scripted_policy import TOKEN, Scripted

from streamrl_jax.data import tokenize
from streamrl_jax.endpoint.client import EndpointClient
from streamrl_jax.endpoint.scaffolds import AgentTask
from streamrl_jax.endpoint.server import Endpoint, EndpointServer
from streamrl_jax.endpoint.turns import Context, Turns
from streamrl_jax.endpoint.verifiers_env import chat_program, verifiers_scaffold
from streamrl_jax.environments import chained_calculator as chained
from streamrl_jax.environments.calculator import CalculatorEnvironment
from streamrl_jax.environments.protocol import Services, StepResult, TurnInfo
from streamrl_jax.environments.tool_calls import Simple
from streamrl_jax.environments.tools import ToolResult, calculate
from streamrl_jax.model import function_calls
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import TaskDataset, TaskReward

CHAIN = {"chain_sum": {"min_terms": 4, "max_terms": 5, "min_digits": 3, "max_digits": 3}}
UNREADABLE = '<tool_call>\n{"name": "calculate", "arguments": {"a": 1,\n'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


class Spied(chained.ChainedCalculator):
    """The chained calculator whose steps may be replaced, its ended episodes kept."""

    def __init__(self, tok, step=None):
        services = Services(
            tools=lambda name, arguments: ToolResult(calculate(arguments)),
            score=lambda text, md, score=TaskReward(): score(text, md),
        )
        super().__init__(function_calls.of_tokenizer(tok), services)
        self.replaced, self.ended = step, []

    def step(self, state, message, metadata):
        if self.replaced is not None:
            return self.replaced(state, message)
        return super().step(state, message, metadata)

    def end(self, state):
        self.ended.append(state)


def _call(a, op, b):
    call = {"name": "calculate", "arguments": {"a": a, "op": op, "b": b}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _play(tok, env, script, *, max_turns=6, total=2048):
    """(the scaffold's result, the endpoint's record, the backend) of one episode."""
    p = TaskDataset("chain_sum", seed=2, size=8, task_configs=CHAIN)[0]
    backend = Scripted(tok)
    backend.script = list(script)
    endpoint = Endpoint(Turns(Context(tok, 1024, total)), backend, TOKEN)
    server = EndpointServer(endpoint)
    client = EndpointClient(server.start(), TOKEN)
    try:
        play = verifiers_scaffold(env, "policy", max_turns=max_turns)
        eid = client.open()
        result = play(AgentTask(p.question, p.metadata), client.openai(eid))
        return result, endpoint.book.close(eid), backend
    finally:
        server.stop()


def test_an_unreadable_reply_is_answered_and_the_loop_runs_again_until_the_turn_limit(tok):
    # The endpoint returns the unreadable call as text: verifiers' loop ends on it (no
    # calls), the environment says so (a user message), the loop runs again on the whole
    # conversation; two calls later the turns are spent and no fourth request is sent.
    env = Spied(tok)
    result, record, backend = _play(
        tok, env, [UNREADABLE, _call(1, "+", 2), _call(3, "+", 4), "unused"], max_turns=3
    )
    assert result.outcome == "turn_limit" and result.reward == 0.0
    assert (result.malformed_calls, result.tool_calls) == (1, 2)
    assert len(backend.requests) == 3 and len(env.ended) == 1
    s = record.sample
    assert "could not be read" in tok.decode(s.response[~s.policy_mask].tolist())


def test_an_environment_done_on_a_call_gets_no_further_turn(tok):
    def step(state, message):
        return StepResult([{"role": "tool", "content": "over"}], 0.25, True, state, TurnInfo(1))

    env = Spied(tok, step)
    result, _, backend = _play(tok, env, [_call(1, "+", 2), "unused"])
    assert result.outcome == "done" and result.reward == 0.25 and result.tool_calls == 1
    assert len(backend.requests) == 1 and env.ended == []


def test_a_step_that_raises_fails_the_episode_with_its_error(tok):
    # (not a tool error the loop's MCP client would report or retry: the step ran once)
    steps = []

    def step(state, message):
        steps.append(message)
        raise KeyError("environment bug")

    with pytest.raises(KeyError, match="environment bug"):
        _play(tok, Spied(tok, step), [_call(1, "+", 2), "unused"])
    assert len(steps) == 1


def test_a_turn_past_the_episodes_context_ends_it_truncated(tok):
    # The endpoint refuses the second turn (context_length_exceeded): verifiers' loop ends
    # on it, and the episode ends as in-process at its token limit.
    env = Spied(tok)
    p = TaskDataset("chain_sum", seed=2, size=8, task_configs=CHAIN)[0]
    messages = lambda problem: env.start(problem.question, problem.metadata).messages  # noqa: E731
    prompt = len(tokenize(p, tok, messages=messages, tools=env.functions).tokens)
    first = _call(1, "+", 2)
    total = prompt + len(tok.encode(first)) + 2  # the first turn fits, the second does not
    result, record, backend = _play(tok, env, [first, _call(3, "+", 4)], total=total)
    assert result.outcome == "episode_tokens" and result.tool_calls == 1
    assert len(backend.requests) == 1 and len(env.ended) == 1
    assert record.turns == 1


def test_an_environment_without_openai_functions_is_refused(tok):
    env = CalculatorEnvironment(Simple(), Services(tools=None, score=None))
    with pytest.raises(ValueError, match="offers no OpenAI functions"):
        verifiers_scaffold(env, "policy", max_turns=2)


def test_only_the_verifiers_whose_program_this_drives_is_taken(monkeypatch):
    import verifiers

    monkeypatch.setattr(verifiers, "__version__", "0.5.0")
    chat_program.cache_clear()
    try:
        with pytest.raises(ImportError, match="verifiers 0.5.0 installed; this needs 0.4.0"):
            chat_program()
    finally:
        chat_program.cache_clear()
