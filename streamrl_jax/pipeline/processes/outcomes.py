"""The curriculum's outcomes across processes, in the coordination service's store.

The curriculum (`rollouts/curriculum.py`) weighs each prompt's draws by what its recent
groups taught: batch b draws with the outcomes of every step before g(b) applied. Across
processes the prompts are drawn by every generation process (each keeps its share) and
by every training process (its checkpoint records the iterator), while a step's groups
are trained by the training processes, each its own. So each training process publishes
its outcomes of step s under `curriculum/<s>/<index>` as it finishes the step (JSON:
[[prompt id, informative], ...]; the first also those of the prompts the step consumed
without training), and whoever draws reads every training process's list of each step
it needs, in training-process order. A training process finishes step s before it
publishes W_{s+1}, and a process draws batch b only once it holds W_{g(b)}, so the lists
a draw needs are there or on their way (the wait is bounded by `pipeline.timeout_s`).
"""

from __future__ import annotations

import json

from streamrl_jax.distributed import roles

KEY = "curriculum"


class StoreOutcomes:
    """`rollouts.Outcomes` over the run's board (`roles.Board`), for `trainers` training
    processes (set by the training link or generation process)."""

    def __init__(self, trainers: int = 1, board: roles.Board = roles.PROGRAM):
        self.trainers, self.board = trainers, board

    def publish(self, step: int, trainer: int, outcomes: list[tuple[str, bool]]) -> None:
        self.board.publish(
            f"{KEY}/{step}/{trainer}", json.dumps([[p, bool(ok)] for p, ok in outcomes])
        )

    def read(self, step: int, timeout_s: float) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        for t in range(self.trainers):
            text = self.board.lookup(f"{KEY}/{step}/{t}", timeout_s)
            try:
                pairs = json.loads(text)
                out += [(str(p), bool(ok)) for p, ok in pairs]
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"curriculum: {KEY}/{step}/{t}={text[:200]!r} is not a list of "
                    f"[prompt id, informative] ({e})"
                ) from e
        return out
