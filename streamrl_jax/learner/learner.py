"""A `Learner`: the policy's trainer and state, and its targets (protocol.py).

The trainer loop drives one through five calls, the same whatever runs:
`place` (a host micro-batch onto the training mesh with every target's inputs),
`accumulate` (the policy's gradients and every trained target's), `apply` (the
optimizer steps), `row` (the targets' figures) and, for checkpoints, `checkpoint` /
`restore`. The learner owns every state it trains: nothing else assigns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from streamrl_jax.learner.protocol import (
    Accumulators,
    Metrics,
    Micro,
    Policy,
    Reduce,
    Rows,
    Target,
    Totals,
)
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params, Published

POLICY = "policy"  # the policy's accumulator in `Accumulators`


class Learner:
    """The policy and its targets (module docstring)."""

    def __init__(
        self, policy: Policy, trainer: Trainer, state: TrainState, targets: Sequence[Target]
    ):
        """Args:
        policy: its kind (what is trained, saved and sent).
        trainer: the policy's trainer.
        state: the policy's state as the run starts.
        targets: in fill order (`make_learner` builds them from the config).
        """
        self.policy, self.trainer, self._state = policy, trainer, state
        self.targets = tuple(targets)
        self.one = trainer.scalar(1.0)  # the micro-batch normaliser, on the training mesh
        # This training process's share of a batch a target builds (`set_rows`).
        self.rows = Rows()

    def set_rows(self, rows: Rows) -> None:
        """Several training processes: which rows of a target's own batches this one
        feeds, and how they reach the agreed shape (the run's training share)."""
        self.rows = rows

    @property
    def state(self) -> TrainState:
        """The policy's current TrainState (W_k and its optimizer state)."""
        return self._state

    def states(self) -> dict[str, Any]:
        """Every state it trains by name: the policy's ("policy") and each trained
        target's checkpoint entries (e.g. "critic")."""
        out: dict[str, Any] = {POLICY: self._state}
        for t in self.targets:
            out |= t.trains.arrays()
        return out

    # ------------------------------------------------------------------ micro-batches
    def _micro(self, batch: int, totals: Totals | None) -> Micro:
        return Micro(batch, self.trainer, self._state, self.one, totals, self.rows)

    def place(self, batch: int, host: TrainBatch, totals: Totals | None = None) -> TrainBatch:
        """Micro-batch `host` of batch `batch` on the training mesh, with every target's
        inputs filled in, in order; `totals` collects the targets' per-step figures
        (None: a precompile run's throwaway batch)."""
        dev = self.trainer.place_batch(host)
        micro = self._micro(batch, totals)
        for t in self.targets:
            dev = t.fill(dev, micro)
        return dev

    def init_accumulators(self) -> Accumulators:
        """Zeroed accumulators of the policy and of every trained target."""
        accs = {POLICY: self.trainer.init_accumulator()}
        for t in self.targets:
            accs |= t.trains.init_accumulators()
        return accs

    def accumulate(self, batch: int, dev: TrainBatch, accs: Accumulators) -> Accumulators:
        """The placed micro-batch's gradients (the policy's, then each target's) added
        into `accs` (donated); the new ones come back once computed (a deliberate sync
        point: the caller's trace span covers the compute, and it bounds the
        micro-batches queued)."""
        micro = self._micro(batch, None)
        acc, _ = self.trainer.accumulate(self._state, accs[POLICY], dev, self.one)
        accs = accs | {POLICY: acc}
        for t in self.targets:
            accs = t.trains.accumulate(dev, accs, micro)
        return jax.block_until_ready(accs)

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        """The optimizer steps: the policy's, then each trained target's; the zeroed
        accumulators and the step's device metrics (the targets' prefixed)."""
        self._state, acc, metrics = self.trainer.apply(self._state, accs[POLICY])
        accs = accs | {POLICY: acc}
        for t in self.targets:
            accs, m = t.trains.apply(accs)
            metrics = metrics | m
        return accs, metrics

    def row(self, totals: Totals, reduce: Reduce) -> dict[str, float]:
        """The targets' host figures of a step (every training process calls it)."""
        row: dict[str, float] = {}
        for t in self.targets:
            row |= t.row(totals, reduce)
        return row

    # ------------------------------------------------------------------ checkpoints
    def entries(self) -> list[str]:
        """The checkpoint entries of its trained targets (e.g. ["critic"]): a checkpoint
        written with one is not resumed without it, nor the other way round."""
        return sorted(name for t in self.targets for name in t.trains.arrays())

    def checkpoint(self) -> tuple[TrainState, dict[str, Any]]:
        """What a checkpoint saves: the policy's state (of its params, what the policy
        kind saves) and each trained target's entries."""
        state = self._state.replace(params=self.policy.saved(self._state.params))
        extra: dict[str, Any] = {}
        for t in self.targets:
            extra |= t.trains.arrays()
        return state, extra

    def restore(self, state: TrainState, extra: dict[str, Any]) -> None:
        """Takes back what `checkpoint` saved (read into the structures it gave)."""
        params = self.policy.restored(state.params, self._state.params)
        self._state = state.replace(params=params)
        for t in self.targets:
            t.trains.restore(extra)

    def saved_weights(self, params: Params) -> Params:
        """What a checkpoint keeps of published generation weights."""
        return self.policy.saved(params)

    def published(
        self, tree: Params, initial: Sequence[Published], version: int
    ) -> list[Published]:
        """Saved generation weights W_version (`saved_weights`) back on every generation
        instance, in the placement of `initial` (each instance's W_0)."""
        out = []
        for p in initial:
            dst = jax.tree.map(lambda x: x.sharding, self.policy.saved(p.params))
            params = self.policy.restored(jax.device_put(tree, dst), p.params)
            out.append(Published(params, version))
        return out
