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

A new kind is one module beside these, one line below and its config fields (its name
in `config.sections.ROLLOUTS` or `ROLLOUT_WRAPPERS`, which a test holds equal to these).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from streamrl_jax.pipeline.rollouts import (
    agents,
    curriculum,
    dynamic_sampling,
    episodes,
    full,
    partial,
)
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    Rollout,
    RolloutContext,
    Rounds,
    StepOutcome,
    Submit,
    Where,
)

Factory = Callable[[RolloutContext], Rollout]

KINDS: dict[str, Factory] = {
    "full": full.FullRollout,
    "dynamic_sampling": dynamic_sampling.DynamicSampling,
    "partial": partial.make,
}
WRAPPERS: dict[str, Callable[[RolloutContext, Factory], Rollout]] = {
    "curriculum": curriculum.wrap,
    "episodes": episodes.Episodes,
    "agents": agents.Agents,
}


def make_rollout(name: str, ctx: RolloutContext) -> Rollout:
    """The rollout `name` ("kind" or "wrapper+...+kind", validated by `config/rules.py`)."""
    *wrappers, kind = name.split("+")
    build: Factory = KINDS[kind]
    for wrapper in reversed(wrappers):
        build = functools.partial(WRAPPERS[wrapper], inner=build)
    return build(ctx)


__all__ = [
    "KINDS",
    "WRAPPERS",
    "Returned",
    "Rollout",
    "RolloutContext",
    "Rounds",
    "StepOutcome",
    "Submit",
    "Where",
    "make_rollout",
]
