"""The Learner seam: what is trained and what the loss reads (DESIGN.md §8, docs/trainer.md).

A learner is a **policy** (its kind: `full` or `lora`, `policies.py`) and an ordered
list of **targets**, each one module beside this one:

* a `Policy` says what of the model is trained and saved and what generation is sent:
  every parameter, or the LoRA adapters on a frozen base;
* a `Target` is something the loss reads or that trains beside the policy: the
  reference log-probs of the KL penalty, pi_old for truncated importance sampling, a
  distillation teacher, the PPO critic with its GAE advantages, an auxiliary
  supervised loss. Each fills its device-side inputs into the placed micro-batch
  (`fill`), adds its figures to the step's row (`row`) and, when it trains something,
  owns that training and its checkpoint state (`trains`: accumulate, apply, arrays,
  restore). A target is composed of functions, not derived from a base.

The trainer loop, resume and the builders call these methods and never ask which
targets run; targets are built from the config through the registry in
`__init__.py` (`make_learner`). Nothing here imports `pipeline/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import Problem
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.state import GradAccumulator, TrainState
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params

# Each trained model's gradient accumulator by name: "policy", and one per target that
# trains (e.g. "critic"); a target that adds to the policy's gradients adds to "policy".
Accumulators = dict[str, GradAccumulator]
Metrics = dict[str, jax.Array]
# Sums host figures over the run's training processes (`shards.TrainerShare.sum`: every
# process calls it in the same order with the same number of values).
Reduce = Callable[[Sequence[float]], list[float]]
# Per-step device values a target records at `fill` and reads back in `row`, by target.
Totals = dict[str, list[Any]]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Which rows of a batch a target builds itself this training process feeds: with T
    training processes each feeds its `index`-th of T equal slices of every micro-batch
    (`pipeline/shards.py`), and `agree` pads its host rows to the shape all processes
    agreed on (one process: index 0 of 1, as it is)."""

    index: int = 0
    count: int = 1
    agree: Callable[[TrainBatch], TrainBatch | None] = lambda batch: batch


@dataclasses.dataclass(frozen=True)
class Micro:
    """What a target reads at one micro-batch.

    Attributes:
      batch: the batch b being trained (-1: a precompile run's empty micro-batch).
      trainer: the policy's trainer (its `logprobs`, `scalar`, `accumulate`).
      state: the policy's state before this batch's update (W_b).
      one: the micro-batch normaliser, an f32[] 1 on the training mesh.
      totals: where the step's per-micro-batch figures go (None: a precompile run,
        nothing recorded).
      rows: this training process's share of a batch a target builds itself.
    """

    batch: int
    trainer: Trainer
    state: TrainState
    one: jax.Array
    totals: Totals | None
    rows: Rows = Rows()


class Trains(Protocol):
    """What a target trains and saves (the critic; an auxiliary loss adds to the policy's
    gradients); `NOTHING` for a target that only feeds the loss."""

    def init_accumulators(self) -> Accumulators:
        """Zeroed accumulators of what it trains ({} when it has none of its own)."""
        ...

    def accumulate(self, dev: TrainBatch, accs: Accumulators, micro: Micro) -> Accumulators:
        """The micro-batch's gradients added into `accs` (donated; the new ones back)."""
        ...

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        """Its optimizer step, after the policy's; the device metrics it adds to the row
        (prefixed with its name)."""
        ...

    def arrays(self) -> dict[str, Any]:
        """What a checkpoint saves of it, by entry name ({}: nothing)."""
        ...

    def restore(self, arrays: dict[str, Any]) -> None:
        """Takes back what `arrays` saved (read back into the same structure)."""
        ...


class _Nothing:
    """`Trains` of a target that trains and saves nothing."""

    def init_accumulators(self) -> Accumulators:
        return {}

    def accumulate(self, dev: TrainBatch, accs: Accumulators, micro: Micro) -> Accumulators:
        del dev, micro
        return accs

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        return accs, {}

    def arrays(self) -> dict[str, Any]:
        return {}

    def restore(self, arrays: dict[str, Any]) -> None:
        del arrays


NOTHING: Trains = _Nothing()


def unchanged(dev: TrainBatch, micro: Micro) -> TrainBatch:
    """`Target.fill` of a target that feeds the loss nothing."""
    del micro
    return dev


def no_row(totals: Totals, reduce: Reduce) -> dict[str, float]:
    """`Target.row` of a target that adds no figure."""
    del totals, reduce
    return {}


@dataclasses.dataclass(frozen=True)
class Target:
    """One thing the loss reads, or that trains beside the policy (module docstring).

    Attributes:
      name: its registry name (its checkpoint entry and its row figures' prefix).
      fill: the placed micro-batch with this target's inputs filled in, in the
        learner's target order (a later target reads what an earlier one filled);
        it may record per-micro-batch figures in `micro.totals[name]`.
      row: its host figures for the step's row, from what `fill` recorded.
      trains: what it trains and saves (`NOTHING`: it only feeds the loss).
    """

    name: str
    fill: Callable[[TrainBatch, Micro], TrainBatch] = unchanged
    row: Callable[[Totals, Reduce], dict[str, float]] = no_row
    trains: Trains = NOTHING


class Policy(Protocol):
    """What of the model is trained, saved and sent to generation (`policies.py`)."""

    name: str  # "full" or "lora"
    adapters_only: bool  # after W_0, generation is sent the adapters alone

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        """The trained model's config (LoRA: with its adapters)."""
        ...

    def complete(self, loaded: Params, trainer: Trainer, seed: int) -> Params:
        """Loaded weights (a model's, a checkpoint's: without adapters) as this policy's
        params (LoRA: new adapters, B = 0, on them)."""
        ...

    def saved(self, params: Params) -> Params:
        """What a checkpoint keeps of params (LoRA: the adapters)."""
        ...

    def restored(self, saved: Params, like: Params) -> Params:
        """`saved` back as whole params, the rest taken from `like` (LoRA: its base)."""
        ...


@dataclasses.dataclass(frozen=True)
class Context:
    """What a target's factory reads (`make_learner`)."""

    cfg: ExperimentConfig
    model_cfg: ModelConfig  # the policy's (in the training dtypes; LoRA: adapted)
    tokenizer: Tokenizer
    policy: Policy
    trainer: Trainer  # the policy's
    state: TrainState  # the policy's as the run starts (after any warm-up)
    problems: Sequence[Problem]  # the training problems (a target that reads data)
