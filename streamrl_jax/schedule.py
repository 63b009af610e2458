"""The four pipeline modes as schedules: which weights each batch uses, and when to train.

DESIGN.md §2: training step b consumes global batch b and turns W_b into
W_{b+1}; batch b is generated with W_{g(b)}:

* colocated / disaggregated_batch / stream_sync: g(b) = b
* stream_async with staleness s >= 1:             g(b) = max(0, b - s)

A sample trained at step b must have version >= b - s (s = 0 for the
synchronous modes); `VersionGate` counts and drops older ones, or raises in
strict mode. `WeightBoard` is where the trainer publishes W_v and the
generation driver waits for it, with a timeout that names the stalled side.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from streamrl_jax.config import PipelineSection


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Mode-dependent decisions of the pipeline."""

    mode: str
    staleness: int  # s; 0 for the synchronous modes
    streaming: bool  # train on complete groups as they arrive
    colocated: bool  # one device set for both stages

    @classmethod
    def from_config(cls, p: PipelineSection) -> Schedule:
        return cls(
            mode=p.mode,
            staleness=p.staleness if p.mode == "stream_async" else 0,
            streaming=p.mode in ("stream_sync", "stream_async"),
            colocated=p.mode == "colocated",
        )

    def generation_version(self, batch: int) -> int:
        """g(b): the policy version that generates global batch `batch`."""
        return max(0, batch - self.staleness)

    def min_groups(self, p: PipelineSection, remaining: int) -> int:
        """Groups to wait for before the next trainer micro-batch."""
        return min(p.min_groups, remaining) if self.streaming else remaining


class StaleSampleError(RuntimeError):
    """A sample older than the version contract allows (strict mode)."""


class VersionGate:
    """Enforces version >= b - s for samples trained at step b."""

    def __init__(self, schedule: Schedule, strict: bool):
        self.schedule = schedule
        self.strict = strict
        self.dropped = 0

    def admit(self, step: int, version: int, sample_id: Any) -> bool:
        """True if a sample of `version` may be trained at `step`; counts drops."""
        oldest = step - self.schedule.staleness
        if version >= oldest and version <= step:
            return True
        message = (
            f"sample {sample_id} has policy version {version}; step {step} in mode "
            f"{self.schedule.mode} accepts versions {oldest}..{step}"
        )
        if self.strict:
            raise StaleSampleError(message)
        self.dropped += 1
        return False


class WeightBoard:
    """Latest published generation weights, by version; waiters time out by name."""

    def __init__(self, name: str = "weight board"):
        self.name = name
        self._cv = threading.Condition()
        self._version = -1
        self._weights: Any = None
        self._error: BaseException | None = None

    def publish(self, version: int, weights: Any) -> None:
        with self._cv:
            if version <= self._version:
                raise ValueError(f"{self.name}: version {version} after {self._version}")
            self._version, self._weights = version, weights
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    @property
    def version(self) -> int:
        with self._cv:
            return self._version

    def wait_for(self, version: int, timeout: float) -> tuple[int, Any]:
        """Blocks until weights of at least `version` are published.

        Returns the (version, weights) published at that moment. Raises
        TimeoutError naming the trainer (the producer of weights) as stalled.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._version < version:
                if self._error is not None:
                    raise RuntimeError(f"{self.name}: closed: {self._error!r}") from self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{self.name}: waited {timeout:.0f} s for policy version {version} "
                        f"(latest {self._version}); the trainer / weight sync stalled"
                    )
                self._cv.wait(remaining)
            return self._version, self._weights
