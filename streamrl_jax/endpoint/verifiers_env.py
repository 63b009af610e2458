"""A `verifiers` (0.4.0) tool environment as a training scaffold: verifiers' own
tool-calling rollout loop, unchanged, plays an environment of OpenAI functions through
the run's endpoint.

In verifiers 0.4.0 (`verifiers.v1`) a tool environment is a taskset whose tools are MCP
servers, played by a harness; the tool-calling one is the `null` harness, whose program
is verifiers' chat loop: the modules `harnesses/utils/{mcp,compaction,core}.py` bundled
into one script (`launch.bundle_program`, `CHAT_PROGRAM_SOURCE`), which imports nothing
of verifiers (its dependencies: openai, mcp, httpx, httpx2, tenacity, certifi). It lists
the MCP servers' tools as OpenAI functions (`connect_mcp`), sends each turn with the
official `openai` client (streamed, `chat`), runs every call through its MCP server
(`call_mcp`), appends the results as `tool` messages and ends at the first reply without
calls (`run_chat_loop`). verifiers runs the program in a runtime prepared by `uv`, its
model calls through its interception server; the harness contract allows the loop
in-process instead ("the interception is the contract, not the process": every model
call goes to the endpoint). So `verifiers_scaffold` reads those three modules from the
installed package, bundles them as verifiers does (`chat_program`, once), and per episode
runs its `connect_mcp` and `run_chat_loop` in-process with:

* the official `openai.AsyncOpenAI` pointed at the run's endpoint with the episode's
  `X-Episode-Id` header (as `agents_sdk.py`), no retries;
* one MCP server (the `mcp` SDK's low-level `Server`) offering the environment's
  functions with their own JSON schemas, so the endpoint shows the model the same tools
  as a run in-process; each call runs through the environment's own step (the call
  written as the policy wrote it), and its result is the step's observation;
* the one name of the program replaced: `mcp_client`, how it reaches a tool server, is
  the SDK's in-memory transport (`mcp.Client(server)`) instead of streamable HTTP.

The loop's final reply (no calls) is the environment's last step, whose score ends the
episode; a final reply the environment does not take as its end (unreadable call markup)
gets its observation appended and the loop runs again on the whole conversation, as
verifiers' `Harness.resume` relaunches it. So an episode is the same tokens and the same
return as the environment's in-process episode (`tests/chained_calculator_test.py`).
verifiers' loop has no turn limit of its own (its interception server's `@stop` hooks
refuse the turn past one); here a request hook of the client refuses it: after
`max_turns` turns, or once the environment is done, the next request ends the episode
(`turn_limit` / `done`). A turn past the episode's context is refused by the endpoint
(`context_length_exceeded`), which the loop takes as its end (`is_context_overflow`):
the episode ends truncated, as in-process. verifiers' loop sends no `max_tokens`: a
turn's cap is the endpoint's (`Limits.max_tokens`, the run's per-turn cap).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.resources
import json
from collections.abc import AsyncIterator
from typing import Any

from streamrl_jax.endpoint.api import EPISODE_HEADER
from streamrl_jax.endpoint.scaffolds import AgentResult, AgentTask, Scaffold, outcome_of, tally
from streamrl_jax.environments.protocol import Environment, StepResult, TurnInfo
from streamrl_jax.model.function_calls import Call

VERSION = "0.4.0"  # the verifiers whose chat program this drives
# The modules verifiers bundles into its chat program, in its order (`CHAT_PROGRAM_SOURCE`)
PROGRAM = ("mcp.py", "compaction.py", "core.py")
_USED = ("connect_mcp", "run_chat_loop", "Compactor", "mcp_client")


class _Ended(BaseException):
    """A request after the episode ended (its turns spent, or the environment done):
    raised by the client's request hook. A BaseException, as a cancellation is: the
    `openai` client turns every Exception of its transport into a connection error, which
    the loop answers by exiting the process."""


@functools.cache
def chat_program() -> dict[str, Any]:
    """verifiers' chat program as a namespace: its three modules' source, from the
    installed package, bundled as verifiers bundles them (module docstring), with its
    `mcp_client` the in-memory one.

    Raises:
      ImportError: verifiers is not installed, or is not a version whose program this
        drives.
    """
    import verifiers

    if verifiers.__version__ != VERSION:
        raise ImportError(f"verifiers {verifiers.__version__} installed; this needs {VERSION}")
    folder = importlib.resources.files("verifiers") / "v1" / "harnesses" / "utils"
    source = "\n".join((folder / name).read_text(encoding="utf-8") for name in PROGRAM)
    program: dict[str, Any] = {"__name__": "verifiers_chat_program"}
    exec(compile(source, "<verifiers chat program>", "exec"), program)  # noqa: S102 - its own program
    missing = [name for name in _USED if name not in program]
    if missing:
        raise ImportError(f"verifiers {VERSION}'s chat program has no {', '.join(missing)}")
    program["mcp_client"] = _in_memory_client
    return program


@contextlib.asynccontextmanager
async def _in_memory_client(spec: dict[str, Any]) -> AsyncIterator[Any]:
    """The program's `mcp_client(spec)` for a server given in the spec itself."""
    import mcp

    async with mcp.Client(spec["server"]) as client:
        yield client


def verifiers_scaffold(
    env: Environment, model: str, max_turns: int, max_tokens: int | None = None
) -> Scaffold:
    """The scaffold of `env` (an environment of OpenAI functions) played by verifiers'
    tool-calling chat loop (module docstring); `max_tokens` is the endpoint's cap.

    Raises:
      ImportError: verifiers 0.4.0 (or the `mcp` SDK) is not installed.
      ValueError: `env` offers no OpenAI functions.
    """
    del max_tokens  # verifiers' loop sends none: the endpoint's cap applies
    import mcp.types
    import openai
    from mcp.server.lowlevel import Server

    program = chat_program()
    if not getattr(env, "functions", ()):
        raise ValueError(f"environment {env.name!r} offers no OpenAI functions for verifiers")
    listed = mcp.types.ListToolsResult(
        tools=[
            mcp.types.Tool(name=f.name, description=f.description, input_schema=f.parameters)
            for f in env.functions
        ]
    )
    # the flags of the program's command line that run_chat_loop reads: no gate, no
    # built-in bash/edit/search tools
    flags = argparse.Namespace(
        tool_interception_url="", bash=False, edit=False, search=False, serper_key=""
    )

    def play(task: AgentTask, client: Any) -> AgentResult:
        start = env.start(task.question, task.metadata)
        episode: dict[str, Any] = {
            "state": start.state, "total": 0.0, "counts": TurnInfo(), "last": TurnInfo(),
            "turns": 0, "done": False, "error": None,
        }  # fmt: skip

        def step(text: str) -> StepResult:
            result = env.step(episode["state"], text, task.metadata)
            episode["state"] = result.state
            episode["total"] += result.reward
            episode["counts"] = tally(episode["counts"], result.info)
            episode["done"] = result.done
            if result.info.answered:
                episode["last"] = result.info
            return result

        async def list_tools(ctx: Any, params: Any) -> Any:
            return listed

        async def call_tool(ctx: Any, params: Any) -> Any:
            call = Call("call", params.name, json.dumps(params.arguments or {}))
            try:
                result = step(env.convention.write([call]))
            except Exception as e:  # noqa: BLE001 - raised by the scaffold, below
                # (raised here, the loop's client would retry the call: a step runs once)
                episode["error"] = e
                return mcp.types.CallToolResult(content=[], is_error=True)
            text = "\n".join(m["content"] for m in result.observation)
            return mcp.types.CallToolResult(content=[mcp.types.TextContent(text=text)])

        server = Server(env.name, on_list_tools=list_tools, on_call_tool=call_tool)

        async def admit(request: Any) -> None:
            """The client's request hook: a turn is admitted while the episode goes on."""
            if request.url.path.endswith("/chat/completions"):
                if episode["done"] or episode["error"] or episode["turns"] >= max_turns:
                    raise _Ended
                episode["turns"] += 1

        async def run() -> str:
            oc = openai.AsyncOpenAI(
                base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
                default_headers={EPISODE_HEADER: client.default_headers[EPISODE_HEADER]},
                timeout=client.timeout,
                http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [admit]}),
            )  # fmt: skip
            messages: list[dict[str, Any]] = [dict(m) for m in start.messages]
            try:
                async with contextlib.AsyncExitStack() as stack:
                    config = {"mcpServers": {"": {"server": server}}}  # unqualified names
                    tools, dispatch, servers = await program["connect_mcp"](config, stack)
                    compactor = program["Compactor"](oc, model, tools, False, None)
                    while True:
                        await program["run_chat_loop"](
                            flags, compactor, messages, dispatch, servers, None
                        )
                        last = messages[-1]
                        if last["role"] != "assistant" or last.get("tool_calls"):
                            return "episode_tokens"  # the loop ended on a refused turn
                        final = step(last.get("content") or "")
                        if final.done:
                            return "done"
                        messages += final.observation  # verifiers' resume: the loop again
            except _Ended:
                return "done" if episode["done"] else "turn_limit"
            finally:
                await oc.close()

        outcome = asyncio.run(run())
        if episode["error"] is not None:
            raise episode["error"]
        if outcome != "done":
            env.end(episode["state"])
        return outcome_of(episode["total"], episode["last"], episode["counts"], outcome)

    return play
