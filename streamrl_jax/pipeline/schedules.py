"""The four pipeline modes as schedules: which weights each batch uses, and when to train.

DESIGN.md §2: training step b consumes global batch b and turns W_b into
W_{b+1}; batch b is generated with W_{g(b)}:

* colocated / disaggregated_batch / stream_sync: g(b) = b
* stream_async with staleness s >= 1:             g(b) = max(0, b - s)

A sample trained at step b must have version >= b - s (s = 0 for the
synchronous modes); `VersionGate` counts and drops older ones, or raises in
strict mode.

The in-flight extension (`pipeline.weight_update="inflight"`, stream_async):
the generation side takes each new version at the next decode-chunk boundary
without draining, so a sample may span versions and the unit of versioning is
the token. A sample's lag at step b is b - (its oldest token's version); the
gate admits lag <= `max_lag` (default s: the same bound as the four modes) and
no token newer than W_b. `WeightBoard` is where the trainer publishes W_v and the
generation driver waits for it, with a timeout that names the stalled side.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.config import PipelineSection
from streamrl_jax.mailbox import Mailbox
from streamrl_jax.weight_sync import Published


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Mode-dependent decisions of the pipeline."""

    mode: str
    staleness: int  # s; 0 for the synchronous modes
    streaming: bool  # train on complete groups as they arrive
    colocated: bool  # one device set for both stages
    inflight: bool = False  # new weights at the next chunk boundary, without draining
    max_lag: int = 0  # the gate's bound on step - oldest token version (>= staleness)

    @classmethod
    def from_config(cls, p: PipelineSection) -> Schedule:
        staleness = p.staleness if p.mode == "stream_async" else 0
        return cls(
            mode=p.mode,
            staleness=staleness,
            streaming=p.mode in ("stream_sync", "stream_async"),
            colocated=p.mode == "colocated",
            inflight=p.weight_update == "inflight",
            max_lag=p.max_lag or staleness,
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
    """Enforces b - max_lag <= every token's version <= b for samples trained at step b
    (max_lag = s unless `pipeline.max_lag` widens it)."""

    def __init__(self, schedule: Schedule, strict: bool):
        self.schedule = schedule
        self.strict = strict
        self.dropped = 0

    def admit(self, step: int, version: int, sample_id: str, newest: int | None = None) -> bool:
        """True if a sample whose tokens span versions `version` (the oldest) ..
        `newest` (default: `version`) may be trained at `step`; counts drops."""
        oldest = step - self.schedule.max_lag
        newest = version if newest is None else newest
        if version >= oldest and newest <= step:
            return True
        what = f"version {version}"
        if newest != version:
            what = f"tokens of versions {version}..{newest}"
        message = (
            f"sample {sample_id} has policy {what}; step {step} in mode "
            f"{self.schedule.mode} accepts versions {oldest}..{step}"
        )
        return self._drop(message)

    def refuse(self, step: int, version: int, sample_id: str, what: str) -> bool:
        """Drops (counts, or raises in strict mode) a sample that may never be trained:
        partial rollout's paused sample past `max_lag` (lag_policy="drop"). False."""
        return self._drop(
            f"sample {sample_id} is {what} from version {version}: its lag at step "
            f"{step} or later passes max_lag {self.schedule.max_lag}"
        )

    def _drop(self, message: str) -> bool:
        if self.strict:
            raise StaleSampleError(message)
        self.dropped += 1
        return False


class WeightBoard:
    """Published generation weights by version; waiters get exactly the version asked for.

    In stream_async the trainer may already have published W_b while the
    driver still needs W_{b-s} for batch b, so every version from the oldest
    still needed on is kept; `discard_below` frees older ones. The versions
    are kept beside a `Mailbox`, whose lock, timed `wait_until` and failure
    latch do the waiting.
    """

    def __init__(self, name: str = "weight board"):
        self.name = name
        self._box: Mailbox[None] = Mailbox(name, failed=RuntimeError, timeout_error=TimeoutError)
        self._latest = -1  # both guarded by the mailbox's lock
        self._weights: dict[int, list[Published]] = {}

    def publish(self, version: int, weights: list[Published]) -> None:
        with self._box.locked():
            if version <= self._latest:
                raise ValueError(f"{self.name}: version {version} after {self._latest}")
            self._latest = version
            self._weights[version] = weights

    def get(self, version: int) -> list[Published] | None:
        """The weights published as `version`, or None if never published or discarded."""
        with self._box.locked():
            return self._weights.get(version)

    def discard_below(self, version: int) -> None:
        with self._box.locked():
            for v in [v for v in self._weights if v < version]:
                del self._weights[v]

    def fail(self, exc: BaseException, component: str = "") -> None:
        """Wakes every waiter; `wait_for` raises from now on (the first failure wins)."""
        self._box.fail(exc, component)

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        with self._box.locked():
            return self._latest

    def wait_for(self, version: int, timeout: float) -> list[Published]:
        """Blocks until W_version is published and returns it.

        Raises:
          TimeoutError: naming the trainer / weight sync as the stalled side.
          KeyError: the version was already discarded.
          RuntimeError: the board was failed (chained to the cause), even if
            the version is there.
        """
        with self._box.locked():
            self._box.wait_until(
                lambda: self._latest >= version,
                timeout=timeout,
                what=lambda: (
                    f"policy version {version} (latest {self._latest}); "
                    "the trainer / weight sync stalled"
                ),
            )
            if version not in self._weights:
                raise KeyError(f"{self.name}: version {version} was already discarded")
            return self._weights[version]
