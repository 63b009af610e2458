"""`Trains` of a target that trains a model of its own: its trainer and TrainState, a
step after the policy's at every optimizer step, its state one checkpoint entry (the
critic, the process reward model). The state changes only here (`apply`, `restore`);
the target's `fill` reads `state.params` (the weights from before the batch's update)."""

from __future__ import annotations

from typing import Any

from streamrl_jax.learner.protocol import Accumulators, Metrics, Micro
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer


class OwnModel:
    """A model a target trains beside the policy, its entry and row prefix `name`."""

    def __init__(self, name: str, trainer: Trainer, state: TrainState):
        self.name, self.trainer, self.state = name, trainer, state

    def init_accumulators(self) -> Accumulators:
        return {self.name: self.trainer.init_accumulator()}

    def accumulate(self, dev: TrainBatch, accs: Accumulators, micro: Micro) -> Accumulators:
        acc, _ = self.trainer.accumulate(self.state, accs[self.name], dev, micro.one)
        return accs | {self.name: acc}

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        self.state, acc, m = self.trainer.apply(self.state, accs[self.name])
        return accs | {self.name: acc}, {f"{self.name}_{k}": v for k, v in m.items()}

    def arrays(self) -> dict[str, Any]:
        return {self.name: self.state}

    def restore(self, arrays: dict[str, Any]) -> None:
        self.state = arrays[self.name]
