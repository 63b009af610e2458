"""OpenEnv environments, unchanged, as this package's environments (docs/episodes.md).

`environment.name="openenv"` with `environment.openenv="module:Class"` runs an
`openenv-core` (0.3) environment: an `openenv.core.env_server.MCPEnvironment` whose
tools are MCP tools, the form OpenEnv's tool environments take. Each episode is a
fresh instance of the class (`Class(**environment.openenv_kwargs)`, a session), so
the in-process episodes rollout, held-out evaluations, and scaffolds that play it
through the run's OpenAI-compatible endpoint (`endpoint.scaffolds.environment_scaffold`)
all drive it the same way:

* the tools come from the environment itself (`ListToolsAction`, once, at start-up)
  and are offered as OpenAI functions (`functions`: each MCP tool's name, description
  and input JSON schema, checked as the endpoint checks a request's `tools`), so it is
  an environment of OpenAI functions (`config.FUNCTION_ENVIRONMENTS`): in a run's
  episodes the model is shown them and writes its calls in its own function-calling
  convention (`model/function_calls.py`), and through the endpoint a scaffold sends
  them as `tools` and gets `tool_calls` back (the built-in scaffold, an OpenAI Agents
  SDK agent or verifiers' loop). The answer tool (`environment.openenv_answer_tool`,
  default `submit_answer`, taking one string argument) is not offered: the policy's
  message without a tool call is its final answer, and the content of its `<answer>`
  tags (else the whole message, cut to 200 characters) is submitted to that tool.
* the episode's first messages are pure (the run renders them before the episode
  runs): the instructions and the task's question. The session starts at the first
  step: `reset(episode_id=, question=, task=)`, where `task` is the task's
  reasoning-gym entry (the contract an adapted environment keeps: the trainer draws
  the task, so a GRPO group's episodes share it).
* each call (at most `function_calls.MAX_CALLS` a message, parallel calls in order) is
  `step(CallToolAction(name, arguments))` with the run's `environment.tool_timeout_s`;
  the result (or the tool's error) comes back as a `tool` message cut to
  `environment.tool_output_chars`. Call markup that cannot be read (or a function not
  offered) gets one user message saying so. The turn's reward is the observations'
  `reward`; the episode ends when an observation is `done` (the answer tool's always
  is); `correct` is a reward >= 1.0 (reasoning-gym's convention).

The environment's code is trusted (it runs in the run's process, as it would in
OpenEnv's own server); model output reaches it only as tool arguments. A session is
state the run cannot checkpoint, so `episodes+partial` (episodes carried across
rounds, in checkpoints) is refused with it; a resumed run replays its batch's episodes
from their start with new sessions. Sessions end with their episode; one left by an
episode cut short (turn or token limit) is closed when `MAX_SESSIONS` newer ones are
open.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import threading
import uuid
import warnings
from typing import Any

from streamrl_jax.config import EnvironmentSection
from streamrl_jax.environments.protocol import (
    Message,
    Services,
    Start,
    State,
    StepResult,
    TurnInfo,
)
from streamrl_jax.errors import UserError
from streamrl_jax.model import function_calls
from streamrl_jax.rewards.answers import extract_answer
from streamrl_jax.rewards.tasks import chat_messages

INSTRUCTIONS = "Solve it. Use the tools for arithmetic. End with <answer>N</answer>."
UNREADABLE = "error: the tool call could not be read; write it as the tools say"
MAX_SESSIONS = 1024
MAX_ANSWER_CHARS = 200


def load_class(path: str) -> type:
    """The class at `module:Name`.

    Raises:
      UserError: a malformed path, or a module or name that is not there (naming it).
    """
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise UserError(f"environment.openenv={path!r}: expected 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise UserError(
            f"environment.openenv={path!r}: cannot import {module!r} ({e}); an OpenEnv "
            "environment needs openenv-core 0.3 and fastmcp installed"
        ) from None
    except AttributeError:
        raise UserError(f"environment.openenv={path!r}: {module!r} has no {name!r}") from None
    return cls


class OpenEnvEnvironment:
    """An OpenEnv MCP environment as this package's `Environment` (module docstring)."""

    name = "openenv"

    def __init__(
        self,
        path: str,
        kwargs: dict[str, Any],
        convention: function_calls.Convention,
        services: Services,
        *,
        answer_tool: str = "submit_answer",
        timeout_s: float = 5.0,
        max_output_chars: int = 256,
    ):
        del services  # the environment runs its own tools and scores its own answers
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

        # fastmcp logs every failed tool call with a traceback; a model's bad arithmetic
        # is a counted tool failure here, not the run's log
        logging.getLogger("fastmcp").setLevel(logging.CRITICAL)
        # openenv-core 0.3 reads a tool's schema under fastmcp 3's name as well: under
        # fastmcp 4 that warns once per process, about openenv's code, not the run's
        warnings.filterwarnings("ignore", message=r"Accessing `Tool\.inputSchema`")
        self._call = CallToolAction
        self.cls, self.kwargs, self.convention = load_class(path), dict(kwargs), convention
        self.choice = function_calls.ToolChoice("auto")
        self.answer_tool, self.timeout_s = answer_tool, timeout_s
        self.max_output_chars = max_output_chars
        probe = self._new()
        try:
            listed = probe.step(ListToolsAction())
        finally:
            _close(probe)
        tools = {t.name: t for t in getattr(listed, "tools", [])}
        if answer_tool not in tools:
            raise UserError(
                f"environment.openenv_answer_tool={answer_tool!r}: {path} offers no such "
                f"tool (it offers {sorted(tools)})"
            )
        self.answer_param = _one_string_param(path, tools[answer_tool])
        self.functions = _functions(path, [t for n, t in tools.items() if n != answer_tool])
        self._sessions: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _new(self) -> Any:
        try:
            return self.cls(**self.kwargs)
        except TypeError as e:
            raise UserError(
                f"environment.openenv_kwargs: {self.cls.__name__}({self.kwargs}) failed: {e}"
            ) from None

    # ------------------------------------------------------------------ protocol
    def start(self, question: str, metadata: dict[str, Any]) -> Start:
        del metadata
        return Start(chat_messages(question, INSTRUCTIONS), {"session": None, "tool_turns": 0})

    def step(self, state: State, message: str, metadata: dict[str, Any]) -> StepResult:
        sid, env = self._session(state, metadata)
        read = function_calls.interpret(self.convention, message, self.functions, self.choice)
        new = {"session": sid, "tool_turns": state.get("tool_turns", 0) + 1}
        if read.malformed:
            info = TurnInfo(malformed_calls=1)
            return StepResult([{"role": "user", "content": UNREADABLE}], 0.0, False, new, info)
        if not read.calls:
            answer, format_ok = extract_answer(message)
            submitted = answer if answer is not None else message.strip()[:MAX_ANSWER_CHARS]
            obs = env.step(
                self._call(tool_name=self.answer_tool, arguments={self.answer_param: submitted}),
                timeout_s=self.timeout_s,
            )
            reward = float(obs.reward or 0.0)
            self._end(sid)
            info = TurnInfo(
                answered=True, correct=reward >= 1.0, format_ok=format_ok, answer=answer
            )
            return StepResult([], reward, True, {**state, "session": None}, info)
        observation, failures, reward, done = [], 0, 0.0, False
        for name, arguments in read.calls:
            obs = env.step(
                self._call(tool_name=name, arguments=arguments), timeout_s=self.timeout_s
            )
            text, failed = self._result_text(obs)
            failures += failed
            observation.append({"role": "tool", "content": text})
            reward += float(obs.reward or 0.0)
            if obs.done:
                done = True
                break
        info = TurnInfo(tool_calls=len(read.calls), tool_failures=failures)
        if done:
            self._end(sid)
            return StepResult([], reward, True, {**state, "session": None}, info)
        return StepResult(observation, reward, False, new, info)

    def demonstration(self, question: str, metadata: dict[str, Any]) -> list[Message] | None:
        return None  # an OpenEnv environment gives none

    def end(self, state: State) -> None:
        if state.get("session") is not None:
            self._end(state["session"])

    # ------------------------------------------------------------------ sessions
    def _session(self, state: State, metadata: dict[str, Any]) -> tuple[str, Any]:
        sid = state.get("session")
        if sid is not None:
            with self._lock:
                env = self._sessions.get(sid)
            if env is None:
                raise RuntimeError(
                    f"OpenEnv session {sid} is gone (closed after {MAX_SESSIONS} newer ones)"
                )
            return sid, env
        entry = metadata.get("entry")
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
            raise ValueError(
                f"prompt {metadata.get('prompt_id', '?')}: an OpenEnv episode needs its "
                "task's entry (question, answer) in the metadata"
            )
        sid = f"openenv-{uuid.uuid4().hex[:16]}"
        env = self._new()
        env.reset(episode_id=sid, question=entry["question"], task=entry)
        with self._lock:
            self._sessions[sid] = env
            old = []
            while len(self._sessions) > MAX_SESSIONS:
                old.append(self._sessions.popitem(last=False)[1])
        for e in old:
            _close(e)
        return sid, env

    def _end(self, sid: str) -> None:
        with self._lock:
            env = self._sessions.pop(sid, None)
        if env is not None:
            _close(env)

    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close(self) -> None:
        """Closes every open session."""
        with self._lock:
            envs = list(self._sessions.values())
            self._sessions.clear()
        for env in envs:
            _close(env)

    def _result_text(self, obs: Any) -> tuple[str, bool]:
        """A tool observation's text (its error's, when it failed) and whether it failed."""
        error = getattr(obs, "error", None)
        if error is not None:
            text, failed = f"error: {getattr(error, 'message', error)}", True
        else:
            result = getattr(obs, "result", None)
            data = getattr(result, "data", result)
            if data is None and result is not None:
                data = getattr(result, "structured_content", None)
            text = data if isinstance(data, str) else json.dumps(data, default=str)
            failed = False
        if len(text) > self.max_output_chars:
            return text[: self.max_output_chars], True
        return text, failed


def _one_string_param(path: str, tool: Any) -> str:
    schema = getattr(tool, "input_schema", None) or {}
    props = schema.get("properties") or {}
    if len(props) != 1 or next(iter(props.values())).get("type") != "string":
        raise UserError(
            f"environment.openenv={path}: tool {tool.name!r} takes {json.dumps(props)[:200]}; "
            "the answer tool takes one string argument (the answer)"
        )
    return next(iter(props))


def _functions(path: str, tools: list[Any]) -> tuple[function_calls.Tool, ...]:
    """MCP tools as OpenAI functions (their input schemas as they are).

    Raises:
      UserError: one the endpoint would refuse as a request's tool (naming it).
    """
    schemas = []
    for t in tools:
        description = (t.description or "").strip()
        parameters = getattr(t, "input_schema", None) or {}
        function = {"name": t.name, "description": description, "parameters": parameters}
        schemas.append({"type": "function", "function": function})
    try:
        return tuple(function_calls.check_tools(schemas))
    except function_calls.ToolError as e:
        raise UserError(
            f"environment.openenv={path}: its MCP tools as OpenAI functions: {e}"
        ) from None


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


def make(
    section: EnvironmentSection, convention: function_calls.Convention, services: Services
) -> OpenEnvEnvironment:
    """The registry's entry (`environments/__init__.py`): the class `environment.openenv`
    built with `environment.openenv_kwargs`."""
    return OpenEnvEnvironment(
        section.openenv,
        openenv_kwargs(section),
        convention,
        services,
        answer_tool=section.openenv_answer_tool,
        timeout_s=section.tool_timeout_s,
        max_output_chars=section.tool_output_chars,
    )


def openenv_kwargs(section: EnvironmentSection) -> dict[str, Any]:
    """`environment.openenv_kwargs` parsed.

    Raises:
      UserError: not a JSON object (naming the field).
    """
    try:
        kwargs = json.loads(section.openenv_kwargs)
    except json.JSONDecodeError as e:
        raise UserError(f"environment.openenv_kwargs is not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise UserError("environment.openenv_kwargs must be a JSON object {argument: value}")
    return kwargs
