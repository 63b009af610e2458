"""Dynamic sampling's verdicts across processes, in the coordination service's store.

Every generation process judges the groups it generated (`rollouts/dynamic_sampling.py`)
and publishes each verdict under `verdicts/<batch>/<group>` ("1 <prompt id>":
informative, "0 <prompt id>": skipped). Every process reads a batch's verdicts to
decide its refill rounds: the generation processes to draw and submit their share of
each round, the training processes to draw the same prompts (their prompt iterator and
checkpoint record stay the generation processes') and to know which groups the step
trains. A round's size depends only on the verdicts, so every process draws the same
prompts whatever the timing; a lost process's groups generated again by another
(`roster.py`) are published again with the same verdict (overwrite: the reward is
deterministic). The first training process publishes how many refills each batch
drew once it trained it (`verdicts/drawn/<batch>`: a restarted generation process moves
its prompt iterator past the batches before the one it rejoins at), and drops a batch's
verdicts (`forget`) `pipeline.staleness + 2` steps later, past the window in which a
generation process may still be settling it.
"""

from __future__ import annotations

import contextlib

from streamrl_jax.distributed import roles

KEY = "verdicts"


class StoreVerdicts:
    """`rollouts.Verdicts` over the run's board (`roles.Board`: the program's, or a
    learner's)."""

    def __init__(self, board: roles.Board = roles.PROGRAM):
        self.board = board

    def publish(self, batch: int, group: int, informative: bool, prompt_id: str) -> None:
        value = f"{int(informative)} {prompt_id}"
        self.board.publish(f"{KEY}/{batch}/{group}", value, overwrite=True)

    def read(self, batch: int) -> dict[int, tuple[bool, str]]:
        out = {}
        for group, value in self.board.lookup_all(f"{KEY}/{batch}").items():
            flag, _, prompt_id = value.partition(" ")
            if not group.isdigit() or flag not in ("0", "1") or not prompt_id:
                raise ValueError(f"verdicts: {KEY}/{batch}/{group}={value!r} is not a verdict")
            out[int(group)] = (flag == "1", prompt_id)
        return out

    def wait(self, batch: int, group: int, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):  # the caller checks its own deadline
            self.board.lookup(f"{KEY}/{batch}/{group}", timeout_s)

    def forget(self, batch: int) -> None:
        self.board.forget(f"{KEY}/{batch}")

    def settled(self, batch: int, draws: int) -> None:
        self.board.publish(f"{KEY}/drawn/{batch}", str(draws), overwrite=True)

    def drawn(self, batch: int, timeout_s: float) -> int:
        """The refills `batch` drew, once a training process trained it (waits)."""
        value = self.board.lookup(f"{KEY}/drawn/{batch}", timeout_s)
        if not value.isdigit():
            raise ValueError(f"verdicts: {KEY}/drawn/{batch}={value!r} is not a count")
        return int(value)
