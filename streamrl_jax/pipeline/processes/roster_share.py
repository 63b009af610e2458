"""A generation process's share of the work under the trainer's roster (`roster.py`).

The first training process publishes every change of the roster (a generation
process lost, back, or activated) under `roster/<epoch>`, epochs 1, 2, ... A
generation process applies them in order to its `RosterShare` (the driver's `Share`),
from two places: a `roster-watcher` thread (a loss must be taken up while the driver
waits for weights) and the driver itself before it draws each batch (`before_draw`:
an elastic activation names the batch it starts from, and the trainer publishes it
before the weights that batch needs). Each epoch is applied once, by whichever reads
it first. A restarted process first waits for the update that takes it back
(`rejoin`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from absl import logging

from streamrl_jax.distributed import roles
from streamrl_jax.generation.types import GenerationRequest
from streamrl_jax.pipeline.processes.roster import (
    ROSTER_KEY,
    RosterUpdate,
    owner,
    regenerate,
)


def last_epoch(board: roles.Board = roles.PROGRAM) -> int:
    """The newest roster epoch published so far on `board` (0: none)."""
    epoch = 0
    while board.try_lookup(f"{ROSTER_KEY}/{epoch + 1}") is not None:
        epoch += 1
    return epoch


def rejoin(
    pid: int, after: int, timeout: float, board: roles.Board = roles.PROGRAM
) -> RosterUpdate:
    """A restarted process: the trainer's roster update that takes it back, published
    once its weight channel is connected again, so after epoch `after` (read before
    this process dialed)."""
    deadline, epoch = time.monotonic() + timeout, after + 1
    while time.monotonic() < deadline:
        try:
            update = RosterUpdate.decode(board.lookup(f"{ROSTER_KEY}/{epoch}", 1.0))
        except TimeoutError:
            continue
        if pid not in update.lost:
            logging.warning(
                "generation-%d: rejoined the run at batch %d (roster epoch %d)",
                pid,
                update.floor,
                update.epoch,
            )
            return update
        epoch += 1
    raise TimeoutError(
        f"generation-{pid}: restarted, but the training process did not take it "
        f"back (no roster update after epoch {epoch - 1}) within {timeout:.0f} s"
    )


class RosterShare:
    """A generation process's `Share` (`driver.py`): the groups and held-out prompts it
    owns under the roster in force, and what it must generate again when the roster
    changes. Thread-safe: the driver, the collector's owner and the watcher use it.

    Ownership (roster.py): index k mod G while no process is lost, among the live ones
    after; the reserved (elastic) processes own nothing of a batch before their
    activation's. Each update after `roster` (the one in force) is applied once, in
    order, by whichever reader sees it first: the driver before it draws each batch
    (`before_draw`), or the `roster-watcher` thread (`start_watcher`: a loss must be
    taken up while the driver waits for weights).
    """

    def __init__(
        self,
        pid: int,
        share: tuple[int, int],
        roster: RosterUpdate,
        versions: Callable[[int], int],
        keep: int,
        board: roles.Board = roles.PROGRAM,
    ):
        """`share`: (k, G), this process's index among the G generation processes;
        `versions`: g(b), the policy version batch b is generated with; `keep`: batches
        of requests kept for generating again (the trainer is at most `keep - 1` batches
        behind the driver); `board`: where the run's roster updates are published."""
        self.pid, (self.k, self.g), self.keep_batches = pid, share, keep
        self.board = board
        self.versions = versions
        self.roster = roster
        self._lock = threading.Lock()
        self._epoch = roster.epoch + 1  # the next epoch to read
        self._drawn: dict[int, list[GenerationRequest]] = {}  # batch -> its requests (all)
        self._held_out: dict[int, list[GenerationRequest]] = {}  # version -> its requests
        self._held_out_batch: dict[int, int] = {}  # held-out version -> batch drawn at
        self._again: dict[int, list[GenerationRequest]] = {}  # version -> to generate again

    # ------------------------------------------------------------------ Share
    def _mine(self, index: int, batch: int) -> bool:
        return owner(index, self.g, self.roster.lost_at(batch)) == self.k

    def keep(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Keeps a drawn batch's requests (all shares) a few batches; returns this
        process's share under the current roster."""
        with self._lock:
            self._drawn.setdefault(batch, []).extend(requests)  # refills add groups
            for b in [b for b in self._drawn if b < batch - self.keep_batches]:
                del self._drawn[b]
            return [r for r in requests if self._mine(r.tag.group, batch)]

    def keep_held_out(
        self, version: int, batch: int, requests: list[GenerationRequest]
    ) -> list[GenerationRequest]:
        with self._lock:
            self._held_out[version] = requests
            self._held_out_batch[version] = batch
            return [r for r in requests if self._mine(r.tag.group, batch)]

    def again(self) -> dict[int, list[GenerationRequest]]:
        with self._lock:
            again, self._again = self._again, {}
        return again

    def before_draw(self, batch: int) -> None:
        """The driver, before it draws `batch` (holding W_{g(batch)}): applies every
        update published so far (roster.py: every process splits the batch alike)."""
        del batch
        while True:
            epoch = self._epoch
            if not self._apply(self.board.try_lookup(f"{ROSTER_KEY}/{epoch}"), epoch):
                return

    # ------------------------------------------------------------------ roster updates
    def lose(self, update: RosterUpdate) -> int:
        """A new roster (a generation process lost, back, or activated): queues the
        requests of batches and held-out versions already drawn that this process owns
        now and did not, except what the trainer already has. Returns how many."""
        k, g = self.k, self.g
        n = 0
        with self._lock:
            before, self.roster = self.roster, update
            for b, requests in self._drawn.items():
                if b < update.floor:
                    continue
                have = set(update.complete.get(b, ()))
                groups = {r.tag.group for r in requests} - have
                mine = set(regenerate(groups, k, g, before.lost_at(b), update.lost_at(b)))
                again = [r for r in requests if r.tag.group in mine]
                self._again.setdefault(self.versions(b), []).extend(again)
                n += len(again)
            for v, requests in self._held_out.items():
                if v in update.evals_done:
                    continue
                have = set(update.evals.get(v, ()))
                at = self._held_out_batch[v]
                indices = [r.tag.group for r in requests]
                mine = set(regenerate(indices, k, g, before.lost_at(at), update.lost_at(at)))
                again = [r for r in requests if r.tag.group in mine - have]
                self._again.setdefault(v, []).extend(again)
                n += len(again)
        return n

    def _apply(self, text: str | None, epoch: int) -> bool:
        """Applies update `epoch` (its published `text`, None if there is none yet)
        unless the other reader did. False when there was nothing to apply."""
        if text is None:
            return False
        with self._lock:
            if self._epoch != epoch:
                return True  # the other reader applied it
            self._epoch = epoch + 1
        update = RosterUpdate.decode(text)
        n = self.lose(update)
        active = {r: b for r, b in update.active_from.items() if r not in update.lost}
        logging.warning(
            "generation-%d: roster epoch %d, generation processes %s lost, reserved %s "
            "active from batch %s: generating %d requests again",
            self.pid,
            update.epoch,
            list(update.lost),
            list(update.reserved),
            active,
            n,
        )
        return True

    def start_watcher(
        self, stopping: threading.Event, fail: Callable[[BaseException], None]
    ) -> threading.Thread:
        """The `roster-watcher` thread: applies each update as it is published until
        `stopping`; an error goes to `fail` and ends it."""

        def watch() -> None:
            while not stopping.is_set():
                epoch = self._epoch
                try:
                    text = self.board.lookup(f"{ROSTER_KEY}/{epoch}", 1.0)
                except TimeoutError:
                    continue
                try:
                    self._apply(text, epoch)
                except Exception as e:  # noqa: BLE001 - reported to the owner
                    fail(e)
                    return

        thread = threading.Thread(target=watch, name="roster-watcher", daemon=True)
        thread.start()
        return thread
