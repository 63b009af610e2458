"""Bounded, thread-safe, closeable stream of versioned samples, released by group.

Producers (generation instances) `put` each finished sample; the stream holds
it until its GRPO group is complete (all `group_size` samples of one prompt)
and then makes the group ready. The consumer (the trainer loop) takes ready
groups with `get_groups(min_groups, max_groups, timeout)`: dynamic-batch
pipelining takes whatever complete groups are there once at least
`min_groups` are.

Back-pressure: `capacity` bounds the number of samples in *ready* groups; a
`put` that would complete a group beyond it blocks until the consumer takes
some. Incomplete groups are not counted: they are bounded by what was
submitted to generation, and counting them could deadlock a full stream that
waits for the last sample of a group.

Failure: `fail(exc, component)` (a producer's error) or `close()` wake every
waiter; the consumer's next `get_groups` raises `StreamError` naming the
component that failed, with the original exception chained. Every blocking
call takes a timeout and raises `StreamTimeout` naming the stream and what it
waited for — nothing here waits forever.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StreamError(RuntimeError):
    """A producer failed or the stream was closed while someone waited on it."""


class StreamTimeout(TimeoutError):
    """A blocking call on the stream ran past its timeout."""


@dataclasses.dataclass
class StreamMetrics:
    """Counters since creation (host side, read under the lock)."""

    samples_in: int = 0
    groups_out: int = 0
    samples_out: int = 0
    max_ready_depth: int = 0
    consumer_wait_s: float = 0.0  # time `get_groups` spent blocked
    producer_wait_s: float = 0.0  # time `put` spent blocked on back-pressure


class SampleStream(Generic[T]):
    """Groups samples by `group_key` and releases complete groups in completion order."""

    def __init__(
        self,
        *,
        group_size: int,
        group_key: Callable[[T], Hashable],
        capacity: int,
        name: str = "sample_stream",
    ):
        if group_size < 1:
            raise ValueError(f"{name}: group_size must be >= 1, got {group_size}")
        if capacity < group_size:
            raise ValueError(f"{name}: capacity ({capacity}) must be >= group_size ({group_size})")
        self.name = name
        self.group_size = group_size
        self.capacity = capacity
        self._group_key = group_key
        self._cv = threading.Condition()
        self._partial: dict[Hashable, list[T]] = {}
        self._ready: collections.deque[list[T]] = collections.deque()
        self._ready_samples = 0
        self._closed = False
        self._error: BaseException | None = None
        self._error_component = ""
        self.metrics = StreamMetrics()

    # ------------------------------------------------------------------ producer side
    def put(self, sample: T, timeout: float) -> None:
        """Adds one finished sample; blocks (up to `timeout`) on back-pressure.

        Raises:
          StreamError: the stream is closed or failed.
          StreamTimeout: the consumer did not make room within `timeout` seconds.
        """
        key = self._group_key(sample)
        deadline = time.monotonic() + timeout
        with self._cv:
            self._raise_if_done(producer=True)
            group = self._partial.setdefault(key, [])
            if len(group) >= self.group_size:
                raise StreamError(f"{self.name}: group {key!r} already has {self.group_size}")
            completes = len(group) + 1 == self.group_size
            start = time.monotonic()
            while completes and self._ready_samples + self.group_size > self.capacity:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StreamTimeout(
                        f"{self.name}: producer blocked {timeout:.1f}s on back-pressure "
                        f"({self._ready_samples}/{self.capacity} samples ready, consumer stalled)"
                    )
                self._cv.wait(remaining)
                self._raise_if_done(producer=True)
            self.metrics.producer_wait_s += time.monotonic() - start
            group.append(sample)
            self.metrics.samples_in += 1
            if completes:
                del self._partial[key]
                self._ready.append(group)
                self._ready_samples += len(group)
                self.metrics.max_ready_depth = max(self.metrics.max_ready_depth, len(self._ready))
                self._cv.notify_all()

    def fail(self, exc: BaseException, component: str) -> None:
        """Records a producer failure; every waiter wakes and the consumer raises it."""
        with self._cv:
            if self._error is None:
                self._error, self._error_component = exc, component
            self._cv.notify_all()

    def close(self) -> None:
        """No more samples; ready groups can still be drained."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ consumer side
    def get_groups(
        self, *, min_groups: int = 1, max_groups: int | None = None, timeout: float
    ) -> list[list[T]]:
        """Waits until `min_groups` complete groups are ready; returns up to `max_groups`.

        Groups come out in the order they completed. After `close()`, returns
        what is left (possibly fewer than `min_groups`, possibly empty).

        Raises:
          StreamError: a producer failed (chained to its exception).
          StreamTimeout: fewer than `min_groups` groups became ready in time.
        """
        if min_groups < 1:
            raise ValueError(f"{self.name}: min_groups must be >= 1, got {min_groups}")
        deadline = time.monotonic() + timeout
        start = time.monotonic()
        with self._cv:
            while len(self._ready) < min_groups and not self._closed:
                self._raise_if_done(producer=False)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StreamTimeout(
                        f"{self.name}: consumer waited {timeout:.1f}s for {min_groups} group(s); "
                        f"{len(self._ready)} ready, {len(self._partial)} incomplete "
                        f"(generation stalled?)"
                    )
                self._cv.wait(remaining)
            self._raise_if_done(producer=False)
            take = len(self._ready) if max_groups is None else min(max_groups, len(self._ready))
            out = [self._ready.popleft() for _ in range(take)]
            self._ready_samples -= sum(len(g) for g in out)
            self.metrics.groups_out += len(out)
            self.metrics.samples_out += sum(len(g) for g in out)
            self.metrics.consumer_wait_s += time.monotonic() - start
            self._cv.notify_all()
            return out

    # ------------------------------------------------------------------ state
    def depth(self) -> dict[str, int]:
        """Ready groups, ready samples and samples waiting in incomplete groups."""
        with self._cv:
            return {
                "ready_groups": len(self._ready),
                "ready_samples": self._ready_samples,
                "partial_samples": sum(len(g) for g in self._partial.values()),
            }

    def drain_partial(self) -> list[T]:
        """Removes and returns samples of incomplete groups (for checkpoints / shutdown)."""
        with self._cv:
            out = [s for group in self._partial.values() for s in group]
            self._partial.clear()
            return out

    @property
    def closed(self) -> bool:
        return self._closed

    def _raise_if_done(self, *, producer: bool) -> None:
        if self._error is not None:
            raise StreamError(
                f"{self.name}: {self._error_component} failed: {self._error!r}"
            ) from self._error
        if producer and self._closed:
            raise StreamError(f"{self.name}: put after close")


def flatten(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """Samples of several groups, group by group."""
    return [s for g in groups for s in g]
