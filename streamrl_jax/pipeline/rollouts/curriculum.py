"""An online difficulty curriculum over any rollout: prompts that taught nothing are drawn less.

`pipeline.rollout="curriculum+<kind>"` (e.g. `curriculum+dynamic_sampling`) wraps the
rollout `<kind>`: every prompt that kind draws comes through the curriculum, and
everything else is the inner kind's.

**Signal.** A group whose samples were all right or all wrong gives GRPO no
gradient (its advantages are zero); a group with both teaches. Each prompt keeps a
weight w in [floor, 1], 1 to start: a trained group whose `correct` values vary
sets it back to 1; a group that was all right or all wrong (trained, or skipped by
dynamic sampling for want of reward variance) multiplies it by
`pipeline.curriculum_decay`, never below `pipeline.curriculum_floor`.

**Draws.** The prompt pipeline still deals each epoch's prompts once, in its seeded
order. The curriculum takes them one at a time: a prompt is drawn with probability
w, else it is *passed over* for this epoch (the uniform number is a hash of the run
seed, the prompt id and its position in the pipeline, so it is the same in every
process and after a resume). The floor keeps every prompt drawn with probability at
least `floor` per epoch: nothing starves.

**Accounting, exactly once per epoch.** Every prompt the pipeline deals appears in
`consumed.jsonl` exactly once per epoch: at the step of the batch that trained its
group, or (skipped by the inner kind, or passed over here) at the step of the batch
that drew it (`StepOutcome.consumed`). `consumed.jsonl` therefore still lists each
epoch's prompts once however often a run was killed and resumed
(`tools/fault_drill.py`).

**Determinism.** The draws of batch b use the weights updated from the groups of
the steps before g(b) only (the steps whose W_{g(b)} generation had to wait for), in
step order, so they do not depend on timing: a run of one seed and mode draws the same
prompts every time, and a resumed run (its state is the weights as of g(k) for a
checkpoint at step k, and the groups of the steps after) draws what the first run drew.

**Across processes** every generation process draws every batch (and keeps its share),
and every training process draws it too (its checkpoints record the iterator; it draws
through the rollout, so through the curriculum), while each training process trains
only its own groups. So a training process does not observe its step's outcomes: it
publishes them (`RolloutContext.outcomes`, `processes/outcomes.py`; the first training
process also the prompts the step consumed without training), and every process's
weights read each step's lists from every training process, in training-process order,
when a draw (or a checkpoint) first needs that step. A training process finishes step s
before it publishes W_{s+1}, and batch b is drawn only by a process holding W_{g(b)}, so
what a draw needs is published or on its way. With one training process the weights
are exactly one process's; with several, a step's outcomes come in another order (the
same prompts and verdicts: only a prompt twice in one step could differ).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streamrl_jax.data import Prompt
from streamrl_jax.generation.types import Sample
from streamrl_jax.pipeline.micro_batches import Group
from streamrl_jax.pipeline.prompts import Prompts
from streamrl_jax.pipeline.rollouts.protocol import (
    Outcomes,
    Rollout,
    RolloutContext,
    StepOutcome,
    Wrapper,
)


def accept_draw(seed: int, prompt_id: str, position: int) -> float:
    """The uniform number in [0, 1) that decides a prompt's draw at `position` (its index
    among the prompts the pipeline dealt): the same in every process and every resume."""
    digest = hashlib.blake2b(f"{seed}/{prompt_id}/{position}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") / 2.0**64


class Weights:
    """Per-prompt draw probabilities as of a step (module docstring). Thread-safe.

    `observe(step, outcomes)` records the groups of a step; `upto(step)` moves the view
    the draws read to "every step below `step` applied", in step order. A checkpoint at
    boundary k keeps the weights as of g(k) (the oldest a resumed run draws with) and
    the outcomes of the steps after it (`state`), so a resumed run's draws see exactly
    what the first run's did.
    """

    def __init__(
        self,
        decay: float,
        floor: float,
        outcomes: Outcomes | None = None,
        timeout_s: float = 0.0,
    ):
        """`outcomes`: across processes, where every training process's outcomes of a
        step are read (each step once, when a view or a checkpoint first needs it)."""
        self.decay, self.floor = decay, floor
        self.outcomes, self.timeout = outcomes, timeout_s
        self._fetched: set[int] = set()  # steps read from `outcomes`
        self._lock = threading.Lock()
        self._base: dict[str, float] = {}  # every step below `_base_step` applied
        self._base_step = 0
        self._log: dict[int, list[tuple[str, bool]]] = {}  # step >= _base_step -> outcomes
        self._view: dict[str, float] = {}  # every step below `_view_step` applied
        self._view_step = 0

    def _apply(self, w: dict[str, float], step: int) -> None:
        for prompt_id, informative in self._log.get(step, []):
            old = w.get(prompt_id, 1.0)
            w[prompt_id] = 1.0 if informative else max(self.floor, old * self.decay)

    def observe(self, step: int, outcomes: list[tuple[str, bool]]) -> None:
        with self._lock:
            self._log.setdefault(step, []).extend(outcomes)

    def _fetch(self, below: int) -> None:
        """Across processes: every step below `below` not read yet, from `outcomes`
        (outside the lock: it waits for the training processes)."""
        if self.outcomes is None:
            return
        with self._lock:
            start = self._base_step
            missing = [s for s in range(start, below) if s not in self._fetched]
        for s in missing:
            got = self.outcomes.read(s, self.timeout)
            with self._lock:
                if s not in self._fetched:
                    self._fetched.add(s)
                    self._log[s] = got

    def upto(self, step: int) -> None:
        """The draws from now on read the weights with every step below `step` applied."""
        self._fetch(step)
        with self._lock:
            if step < self._view_step:  # never in a run (g(b) only grows): rebuild
                self._view, self._view_step = dict(self._base), self._base_step
            while self._view_step < step:
                self._apply(self._view, self._view_step)
                self._view_step += 1

    def get(self, prompt_id: str) -> float:
        with self._lock:
            return self._view.get(prompt_id, 1.0)

    def stats(self) -> dict[str, float]:
        """Of the prompts the draws have seen outcomes of: how many are below 1, and the
        mean weight."""
        with self._lock:
            w = np.asarray(list(self._view.values()) or [1.0])
        return {"curriculum_down": float((w < 1.0).sum()), "curriculum_weight": float(w.mean())}

    def state(self, oldest: int, upto: int = 0) -> dict[str, Any]:
        """JSON: the weights as of step `oldest` (no draw asks for older ones any more)
        and the outcomes of the steps from it on (across processes, read up to `upto`:
        every step before the checkpoint's boundary, which a resumed run cannot read
        again)."""
        self._fetch(max(oldest, upto))
        with self._lock:
            while self._base_step < oldest:
                self._apply(self._base, self._base_step)
                self._log.pop(self._base_step, None)
                self._base_step += 1
            return {
                "base_step": self._base_step,
                "base": dict(self._base),
                "log": {str(k): [list(o) for o in v] for k, v in sorted(self._log.items())},
            }

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._base = {str(k): float(v) for k, v in state.get("base", {}).items()}
            self._base_step = int(state.get("base_step", 0))
            self._log = {
                int(k): [(str(pid), bool(ok)) for pid, ok in v]
                for k, v in state.get("log", {}).items()
            }
            self._view, self._view_step = dict(self._base), self._base_step
            # Across processes: the checkpoint's log holds every step before its boundary
            # (`state`'s `upto`), read from a store that is gone; later ones are read.
            self._fetched = set(self._log)


class CurriculumPrompts:
    """The inner rollout's `Prompts`: each prompt the pipeline deals is drawn with its
    weight's probability, else passed over (recorded against the batch that dealt it)."""

    def __init__(self, source: Prompts, weights: Weights, seed: int, version: Callable[[int], int]):
        self.source, self.weights, self.seed, self.version = source, weights, seed, version
        self._lock = threading.Lock()
        self._position = 0  # prompts dealt by the pipeline through this object
        self._first: dict[int, int] = {}  # batch -> position at its first draw
        self._passed: dict[int, list[str]] = {}  # batch -> prompt ids passed over

    def draw(self, batch: int, n: int) -> list[Prompt]:
        self.weights.upto(self.version(batch))  # the steps W_g(b) waited for
        out: list[Prompt] = []
        while len(out) < n:
            (prompt,) = self.source.draw(batch, 1)
            pid = prompt.problem.prompt_id
            with self._lock:
                position = self._position
                self._first.setdefault(batch, position)
                self._position += 1
            if accept_draw(self.seed, pid, position) < self.weights.get(pid):
                out.append(prompt)
            else:
                with self._lock:
                    self._passed.setdefault(batch, []).append(pid)
        return out

    def take_passed(self, batch: int) -> list[str]:
        """The prompts batch `batch` passed over (once: they are consumed at its step)."""
        with self._lock:
            return self._passed.pop(batch, [])

    def state(self, k: int) -> dict[str, Any]:
        """The pipeline position at the start of batch k."""
        with self._lock:
            for b in [b for b in self._first if b < k]:
                del self._first[b]
            return {"position": self._first.get(k, self._position)}

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._position = int(state.get("position", 0))


class Curriculum(Wrapper):
    """The curriculum around an inner rollout, built from the same context but drawing
    through the curriculum (module docstring)."""

    def __init__(self, ctx: RolloutContext, inner: Callable[[RolloutContext], Rollout]):
        p = ctx.pipeline
        self.ctx = ctx
        self.weights = Weights(p.curriculum_decay, p.curriculum_floor, ctx.outcomes, p.timeout_s)
        self.prompts = CurriculumPrompts(
            ctx.prompts, self.weights, ctx.seed, ctx.schedule.generation_version
        )
        super().__init__(inner(dataclasses.replace(ctx, prompts=self.prompts)))
        self.version = ctx.schedule.generation_version
        self._lock = threading.Lock()
        self._seen: dict[int, list[tuple[str, bool]]] = {}  # step -> its trained groups

    # ------------------------------------------------------------------ trainer side
    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        for groups in self.inner.micro_batches(batch, mini):
            outcomes = [
                (g[0].sample.tag.prompt_id, len({s.reward.correct for s in g}) > 1) for g in groups
            ]
            with self._lock:
                self._seen.setdefault(batch, []).extend(outcomes)
            yield groups

    def finish(self, batch: int) -> StepOutcome:
        out = self.inner.finish(batch)
        with self._lock:
            trained = self._seen.pop(batch, [])
        # Consumed without training: skipped by the inner kind (no reward variance).
        skipped = [(pid, False) for pid in out.consumed]
        if self.ctx.outcomes is None:
            self.weights.observe(batch, trained + skipped)
        else:  # across processes: every process reads every trainer's (the first: skips)
            index = self.ctx.trainers.index
            self.ctx.outcomes.publish(batch, index, trained + (skipped if index == 0 else []))
        passed = self.prompts.take_passed(batch)
        metrics = out.metrics | self.weights.stats() | {"curriculum_passed": float(len(passed))}
        return StepOutcome(metrics=metrics, consumed=out.consumed + passed)

    def plannable(self, start: int, steps: int) -> range | None:
        del start, steps
        return None  # the draws depend on the rewards

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        return {
            "inner": self.inner.state(k),
            "weights": self.weights.state(self.version(k), upto=k),
            "prompts": self.prompts.state(k),
        }

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        self.weights.restore(state.get("weights", {}))
        self.prompts.restore(state.get("prompts", {}))
        return self.inner.restore(k, state.get("inner", {}))
