"""Supervision of a run: the failure latch, the watchdog, shutdown requests, thread joins.

* **Failure**: every thread of the pipeline reports an exception to the run's
  one `FailureLatch` (`Supervisor.fail`, or the latch itself for the generation
  driver); the first one wins and is logged, and its listeners fail the sample
  stream and the weight board and wake the driver's waits, so every other wait
  wakes at once. The run then ends with `PipelineError` naming the component.
* **Watchdog** (a thread this module owns): warns once per stall about a stage
  that has work but made no progress in `pipeline.watchdog_s` (it fails at
  `pipeline.timeout_s`, where the stalled wait raises), and turns a shutdown
  request (SIGINT/SIGTERM; the handler itself must not take locks) into a stop.
* **Threads**: `join` joins with the run's timeout and names any that did not stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from absl import logging

from streamrl_jax.config import PipelineSection
from streamrl_jax.mailbox import FailureLatch


class PipelineError(RuntimeError):
    """A component of the pipeline failed; `component` names it."""

    def __init__(self, component: str, exc: BaseException):
        super().__init__(f"{component} failed: {exc!r}")
        self.component = component


class Shutdown(RuntimeError):
    """SIGINT/SIGTERM asked the run to checkpoint and stop."""


def caused_by_shutdown(exc: BaseException) -> bool:
    """Whether `exc` is, or was raised from, a `Shutdown` (a wait that the stop ended,
    re-raised by the mailbox it waited on): a stop, not a failure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Shutdown):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class Supervisor:
    """The failure latch, progress ticks and the watchdog of one run."""

    def __init__(self, p: PipelineSection, shutdown: threading.Event | None = None):
        """`shutdown`: the event a stop request sets (runs that stop together share one:
        several learners); None: this run's own."""
        self.timeout = p.timeout_s
        self.watchdog_s = p.watchdog_s
        self.latch = FailureLatch("pipeline")
        self.latch.add_listener(
            lambda component, exc: logging.error("%s failed: %r", component, exc)
        )
        self.shutdown_requested = shutdown or threading.Event()
        self.alerts: list[str] = []  # stages the watchdog warned about
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t_start = time.monotonic()
        self._last: dict[str, float] = {}  # stage -> monotonic time of its last progress

    # ------------------------------------------------------------------ failure
    def fail(self, component: str, exc: BaseException) -> None:
        """Reports a failure; the first one is the run's (its listeners run once)."""
        self.latch.fail(component, exc)

    def raise_if_failed(self) -> None:
        """Raises `PipelineError` naming the first failed component, if any."""
        self.latch.raise_if_failed(PipelineError)

    # ------------------------------------------------------------------ watchdog
    def tick(self, stage: str) -> None:
        """`stage` made progress now."""
        with self._lock:
            self._last[stage] = time.monotonic()

    def watchdog(
        self, busy: Callable[[], dict[str, bool]], describe: Callable[[], str], stop: Callable[[]]
    ) -> threading.Thread:
        """Starts the watchdog thread.

        Args:
          busy: stage -> whether it has work now.
          describe: a one-line state for the warning (queue depths).
          stop: called once on a shutdown request (fails the stream and the board
            with `Shutdown`, which the trainer turns into a checkpointed stop).
        """
        thread = threading.Thread(
            target=self._watch, args=(busy, describe, stop), name="watchdog", daemon=True
        )
        thread.start()
        return thread

    def _watch(self, busy, describe, stop) -> None:
        limit, warned = self.watchdog_s, set()
        while not self._stop.wait(min(1.0, limit / 4)):
            if self.shutdown_requested.is_set():
                stop()
                return
            now = time.monotonic()
            with self._lock:
                last = dict(self._last)
            for stage, has_work in busy().items():
                idle = now - last.get(stage, self._t_start)
                if has_work and idle > limit and stage not in warned:
                    warned.add(stage)
                    self.alerts.append(stage)
                    logging.warning(
                        "watchdog: %s made no progress for %.0f s (%s); it fails at "
                        "pipeline.timeout_s=%.0f s",
                        stage,
                        idle,
                        describe(),
                        self.timeout,
                    )
                elif idle <= limit:
                    warned.discard(stage)

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        """Ends the watchdog."""
        self._stop.set()

    def join(self, threads: list[threading.Thread]) -> list[str]:
        """Joins `threads` with the run's timeout; returns the names still alive."""
        stalled = []
        for th in threads:
            th.join(self.timeout)
            if th.is_alive():
                stalled.append(th.name)
        return stalled

    def close_all(self, closers: list[tuple[str, Callable[[], object]]]) -> list[str]:
        """Runs every closer in order, whatever the others do; returns the names of those
        that timed out (other errors are logged: the run is already ending)."""
        stalled = []
        for name, close in closers:
            try:
                close()
            except TimeoutError:
                stalled.append(name)
            except BaseException as e:  # noqa: BLE001 - already failing or finished
                logging.warning("%s at shutdown: %r", name, e)
        return stalled
