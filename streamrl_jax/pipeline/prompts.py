"""Where a run's prompts come from: the seeded pipeline, drawn batch by batch and recorded.

`PromptSource` wraps the run's `data.PromptPipeline` (one per process; every process
of a multi-controller run draws the same seeded sequence). A rollout draws each
batch's prompts through it (`draw(batch, n)`, called again for a batch's refills),
and it records what a checkpoint at a step boundary needs to continue exactly:

* the pipeline's iterator state at the start of each batch drawn (`state_at(k)`);
* the prompt ids each batch drew, in order (`drawn_from(k)`: the batches a resumed
  run must draw again, checked against what it draws then).

A resumed run's source starts from a checkpoint (`restore`): the iterator at the
checkpoint's batch, and the ids each in-flight batch must draw again; a draw that
differs is an error naming the batch (the prompt iterator state does not match the
checkpoint). The checkpoint may have been written while a batch was still being
refilled, so it records a prefix of that batch's draws: a resumed draw is checked
against whatever part of the record it covers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from streamrl_jax.data import Prompt, PromptPipeline


class Prompts(Protocol):
    """What a rollout draws its batches' prompts from (`PromptSource`, or a
    curriculum's selection over one)."""

    def draw(self, batch: int, n: int) -> list[Prompt]:
        """The next `n` prompts of `batch` (a batch may draw again: its refills)."""


class PromptSource:
    """The run's prompt pipeline, drawn by batch and recorded (module docstring).
    Thread-safe: the driver draws while the trainer saves checkpoints."""

    def __init__(self, pipeline: PromptPipeline):
        self.pipeline = pipeline
        self._lock = threading.Lock()
        self._state: dict[int, dict[str, Any]] = {}  # batch -> iterator state before it
        self._ids: dict[int, list[str]] = {}  # batch -> prompt ids drawn for it, in order
        self._expected: dict[int, list[str]] = {}  # a resumed run's record of its batches

    def draw(self, batch: int, n: int) -> list[Prompt]:
        """The next `n` prompts, recorded as `batch`'s (after any it drew before).

        Raises:
          RuntimeError: a resumed run drew other prompts than its checkpoint recorded.
        """
        with self._lock:
            self._state.setdefault(batch, self.pipeline.get_state())
            prompts = self.pipeline.next_prompts(n)
            ids = self._ids.setdefault(batch, [])
            first = len(ids)
            ids.extend(p.problem.prompt_id for p in prompts)
            want = self._expected.get(batch, [])[first : first + n]
            got = ids[first : first + len(want)]
            if got != want:
                raise RuntimeError(
                    f"resume: batch {batch} drew prompts {got[:3]}... as its draws {first}.., "
                    f"the checkpoint recorded {want[:3]}... (prompt iterator state does not "
                    "match the checkpoint)"
                )
        return prompts

    def skip_to(self, batch: int, n: Callable[[int], int], first: int) -> None:
        """Draws and drops batches `first` .. `batch` - 1, `n(b)` prompts of batch b: a
        restarted generation process moves its pipeline to the batch it rejoins at (and
        draws from there with no record to match)."""
        counts = [n(b) for b in range(first, batch)]  # may wait: not under the lock
        with self._lock:
            for count in counts:
                self.pipeline.next_prompts(count)
            self._expected = {}

    def preview(self, batches: Iterable[int], n: int) -> dict[int, list[int]]:
        """The prompt lengths (n per batch) the next draws, of `batches` in order, will
        give, without drawing them: the iterator's state is put back (`pipeline.precompile`
        plans from it before anything is drawn)."""
        with self._lock:
            state = self.pipeline.get_state()
            try:
                return {b: [len(q.tokens) for q in self.pipeline.next_prompts(n)] for b in batches}
            finally:
                self.pipeline.set_state(state)

    # ------------------------------------------------------------------ checkpoints
    def state_at(self, k: int) -> dict[str, Any]:
        """The iterator state at the start of batch k: recorded if batch k was drawn, else
        the current one (exactly batches < k have been drawn)."""
        with self._lock:
            return self._state.get(k) or self.pipeline.get_state()

    def drawn_from(self, k: int) -> dict[int, list[str]]:
        """Prompt ids of the batches >= k drawn so far (what a resumed run draws again)."""
        with self._lock:
            return {b: list(ids) for b, ids in self._ids.items() if b >= k}

    def forget_below(self, k: int) -> None:
        """Batches below k are trained and checkpointed: their records go."""
        with self._lock:
            for record in (self._state, self._ids, self._expected):
                for b in [b for b in record if b < k]:
                    del record[b]

    def restore(self, state: dict[str, Any], expected: dict[int, list[str]]) -> None:
        """A resumed run: the iterator at the checkpoint's batch, and the ids each batch
        drawn before the checkpoint must draw again."""
        with self._lock:
            self.pipeline.set_state(state)
            self._expected = {int(b): list(ids) for b, ids in expected.items()}
