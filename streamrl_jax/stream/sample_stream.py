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
component that failed, with the original exception chained (before any ready
group: fail fast). Every blocking call takes a timeout and raises
`StreamTimeout` naming the stream and what it waited for — nothing here waits
forever. The waiting, back-pressure and failure are the package's one
`Mailbox` (`streamrl_jax/mailbox.py`); this module adds the grouping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from streamrl_jax.mailbox import Mailbox

T = TypeVar("T")


class StreamError(RuntimeError):
    """A producer failed or the stream was closed while someone waited on it."""


class StreamTimeout(TimeoutError):
    """A blocking call on the stream ran past its timeout."""


class _Drained(StreamError):
    """Closed and empty: `get_groups` returns [] on it, `put` raises it."""


@dataclasses.dataclass
class StreamMetrics:
    """Counters since creation (a copy, taken under the lock)."""

    samples_in: int = 0
    groups_out: int = 0
    samples_out: int = 0
    max_ready_depth: int = 0
    consumer_wait_s: float = 0.0  # time `get_groups` spent blocked
    producer_wait_s: float = 0.0  # time `put` spent blocked on back-pressure


class SampleStream(Generic[T]):
    """Groups samples by `group_key` and releases complete groups in completion order.

    Ready groups live in a `Mailbox` whose capacity is in samples (a group
    weighs its size); incomplete groups are kept beside it, under its lock.
    """

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
        self._ready: Mailbox[list[T]] = Mailbox(
            name,
            capacity=capacity,
            failed=StreamError,
            closed=_Drained,
            timeout_error=StreamTimeout,
        )
        self._partial: dict[Hashable, list[T]] = {}  # guarded by the mailbox's lock
        self._samples_in = 0

    # ------------------------------------------------------------------ producer side
    def put(self, sample: T, timeout: float) -> None:
        """Adds one finished sample; blocks (up to `timeout`) on back-pressure.

        Raises:
          StreamError: the stream is closed or failed.
          StreamTimeout: the consumer did not make room within `timeout` seconds.
        """
        key = self._group_key(sample)
        with self._ready.locked():
            self._ready.ensure_open()
            group = self._partial.get(key, [])
            if len(group) >= self.group_size:
                raise StreamError(f"{self.name}: group {key!r} already has {self.group_size}")
            if len(group) + 1 < self.group_size:
                self._partial.setdefault(key, group).append(sample)
            else:  # completes the group: waits (releasing the lock) while it does not fit
                self._ready.put(
                    [*group, sample],
                    timeout=timeout,
                    size=self.group_size,
                    what=lambda: (
                        f"room for a group of {self.group_size} (back-pressure: "
                        f"{self._ready.size}/{self.capacity} samples ready, consumer stalled)"
                    ),
                )
                self._partial.pop(key, None)
            self._samples_in += 1

    def fail(self, exc: BaseException, component: str) -> None:
        """Records a producer failure; every waiter wakes and the consumer raises it."""
        self._ready.fail(exc, component)

    def close(self) -> None:
        """No more samples; ready groups can still be drained."""
        self._ready.close()

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
        try:
            return self._ready.get_many(
                min_items=min_groups,
                max_items=max_groups,
                timeout=timeout,
                what=lambda: (
                    f"{min_groups} group(s); {len(self._ready)} ready, "
                    f"{len(self._partial)} incomplete (generation stalled?)"
                ),
            )
        except _Drained:
            return []

    # ------------------------------------------------------------------ state
    def depth(self) -> dict[str, int]:
        """Ready groups, ready samples and samples waiting in incomplete groups."""
        with self._ready.locked():
            return {
                "ready_groups": len(self._ready),
                "ready_samples": self._ready.size,
                "partial_samples": sum(len(g) for g in self._partial.values()),
            }

    @property
    def metrics(self) -> StreamMetrics:
        with self._ready.locked():
            m = self._ready.metrics
            return StreamMetrics(
                samples_in=self._samples_in,
                groups_out=m.items_out,
                samples_out=m.units_out,
                max_ready_depth=m.max_depth,
                consumer_wait_s=m.consumer_wait_s,
                producer_wait_s=m.producer_wait_s,
            )

    @property
    def closed(self) -> bool:
        return self._ready.closed


def flatten(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """Samples of several groups, group by group."""
    return [s for g in groups for s in g]
