"""Clean shutdown on SIGINT/SIGTERM: a flag the training loop polls at step boundaries."""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from absl import logging


@dataclasses.dataclass(eq=False)
class ShutdownRequest:
    """Set when SIGINT/SIGTERM arrives; the training loop polls it at safe points.

    Attributes:
      event: set by the first signal.
      signum: the signal received, or None.
    """

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    signum: int | None = None
    _previous: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def uninstall(self) -> None:
        """Puts the previous handlers back (main thread only)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def install_shutdown_handler(
    callback: Callable[[int], None] | None = None,
    *,
    signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM),
) -> ShutdownRequest:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop cleanly.

    The first signal sets `ShutdownRequest.event` and calls `callback(signum)`
    (it runs on the main thread between bytecodes: keep it short, e.g. set a
    stop flag; do the checkpoint from the loop). A second signal restores the
    previous handlers and re-raises, so a second Ctrl-C still kills.

    JAX and SIGTERM (jax 0.10.2, measured): a plain process keeps the default
    SIGTERM action (it dies, rc 143). `jax.distributed.initialize` installs
    the preemption notifier, a C-level SIGTERM handler that only logs
    "SIGTERM caught" and keeps running, while `signal.getsignal` still reports
    the old Python handler. A Python handler installed *after* `initialize`
    replaces the notifier; one installed before is silently replaced by it.
    So call this after `jax.distributed.initialize`, and use SIGKILL in harnesses
    that must kill.

    Args:
      callback: called with the signal number on the first signal.
      signals: the signals to handle.

    Raises:
      ValueError: called from a thread other than the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("install_shutdown_handler must be called from the main thread")
    request = ShutdownRequest()

    def handler(signum: int, frame: Any) -> None:
        if request.requested:
            logging.warning("second signal %d: stopping now", signum)
            request.uninstall()
            signal.raise_signal(signum)
            return
        logging.warning("signal %d: checkpointing and stopping at the next safe point", signum)
        request.signum = signum
        request.event.set()
        if callback is not None:
            callback(signum)

    for signum in signals:
        request._previous[signum] = signal.signal(signum, handler)
    return request
