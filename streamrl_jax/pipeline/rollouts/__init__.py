"""Rollout kinds, chosen from `pipeline.rollout` (DESIGN.md §8; the protocol: `protocol.py`).

`pipeline.rollout` names a kind, optionally after wrappers joined with "+" (outermost
first): `"full"`, `"dynamic_sampling"`, `"partial"`, `"curriculum+dynamic_sampling"`.

* `full` (`full.py`): step b trains every group of batch b.
* `dynamic_sampling` (`dynamic_sampling.py`): DAPO's dynamic sampling: groups without
  reward variance are skipped and replaced.
* `partial` (`partial.py`): rounds of a bounded token budget; paused samples carried
  into the next round (here, or across processes: the trainer's half).
* `curriculum` (`curriculum.py`, a wrapper): prompts whose recent groups were all right
  or all wrong are drawn less.
* `episodes` (`episodes.py`, a wrapper, the last before the kind): every sample is a
  multi-turn episode with the run's environment (`environment.name`); over `partial`,
  the rounds place its turns (`protocol.Rounds`).
* `agents` (`agents.py`, a wrapper, the last before the kind): every training episode
  is played by a scaffold through the run's OpenAI-compatible endpoint.
* `multi_agent` (`multi_agent.py`, a wrapper, the last before `full`): episodes of a
  multi-agent environment, each role in a conversation of its own, each handed on and
  trained as its own sample.

A wrapper derives from `protocol.Wrapper` and overrides only what it changes. What a
kind needs beyond its `RolloutContext` (the run's environment, its endpoint) it is
handed by its line below, from the `Kits` the run built where it wires the rollout
(`pipeline/parts.py`, a generation process), so the protocol knows neither.

What a run's held-out episodes are made of (an episode's record, the environment's
answer to a turn, its outcome: `episodes.py`) is exported here too, for the same
evaluation outside a run (`pipeline/episode_evaluation.py`).

A new kind is one module beside these, one line below and its config fields (its name
in `config.sections.ROLLOUTS` or `ROLLOUT_WRAPPERS`, which a test holds equal to these).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamrl_jax.environments import EpisodeKit
from streamrl_jax.pipeline.rollouts import (
    agents,
    curriculum,
    dynamic_sampling,
    episodes,
    full,
    multi_agent,
    partial,
)
from streamrl_jax.pipeline.rollouts.episodes import (
    EpisodeRecord,
    answer,
    episode_outcome,
    question_of,
)
from streamrl_jax.pipeline.rollouts.protocol import (
    Outcomes,
    Returned,
    Rollout,
    RolloutContext,
    Rounds,
    StepOutcome,
    Submit,
    Verdicts,
    Where,
    Wrapper,
)

if TYPE_CHECKING:  # (the endpoint's server and fastapi: imported where a run builds its kit)
    from streamrl_jax.endpoint.kit import AgentKit

Factory = Callable[[RolloutContext], Rollout]


@dataclasses.dataclass(frozen=True)
class Kits:
    """What the wrappers that play episodes are handed besides their context (None where
    this process does not run them: a training process across processes, or a run
    without them)."""

    episodes: EpisodeKit | None = None  # the run's environment (environment.name)
    agents: AgentKit | None = None  # the endpoint and its scaffold ("agents")


# A wrapper around `inner` (built from the context it is given), handed its kits.
Wrap = Callable[[RolloutContext, Factory, Kits], Rollout]

KINDS: dict[str, Factory] = {
    "full": full.FullRollout,
    "dynamic_sampling": dynamic_sampling.DynamicSampling,
    "partial": partial.make,
}
WRAPPERS: dict[str, Wrap] = {
    "curriculum": lambda ctx, inner, kits: curriculum.Curriculum(ctx, inner),
    "episodes": lambda ctx, inner, kits: episodes.Episodes(ctx, inner, kits.episodes),
    "agents": lambda ctx, inner, kits: agents.Agents(ctx, inner, kits.episodes, kits.agents),
    "multi_agent": lambda ctx, inner, kits: multi_agent.make(ctx, inner, kits.episodes),
}


def make_rollout(name: str, ctx: RolloutContext, kits: Kits = Kits()) -> Rollout:
    """The rollout `name` ("kind" or "wrapper+...+kind", validated by `config/rules.py`),
    its wrappers handed what they need of `kits`."""
    *wrappers, kind = name.split("+")
    build: Factory = KINDS[kind]
    for wrapper in reversed(wrappers):
        build = functools.partial(WRAPPERS[wrapper], inner=build, kits=kits)
    return build(ctx)


__all__ = [
    "KINDS",
    "WRAPPERS",
    "EpisodeRecord",
    "Kits",
    "Outcomes",
    "Returned",
    "Rollout",
    "RolloutContext",
    "Rounds",
    "StepOutcome",
    "Submit",
    "Verdicts",
    "Where",
    "Wrapper",
    "answer",
    "episode_outcome",
    "make_rollout",
    "question_of",
]
