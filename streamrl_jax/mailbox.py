"""The one mechanism for every queue and board: a closable, failable, timed `Mailbox`.

Every hand-off between threads in streamrl_jax goes through a `Mailbox`: the
generation service's finished samples, the grouping sample stream's ready
groups, the weight board's published versions, the sample server's received
samples, the weight receiver's pending weight set and a channel's credits.
Each owner keeps its own bookkeeping (partial groups, versions, credits) and
its own exception classes; the mailbox gives all of them the same semantics:

* FIFO of items, with an optional capacity measured in units (an item may
  weigh several: a group of samples); `put` blocks while the item does not
  fit (back-pressure), `get` / `get_many` while there is nothing to take.
* Every blocking call takes a timeout; its error names the mailbox and what
  it waited for, so a stall reports *which* component stalled.
* `fail(exc, component)` latches the first failure (a `FailureLatch`) and
  wakes every waiter; from then on every call raises it, before any queued
  item (fail fast: a failure is never hidden behind a backlog).
* `close(reason)` ends input: producers raise the closed error, consumers
  take what is left and then raise it.
* `wait_until(predicate)` waits, under the mailbox's lock, on state the owner
  keeps beside the queue (a version published, a credit granted); the owner
  changes that state inside `locked()`, which wakes the waiters.

`FailureLatch` is the one failure latch: the first failure wins and is kept
with the component that raised it; later ones are logged and dropped;
listeners run once on the first, so one latch can fail a stream, a board and
a driver at once.

Standard library only: this module sits below every other in the package.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
# A description of what a call waits for; a callable is evaluated under the
# lock when the error is raised, so it can report the state at that moment.
What = str | Callable[[], str]
Listener = Callable[[str, BaseException], None]
ErrorFactory = Callable[[str], BaseException]

_log = logging.getLogger(__name__)


class MailboxError(RuntimeError):
    """Base of the mailbox's default exceptions."""


class MailboxFailed(MailboxError):
    """The mailbox was failed; the original exception is chained."""


class MailboxClosed(MailboxError):
    """The mailbox was closed: a put after close, or a take with nothing left."""


class MailboxTimeout(MailboxError, TimeoutError):
    """A blocking call ran past its timeout; the message names what it waited for."""


class FailureLatch:
    """Holds the first failure of a group of components and tells listeners once.

    The first `fail` wins: its component name and exception are kept, the
    listeners are called with them (on the failing thread, in the order they
    were added) and `wait` returns. Later failures are logged and otherwise
    ignored, so the error a user sees is the cause, not a consequence.
    """

    def __init__(self, name: str = "failure latch"):
        self.name = name
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._first: tuple[str, BaseException] | None = None
        self._listeners: list[Listener] = []

    def fail(self, component: str, exc: BaseException) -> bool:
        """Records a failure of `component`.

        Returns:
          True for the first failure (the listeners were called), else False.

        Raises:
          TypeError: `exc` is not an exception (the arguments are swapped?).
        """
        if not isinstance(exc, BaseException) or not isinstance(component, str):
            raise TypeError(
                f"{self.name}: fail(component: str, exc: BaseException), got "
                f"({type(component).__name__}, {type(exc).__name__})"
            )
        with self._lock:
            first = self._first is None
            if first:
                self._first = (component, exc)
                listeners = list(self._listeners)
        if not first:  # usually a consequence of the first: kept out of the warnings
            _log.info(
                "%s: %s also failed (after %s): %r",
                self.name,
                component or "a component",
                self._first[0] or "the first failure",
                exc,
            )
            return False
        self._failed.set()
        for listener in listeners:
            self._call(listener, component, exc)
        return True

    def add_listener(self, listener: Listener) -> None:
        """Calls `listener(component, exc)` once on the first failure (at once if past)."""
        with self._lock:
            first = self._first
            if first is None:
                self._listeners.append(listener)
                return
        self._call(listener, *first)

    def _call(self, listener: Listener, component: str, exc: BaseException) -> None:
        try:
            listener(component, exc)
        except Exception:  # noqa: BLE001 - one listener must not keep the others from running
            _log.exception("%s: a failure listener raised", self.name)

    @property
    def failed(self) -> bool:
        return self._first is not None

    @property
    def error(self) -> BaseException | None:
        """The first failure's exception, or None."""
        first = self._first
        return None if first is None else first[1]

    @property
    def component(self) -> str | None:
        """The component that failed first, or None."""
        first = self._first
        return None if first is None else first[0]

    def raise_if_failed(
        self, wrap: Callable[[str, BaseException], BaseException] | None = None
    ) -> None:
        """Raises the first failure, if any.

        Args:
          wrap: builds the exception to raise from (component, exc); it is
            raised chained to `exc`. None raises `exc` itself.
        """
        first = self._first
        if first is None:
            return
        component, exc = first
        if wrap is None:
            raise exc
        raise wrap(component, exc) from exc

    def wait(self, timeout: float) -> bool:
        """Blocks up to `timeout` seconds for a failure; True if there is one."""
        return self._failed.wait(timeout)


@dataclasses.dataclass
class MailboxMetrics:
    """Counters since creation (a copy, taken under the lock)."""

    items_in: int = 0
    items_out: int = 0  # taken by get / get_many (not drained or removed)
    units_in: int = 0
    units_out: int = 0
    max_depth: int = 0  # most items queued at once
    producer_wait_s: float = 0.0  # time `put` spent blocked on back-pressure
    consumer_wait_s: float = 0.0  # time get / get_many / wait_until spent blocked


def _text(what: What) -> str:
    return what() if callable(what) else what


class Mailbox(Generic[T]):
    """A closable, failable, timed FIFO with an optional capacity in units.

    The exception classes (or any callables taking the message) let each
    owner keep its own vocabulary: `failed` builds the error raised after
    `fail` (chained to the original; None raises the original itself),
    `closed` the one after `close`, `timeout_error` the one after a timeout.
    """

    def __init__(
        self,
        name: str,
        *,
        capacity: int | None = None,
        failed: ErrorFactory | None = MailboxFailed,
        closed: ErrorFactory = MailboxClosed,
        timeout_error: ErrorFactory = MailboxTimeout,
    ):
        """Args:
        name: names the mailbox in every error.
        capacity: most units queued at once; None for no bound (the owner
          bounds it some other way, e.g. with credits).
        failed, closed, timeout_error: see the class docstring.
        """
        if capacity is not None and capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity}")
        self.name, self.capacity = name, capacity
        self._failed, self._closed, self._timeout = failed, closed, timeout_error
        # Reentrant, so an owner's `locked()` block may call put / get / wait_until
        # (a wait inside releases every level of the lock).
        self._cv = threading.Condition(threading.RLock())
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._size = 0
        self._closed_reason: str | None = None
        self._metrics = MailboxMetrics()
        self.latch = FailureLatch(name)
        self.latch.add_listener(lambda component, exc: self._wake())

    # ------------------------------------------------------------------ producer side
    def put(self, item: T, *, timeout: float, size: int = 1, what: What | None = None) -> None:
        """Appends `item` (weighing `size` units), blocking while it does not fit.

        Raises:
          failed: the mailbox was failed.
          closed: the mailbox was closed.
          timeout_error: still full after `timeout` seconds (names `what`,
            by default the room it waited for).
          ValueError: `size` can never fit.
        """
        with self._cv:
            if self._put(item, timeout, size):
                return
            self._raise(timeout, what or self._room_for(size), producer=True)

    def offer(self, item: T, *, timeout: float, size: int = 1) -> bool:
        """`put` that returns False instead of raising when the item was not accepted
        (still full after `timeout`, closed or failed)."""
        return self._put(item, timeout, size)

    def _put(self, item: T, timeout: float, size: int) -> bool:
        """Appends `item` once it fits; False if it did not (failed, closed, timeout)."""
        if size < 1 or (self.capacity is not None and size > self.capacity):
            raise ValueError(
                f"{self.name}: an item of {size} unit(s) can never fit (capacity {self.capacity})"
            )
        start = time.monotonic()
        with self._cv:
            ready = self._await(self._fits(size), timeout, producer=True)
            self._metrics.producer_wait_s += time.monotonic() - start
            if not ready:
                return False
            self._items.append((item, size))
            self._size += size
            m = self._metrics
            m.items_in, m.units_in = m.items_in + 1, m.units_in + size
            m.max_depth = max(m.max_depth, len(self._items))
            self._cv.notify_all()
            return True

    def _fits(self, size: int) -> Callable[[], bool]:
        return lambda: self.capacity is None or self._size + size <= self.capacity

    def _room_for(self, size: int) -> Callable[[], str]:
        return lambda: (
            f"room for {size} unit(s) ({self._size}/{self.capacity} used; "
            "back-pressure: the consumer is not taking items)"
        )

    # ------------------------------------------------------------------ consumer side
    def get(self, *, timeout: float, what: What = "an item") -> T:
        """Takes the oldest item, waiting up to `timeout` seconds for one.

        Raises:
          failed: the mailbox was failed (even if items are queued).
          closed: closed and nothing left.
          timeout_error: nothing arrived in time (names `what`).
        """
        return self.get_many(min_items=1, max_items=1, timeout=timeout, what=what)[0]

    def get_many(
        self,
        *,
        min_items: int = 1,
        max_items: int | None = None,
        timeout: float,
        what: What | None = None,
    ) -> list[T]:
        """Waits until `min_items` items are queued; takes up to `max_items`, oldest first.

        After `close`, takes what is left (possibly fewer than `min_items`).

        Raises:
          failed: the mailbox was failed (even if items are queued).
          closed: closed and nothing left.
          timeout_error: fewer than `min_items` arrived in time (names `what`).
          ValueError: `min_items` < 1 or `max_items` < `min_items`.
        """
        if min_items < 1 or (max_items is not None and max_items < min_items):
            raise ValueError(
                f"{self.name}: need 1 <= min_items <= max_items, got {min_items}, {max_items}"
            )
        start = time.monotonic()
        with self._cv:
            ready = self._await(
                lambda: (
                    len(self._items) >= min_items
                    or (self._closed_reason is not None and self._items)
                ),
                timeout,
                producer=False,
            )
            self._metrics.consumer_wait_s += time.monotonic() - start
            if not ready:
                self._raise(timeout, what or f"{min_items} item(s)", producer=False)
            take = len(self._items) if max_items is None else min(max_items, len(self._items))
            out = [self._items.popleft() for _ in range(take)]
            units = sum(size for _, size in out)
            self._size -= units
            m = self._metrics
            m.items_out, m.units_out = m.items_out + take, m.units_out + units
            self._cv.notify_all()
            return [item for item, _ in out]

    def wait_until(self, predicate: Callable[[], object], *, timeout: float, what: What) -> None:
        """Waits, under the mailbox's lock, until `predicate()` is true.

        For state the owner keeps beside the queue and changes inside
        `locked()`. The predicate runs under the lock; an exception it raises
        propagates to the caller.

        Raises:
          failed: the mailbox was failed (even if the predicate holds).
          closed: closed while the predicate did not hold.
          timeout_error: the predicate did not hold within `timeout` (names `what`).
        """
        start = time.monotonic()
        with self._cv:
            ready = self._await(predicate, timeout, producer=False)
            self._metrics.consumer_wait_s += time.monotonic() - start
            if not ready:
                self._raise(timeout, what, producer=False, waiting=True)

    # ------------------------------------------------------------------ control
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the mailbox's lock for the owner's own bookkeeping, then wakes every
        waiter (the block may have changed what a `wait_until` predicate reads)."""
        with self._cv:
            try:
                yield
            finally:
                self._cv.notify_all()

    def close(self, reason: str = "closed") -> None:
        """Ends input: later puts raise `closed`; takers drain what is left, then raise it.

        The first reason is kept and goes into the errors.
        """
        with self._cv:
            if self._closed_reason is None:
                self._closed_reason = reason
            self._cv.notify_all()

    def fail(self, exc: BaseException, component: str = "") -> bool:
        """Latches the first failure and wakes every waiter; True if this was the first."""
        return self.latch.fail(component, exc)

    def ensure_open(self) -> None:
        """Raises what a `put` would raise now (failed, then closed), without waiting."""
        with self._cv:
            self._raise_if_failed()
            if self._closed_reason is not None:
                raise self._closed(self._put_after_close())

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Removes and returns the queued items for which `predicate` holds, oldest first."""
        with self._cv:
            keep, out = collections.deque(), []
            for item, size in self._items:
                if predicate(item):
                    out.append(item)
                    self._size -= size
                else:
                    keep.append((item, size))
            self._items = keep
            self._cv.notify_all()
            return out

    def snapshot(self) -> list[T]:
        """The queued items, oldest first, left in place."""
        with self._cv:
            return [item for item, _ in self._items]

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    @property
    def size(self) -> int:
        """Units queued."""
        with self._cv:
            return self._size

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def error(self) -> BaseException | None:
        """The first failure, or None."""
        return self.latch.error

    @property
    def metrics(self) -> MailboxMetrics:
        with self._cv:
            return dataclasses.replace(self._metrics)

    # ------------------------------------------------------------------ internals
    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _await(self, ready: Callable[[], object], timeout: float, *, producer: bool) -> bool:
        """The one timed wait, under the lock: True once `ready()`; False on a
        failure (checked first), on close (for producers before `ready()`, for
        consumers after) or at the deadline. The caller then calls `_raise`
        without releasing the lock, so it sees the state that ended the wait."""
        deadline = time.monotonic() + timeout
        while True:
            if self.latch.failed or (producer and self._closed_reason is not None):
                return False
            if ready():
                return True
            remaining = deadline - time.monotonic()
            if self._closed_reason is not None or remaining <= 0:
                return False
            self._cv.wait(remaining)

    def _raise(self, timeout: float, what: What, *, producer: bool, waiting: bool = False):
        """Raises the owner's error for why `_await` returned False: failed, closed, or
        (neither) the timeout."""
        self._raise_if_failed()
        if self._closed_reason is not None:
            if producer:
                raise self._closed(self._put_after_close())
            if waiting:
                raise self._closed(
                    f"{self.name}: {self._closed_reason} while waiting for {_text(what)}"
                )
            raise self._closed(f"{self.name}: {self._closed_reason} (nothing left to take)")
        raise self._timeout(f"{self.name}: timed out after {timeout:g} s waiting for {_text(what)}")

    def _put_after_close(self) -> str:
        return f"{self.name}: put after close ({self._closed_reason})"

    def _raise_if_failed(self) -> None:
        if self._failed is None:
            self.latch.raise_if_failed()
        else:
            self.latch.raise_if_failed(self._wrap)

    def _wrap(self, component: str, exc: BaseException) -> BaseException:
        who = f"{component} failed" if component else "failed"
        return self._failed(f"{self.name}: {who}: {exc!r}")
