"""Multi-turn environments: the protocol, tool calls, tools, the shipped environments.

* `protocol.py`: `Environment` (start -> first messages; step on a policy message ->
  observation, reward, done), its JSON state and `Services` (sandboxed tools, the task
  score).
* `tool_calls.py`: tool-call formats in the model's text (`hermes`, `simple`).
* `tools.py`: the tools (`calculator`) and `ToolRunner`, which runs them in the sandbox.
* `render.py`: an environment turn as the tokens appended to the episode.
* `solve_verify.py`: a multi-agent environment (`protocol.MultiAgentEnvironment`):
  a solver and a verifier in one episode (`pipeline/rollouts/multi_agent.py`).
* `calculator.py`, `retry.py`: the environments shipped, chosen by `environment.name`
  through the registry `ENVIRONMENTS` below.
* `openenv.py`: an OpenEnv (openenv-core) MCP environment, unchanged, as one of them
  (`environment.name="openenv"`); `openenv_arithmetic.py` is one, built from offline
  reasoning-gym data.

A new environment is one module with a `make(section, fmt, services)` factory, one line
of `ENVIRONMENTS` (with the tools it is offered) and its name in
`config.sections.ENVIRONMENTS` (a test holds the two equal).

`make_kit` builds what the episodes rollout (`pipeline/rollouts/episodes.py`) needs;
`EpisodeReward` is the run's reward function when episodes run: an episode's outcome,
which its environment already scored, or the task's score for an answer an environment
asks about.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from streamrl_jax.config import FUNCTION_ENVIRONMENTS, EnvironmentSection
from streamrl_jax.environments import calculator, chained_calculator, openenv, retry, solve_verify
from streamrl_jax.environments.protocol import (
    Environment,
    Message,
    Services,
    Start,
    State,
    StepResult,
    TurnInfo,
)
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.environments.tool_calls import resolve_format
from streamrl_jax.environments.tools import TOOLS, ToolRunner
from streamrl_jax.errors import UserError
from streamrl_jax.model import function_calls
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.sandbox import Limits

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Registered:
    """An environment as the registry knows it."""

    # its factory: (section, the tool format, services); for an environment of OpenAI
    # functions (`config.FUNCTION_ENVIRONMENTS`), (section, the model's function-calling
    # convention, services)
    make: Callable[[EnvironmentSection, Any, Services], Environment]
    tools: tuple[str, ...] = ()  # the tools (`tools.TOOLS`) the run's sandbox runs for it


# `environment.name` -> the environment; the names `config.sections.ENVIRONMENTS` lists.
ENVIRONMENTS: dict[str, Registered] = {
    "calculator": Registered(calculator.make, tools=("calculator",)),
    "retry": Registered(retry.make),
    "openenv": Registered(openenv.make),  # runs its own tools
    "chained_calculator": Registered(chained_calculator.make, tools=("calculate",)),
    "solve_verify": Registered(solve_verify.make),  # two agents (a multi-agent environment)
}


def registered(name: str) -> Registered:
    """The environment `environment.name` names.

    Raises:
      UserError: no environment of that name (naming the field and the known ones).
    """
    if name not in ENVIRONMENTS:
        raise UserError(
            f"environment.name={name!r}: no such environment; the known ones are "
            f"{', '.join(ENVIRONMENTS)} ('' runs single-turn samples)"
        )
    return ENVIRONMENTS[name]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """What ends an episode besides its environment (docs/episodes.md, "Limits")."""

    max_turns: int  # policy turns
    turn_tokens: int  # policy tokens per turn (generation.max_new_tokens)
    episode_tokens: int  # tokens after the prompt, policy + environment
    # a conversation's first prompt (a multi-agent episode's later roles': rendered when
    # their first turn comes; generation.max_prompt_len)
    prompt_tokens: int = 1 << 30


class EpisodeKit:
    """An environment with what runs it: the turn renderer, the limits, the tools, and
    the `episode-env` threads its steps run on (owned here, ended by `close`)."""

    def __init__(
        self,
        environment: Environment,
        renderer: TurnRenderer,
        limits: EpisodeLimits,
        workers: int,
        tools: ToolRunner | None,
    ):
        self.environment, self.renderer, self.limits = environment, renderer, limits
        self.tools = tools
        self._threads = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="episode-env"
        )

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Runs `fn(*args)` on an environment thread."""
        return self._threads.submit(fn, *args)

    def cancel(self) -> None:
        """Drops environment steps not started yet (the run failed or stops)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Ends the environment threads (a running step is not waited for), the tools and
        the environment's own sessions (an OpenEnv one's)."""
        self.cancel()
        if self.tools is not None:
            self.tools.close()
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()


def make_kit(
    section: EnvironmentSection,
    tokenizer: Tokenizer,
    score: Callable[[str, dict[str, Any]], RewardResult],
    limits: EpisodeLimits,
) -> EpisodeKit:
    """The environment `section.name` for a model with `tokenizer`.

    Raises:
      UserError: no environment of that name, or a tool format this model has no parser
        for (naming the field).
    """
    entry = registered(section.name)
    fmt = _format(section, tokenizer)
    names = entry.tools
    runner = None
    if names:
        sandbox = None
        if section.tool_sandbox:
            sandbox = Limits(timeout_s=section.tool_timeout_s, memory_mb=section.tool_memory_mb)
        runner = ToolRunner(
            {n: TOOLS[n] for n in names},
            sandbox=sandbox,
            timeout_s=section.tool_timeout_s,
            workers=section.workers,
            max_output_chars=section.tool_output_chars,
        )
    services = Services(tools=runner if runner is not None else _no_tools, score=score)
    env = entry.make(section, fmt, services)
    return EpisodeKit(env, renderer(section, tokenizer), limits, section.workers, runner)


def renderer(section: EnvironmentSection, tokenizer: Tokenizer) -> TurnRenderer:
    """The renderer of the environment's turns (with the model's convention for an
    environment of OpenAI functions: its results as the endpoint renders them)."""
    functional = section.name in FUNCTION_ENVIRONMENTS
    return TurnRenderer(tokenizer, function_calls.of_tokenizer(tokenizer) if functional else None)


def make_environment(section: EnvironmentSection, fmt: Any, services: Services) -> Environment:
    """The environment `section.name` with tool format (or convention) `fmt`, calling
    `services`.

    Raises:
      UserError: no environment of that name.
    """
    return registered(section.name).make(section, fmt, services)


def first_messages(
    section: EnvironmentSection, tokenizer: Tokenizer
) -> Callable[[Any], list[Message]] | None:
    """`problem -> messages`: an episode's first messages (`Environment.start`), which the
    prompt pipeline renders and tokenises (`data.tokenize`); None without an environment
    (`environment.name=""`: a sample starts with its task's own messages). Starting calls
    no service.

    Raises:
      UserError: a tool format this model has no parser for.
    """
    if not section.name:
        return None
    env = demonstrator(section, tokenizer)
    return lambda problem: env.start(problem.question, problem.metadata).messages


def demonstrator(section: EnvironmentSection, tokenizer: Tokenizer) -> Environment:
    """The environment `section.name` for demonstrations only (`Environment.demonstration`;
    it calls no service)."""
    fmt = _format(section, tokenizer)
    return make_environment(section, fmt, Services(tools=_no_tools, score=_no_score))


def functions(section: EnvironmentSection, tokenizer: Tokenizer) -> tuple[Any, ...]:
    """The OpenAI functions the environment offers (`Environment.functions`: shown in an
    episode's first prompt as the endpoint shows a request's tools), () for none."""
    if not section.name:
        return ()
    return tuple(getattr(demonstrator(section, tokenizer), "functions", ()))


def _format(section: EnvironmentSection, tokenizer: Tokenizer) -> Any:
    """What the environment's factory is given: the model's function-calling convention for an
    environment of OpenAI functions, else the tool format `section.tool_format` names.

    Raises:
      UserError: a tool format this model has no parser for, or one named for an
        environment of OpenAI functions (the model's own convention is theirs).
    """
    if section.name in FUNCTION_ENVIRONMENTS:
        if section.tool_format != "auto":
            raise UserError(
                f"environment.tool_format={section.tool_format!r}: environment "
                f"{section.name!r} offers OpenAI functions, written in the model's own "
                "convention (environment.tool_format='auto')"
            )
        return function_calls.of_tokenizer(tokenizer)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return resolve_format(section.tool_format, vocab)


def _no_tools(name: str, arguments: dict[str, Any]) -> Any:
    raise RuntimeError(f"this environment offers no tools (asked for {name!r})")


def _no_score(text: str, metadata: dict[str, Any]) -> RewardResult:
    raise RuntimeError("an environment scored while starting an episode")


def reward_fn(section: EnvironmentSection, task: RewardFn) -> RewardFn:
    """The run's reward function: `task`, or with an environment the episodes' outcome
    (and `task` for the answers an environment scores)."""
    return EpisodeReward(task) if section.name else task


@dataclasses.dataclass(frozen=True)
class EpisodeReward:
    """The run's `RewardFn` with episodes: a sample whose metadata holds its episode's
    outcome (`metadata["episode"]`, written by the episodes rollout) scores that outcome;
    any other text (an answer an environment asks about) the task's reward."""

    task: RewardFn

    def __call__(self, sample_text: str, metadata: dict[str, Any]) -> RewardResult:
        episode = metadata.get("episode")
        if episode is None:
            return self.task(sample_text, metadata)
        if episode.get("masked"):  # a multi-agent episode's role that never acted
            return RewardResult(
                score=0.0,
                correct=False,
                extracted_answer=None,
                format_ok=False,
                masked=episode["masked"],
            )
        return RewardResult(
            score=float(episode["return"]),
            correct=bool(episode["correct"]),
            extracted_answer=episode["answer"],
            format_ok=bool(episode["format_ok"]),
            task_score=float(episode["return"]),
        )


__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "EpisodeKit",
    "EpisodeLimits",
    "EpisodeReward",
    "Message",
    "Registered",
    "Services",
    "Start",
    "State",
    "StepResult",
    "TurnInfo",
    "demonstrator",
    "first_messages",
    "make_environment",
    "make_kit",
    "registered",
    "reward_fn",
]
