"""A generation process's view of the trainer's roster (`roster.py`, `roster/<epoch>`).

The first training process publishes every change of the roster (a generation
process lost, back, or activated) under `roster/<epoch>`, epochs 1, 2, ... A
generation process applies them in order to its driver (`GenerationDriver.lose`),
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
from streamrl_jax.pipeline.driver import GenerationDriver
from streamrl_jax.pipeline.roster import ROSTER_KEY, RosterUpdate


def last_epoch() -> int:
    """The newest roster epoch published so far (0: none)."""
    epoch = 0
    while roles.try_lookup(f"{ROSTER_KEY}/{epoch + 1}") is not None:
        epoch += 1
    return epoch


def rejoin(pid: int, after: int, timeout: float) -> RosterUpdate:
    """A restarted process: the trainer's roster update that takes it back, published
    once its weight channel is connected again, so after epoch `after` (read before
    this process dialed)."""
    deadline, epoch = time.monotonic() + timeout, after + 1
    while time.monotonic() < deadline:
        try:
            update = RosterUpdate.decode(roles.lookup(f"{ROSTER_KEY}/{epoch}", 1.0))
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


class RosterReader:
    """Applies the roster updates after `roster` (the one in force) to `driver`, once
    each, in order; `driver.before_draw` is set to read them before every draw."""

    def __init__(self, pid: int, driver: GenerationDriver, roster: RosterUpdate):
        self.pid, self.driver = pid, driver
        self._lock = threading.Lock()
        self._epoch = roster.epoch + 1  # the next epoch to read
        driver.roster = roster
        driver.before_draw = self.before_draw

    def _apply(self, text: str | None, epoch: int) -> bool:
        """Hands update `epoch` (its published `text`, None if there is none yet) to the
        driver unless the other reader did. False when there was nothing to apply."""
        if text is None:
            return False
        with self._lock:
            if self._epoch != epoch:
                return True  # the other reader applied it
            update = RosterUpdate.decode(text)
            n = self.driver.lose(update)
            self._epoch = epoch + 1
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

    def before_draw(self, batch: int) -> None:
        """The driver, before it draws `batch` (holding W_{g(batch)}): applies every
        update published so far (roster.py: every process splits the batch alike)."""
        del batch
        while True:
            epoch = self._epoch
            if not self._apply(roles.try_lookup(f"{ROSTER_KEY}/{epoch}"), epoch):
                return

    def start_watcher(
        self, stopping: threading.Event, fail: Callable[[BaseException], None]
    ) -> threading.Thread:
        """The `roster-watcher` thread: applies each update as it is published until
        `stopping`; an error goes to `fail` and ends it."""

        def watch() -> None:
            while not stopping.is_set():
                epoch = self._epoch
                try:
                    text = roles.lookup(f"{ROSTER_KEY}/{epoch}", 1.0)
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
