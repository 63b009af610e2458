"""Periodic actions of a run as hooks with an `every` (Levanter's `add_hook`).

Every periodic action of a run is registered here, once, at the top of the run
(`trainer_hooks`, `generation_hooks`):

* the trainer loop runs its hooks once per step boundary k (after the optimizer
  step of batch k-1): checkpoints every `checkpoint.every`, the online ranker
  refresh and the scheduling-decision log every step;
* the generation driver runs its own after each batch it submits: the held-out
  evaluation every `eval.every` batches (and at batch 0 unless `eval.at_start` is off;
  `eval.every = 0`: at the start only, and the final evaluation after the last batch),
  and every batch the
  prompt source forgets the records of batches no checkpoint can still need.

A hook is never a branch inside a loop.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.pipeline.prompts import PromptSource
from streamrl_jax.scheduling.live import LiveScheduler


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(step)` at every step that is a multiple of `every` (`every` = 0: never)."""

    name: str
    every: int
    fn: Callable[[int], None]
    at_zero: bool = True  # also at step 0

    def due(self, step: int) -> bool:
        if self.every <= 0:
            return False
        return step % self.every == 0 and (step > 0 or self.at_zero)


class Hooks:
    """An ordered set of hooks; `run(step)` calls the due ones in the order added."""

    def __init__(self) -> None:
        self._hooks: list[Hook] = []

    def add(self, name: str, every: int, fn: Callable[[int], None], *, at_zero: bool = True):
        """Adds `fn` to run every `every` steps (0 or less: never)."""
        self._hooks.append(Hook(name, every, fn, at_zero))

    def run(self, step: int) -> list[str]:
        """Runs the hooks due at `step`; returns their names."""
        ran = []
        for hook in self._hooks:
            if hook.due(step):
                hook.fn(step)
                ran.append(hook.name)
        return ran


def trainer_hooks(
    cfg: ExperimentConfig,
    checkpoint: Callable[[int], None],
    live: LiveScheduler,
    workdir: str,
) -> Hooks:
    """The trainer's periodic work: `checkpoint(k)` every `checkpoint.every` steps, the
    ranker refresh and the scheduling decisions (to `<workdir>/scheduling.jsonl`) every
    step."""
    hooks = Hooks()
    hooks.add("checkpoint", cfg.checkpoint.every, checkpoint, at_zero=False)
    hooks.add("ranker refresh", 1, live.refresh_async)
    decisions = os.path.join(workdir, "scheduling.jsonl")
    hooks.add("scheduling decisions", 1, lambda k: live.write_decisions(decisions))
    return hooks


def generation_hooks(
    cfg: ExperimentConfig, evaluate: Callable[[int], None], prompts: PromptSource
) -> Hooks:
    """The generation driver's periodic work: `evaluate(b)` (the held-out prompts under
    the loaded weights) every `eval.every` batches and at batch 0; the prompt records of
    batches before b - s - 2 dropped every batch (the trainer, at most s + 1 batches
    behind the driver, checkpoints at its own boundary or later)."""
    hooks = Hooks()
    if cfg.eval.num_problems > 0:
        every = cfg.eval.every or cfg.pipeline.steps
        hooks.add("eval", every, evaluate, at_zero=cfg.eval.at_start)
    keep = cfg.pipeline.staleness + 2
    hooks.add("prompt records", 1, lambda b: prompts.forget_below(b - keep))
    return hooks
