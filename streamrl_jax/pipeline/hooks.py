"""Periodic actions of a run as hooks with an `every` (Levanter's `add_hook`).

The trainer loop runs its hooks once per step boundary k (after the optimizer
step of batch k-1): checkpoints every `checkpoint.every`, the online ranker
refresh and the scheduling-decision log every step. The generation driver
runs its own at each batch it submits: the held-out evaluation every
`eval.every` batches (and at batch 0). A hook is never a branch inside a loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


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
