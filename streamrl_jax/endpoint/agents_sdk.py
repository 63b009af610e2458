"""An OpenAI Agents SDK agent as a training scaffold: third-party agent code, unchanged,
plays an environment of OpenAI functions through the run's endpoint.

`openai_agents_scaffold(env, ...)` builds, per episode, an `agents.Agent` whose
instructions are the environment's system message, whose tools are its functions
(`agents.FunctionTool`, the schema as the environment gives it: `strict_json_schema`
off, so the endpoint shows the model the same tools as a run in-process), and whose
model is the SDK's `OpenAIChatCompletionsModel` over the episode's client; then
`Runner.run(agent, question, max_turns)`. The SDK owns the loop: it sends the
requests, runs each call the policy makes, sends the results back as `tool` messages.
Each tool call runs through the environment's own step (the call written as the policy
wrote it, so the environment's sandboxed tool, its state and its counts are what they
are in-process), and the agent's final output is the environment's last step, whose
score is the episode's return. So an episode is the same tokens and the same return as
the environment's in-process episode (`tests/agents_test.py`). The SDK's turn limit is
the environment's (`MaxTurnsExceeded`: the episode ends at its turn limit); a turn past
the episode's context ends it as in-process (`context_length_exceeded`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamrl_jax.endpoint.api import EPISODE_HEADER
from streamrl_jax.endpoint.scaffolds import AgentResult, AgentTask, Scaffold, outcome_of, tally
from streamrl_jax.endpoint.turns import CONTEXT_EXCEEDED
from streamrl_jax.environments.protocol import Environment, TurnInfo
from streamrl_jax.model.function_calls import Call

if TYPE_CHECKING:
    import openai


def openai_agents_scaffold(
    env: Environment,
    model: str,
    max_turns: int,
    max_tokens: int | None = None,
    *,
    temperature: float | None = None,
    http_client: Callable[[], openai.DefaultAsyncHttpxClient] | None = None,
) -> Scaffold:
    """The scaffold of `env` (an environment of OpenAI functions) played by an OpenAI
    Agents SDK agent (module docstring); `temperature` (None: the endpoint's default, 1)
    is every request's (0: greedy, an evaluation's); `http_client` makes each episode's
    HTTP client (None: the SDK's own), e.g. one that observes the responses.

    Raises:
      ImportError: the SDK is not installed (`pip install openai-agents`).
      ValueError: `env` offers no OpenAI functions.
    """
    import agents
    import openai

    if not getattr(env, "functions", ()):
        raise ValueError(f"environment {env.name!r} offers no OpenAI functions for an agent")
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    settings = agents.ModelSettings(max_tokens=max_tokens, temperature=temperature)

    def play(task: AgentTask, client: Any) -> AgentResult:
        start = env.start(task.question, task.metadata)
        roles = [m["role"] for m in start.messages]
        if roles != ["system", "user"]:
            raise ValueError(f"an agent starts from a system and a user message, not {roles}")
        episode = {"state": start.state, "total": 0.0, "counts": TurnInfo(), "last": TurnInfo()}

        def step(text: str) -> Any:
            result = env.step(episode["state"], text, task.metadata)
            episode["state"] = result.state
            episode["total"] += result.reward
            episode["counts"] = tally(episode["counts"], result.info)
            if result.info.answered:
                episode["last"] = result.info
            return result

        def tool(fn: Any) -> Any:
            async def invoke(ctx: Any, arguments: str) -> str:
                call = Call(getattr(ctx, "tool_call_id", "call"), fn.name, arguments)
                result = step(env.convention.write([call]))
                return "\n".join(m["content"] for m in result.observation)

            return agents.FunctionTool(
                name=fn.name,
                description=fn.description,
                params_json_schema=fn.parameters,
                on_invoke_tool=invoke,
                strict_json_schema=False,
            )

        async def run() -> str:
            """The agent's runs until the environment is done or the turns are spent: a
            final output the environment does not take as its end (unreadable call
            markup) gets its observation as the next input, as in-process."""
            headers = {EPISODE_HEADER: client.default_headers[EPISODE_HEADER]}
            oc = openai.AsyncOpenAI(
                base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
                default_headers=headers, timeout=client.timeout,
                http_client=None if http_client is None else http_client(),
            )  # fmt: skip
            agent = agents.Agent(
                name=env.name,
                instructions=start.messages[0]["content"],
                tools=[tool(fn) for fn in env.functions],
                model=agents.OpenAIChatCompletionsModel(model, openai_client=oc),
                model_settings=settings,
            )
            given: Any = start.messages[1]["content"]
            left = max_turns
            try:
                while True:
                    out = await agents.Runner.run(agent, given, max_turns=left)
                    left -= len(out.raw_responses)
                    result = step(str(out.final_output))
                    if result.done:
                        return "done"
                    if left <= 0:
                        return "turn_limit"
                    given = [*out.to_input_list(), *result.observation]
            except agents.MaxTurnsExceeded:
                return "turn_limit"
            except openai.BadRequestError as e:
                if e.code != CONTEXT_EXCEEDED:
                    raise
                return "episode_tokens"
            finally:
                await oc.close()

        outcome = asyncio.run(run())
        if outcome != "done":
            env.end(episode["state"])
        last = episode["last"]
        return outcome_of(episode["total"], last, episode["counts"], outcome)

    return play
