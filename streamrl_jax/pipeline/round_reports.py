"""Partial rollout across processes: the training process's view of the rounds.

With `pipeline.partial_budget_tokens > 0` across processes (docs/multicontroller.md)
the generation process runs the same `PartialRollout` as one process does
(`rollout.py`: rounds, paused samples, their continuations, round closure), and its
finished samples cross the sample wire as usual. A paused sample never leaves it
(unless it is past `max_lag` under `lag_policy="drop"`: then it is handed on, finish
reason "paused", and the trainer drops its group). What the trainer needs besides the
samples is *when a round closed and which groups it completed*: the generation
process sends a `RoundClosed` report per round, in order, once its `PartialRollout`
closed it (`generation_process.py`).

`start_reporter` is that sender (the generation side's thread); `RoundReports` takes
those reports (validated: the next round of a known process,
groups of batches the round can hold) and is what the trainer loop sees in place of
a `PartialRollout`: `wait_round(r)` returns the groups round r completed once every
generation process reported it, `in_flight()` / `regenerated` / `dropped` sum the
reports' counts (as of each process's last report), `fail` wakes the wait.

Checkpoints: the paused samples a checkpoint must hold (docs/checkpoint.md) live in
the generation process, so a checkpoint of this run could not be resumed losslessly;
`config.check` refuses `checkpoint.every > 0` with partial rollout
across processes, and `snapshot` / `restore` raise naming the reason should a
checkpoint directory exist anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from streamrl_jax.config import PipelineSection
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.pipeline.process_plan import NO_RESUME
from streamrl_jax.pipeline.rollout import Key, PartialRollout, wait_closed
from streamrl_jax.stream.sample_stream import StreamError


class RoundReports:
    """The generation processes' round closures, as the trainer loop waits for them."""

    def __init__(self, p: PipelineSection, processes: tuple[int, ...]):
        self.prompts_per_step = p.prompts_per_step
        self._cv = threading.Condition()
        self._next = dict.fromkeys(processes, 0)  # process -> the round it reports next
        self._groups: dict[int, set[Key]] = {}  # round -> groups reported so far
        self._counts: dict[int, RoundClosed] = {}  # process -> its last report
        self._closed: dict[int, list[Key]] = {}
        self._error: BaseException | None = None

    def start(self, batch: int) -> None:
        """The first round every process reports (the run's first batch)."""
        with self._cv:
            self._next = dict.fromkeys(self._next, batch)

    def closed(self, report: RoundClosed) -> None:
        """A generation process's report (a sample channel's reader thread).

        Raises:
          TransportError: naming the process and what is wrong (an unknown process, a
            round out of order, a group no batch of the round can hold).
        """
        who, r = f"generation-{report.process}", report.round
        with self._cv:
            expected = self._next.get(report.process)
            if expected is None:
                raise TransportError(f"round report from {who}, which is not generating")
            if r != expected:
                raise TransportError(f"{who} reported round {r}; expected round {expected}")
            for batch, group in report.groups:
                if not (0 <= batch <= r and 0 <= group < self.prompts_per_step):
                    raise TransportError(
                        f"{who} reported group ({batch}, {group}) complete in round {r}: "
                        f"round {r} holds batches 0..{r}, groups 0..{self.prompts_per_step - 1}"
                    )
            self._next[report.process] = r + 1
            self._counts[report.process] = report
            self._groups.setdefault(r, set()).update(report.groups)
            if all(n > r for n in self._next.values()):
                self._closed[r] = sorted(self._groups.pop(r))
                self._cv.notify_all()

    def wait_round(self, r: int, timeout: float) -> list[Key]:
        """The groups completed in round r, sorted, once every generation process closed
        it (as `PartialRollout.wait_round`).

        Raises:
          TimeoutError: naming the round and the processes that did not report it.
          StreamError: the run failed or was stopped (`fail`).
        """

        def stalled() -> str:
            late = sorted(k for k, n in self._next.items() if n <= r)
            return (
                f"partial rollout: round {r} not reported closed after {timeout:.0f} s by "
                f"generation processes {late}; generation stalled"
            )

        return wait_closed(self._cv, self._closed, lambda: self._error, r, timeout, stalled)

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()

    def in_flight(self) -> dict[str, int]:
        """Paused samples and finished members waiting for their group, summed over the
        generation processes as of their last reports."""
        with self._cv:
            reports = list(self._counts.values())
        return {
            "paused": sum(x.paused for x in reports),
            "waiting_members": sum(x.waiting_members for x in reports),
        }

    @property
    def regenerated(self) -> int:
        with self._cv:
            return sum(x.regenerated for x in self._counts.values())

    @property
    def dropped(self) -> int:
        with self._cv:
            return sum(x.dropped for x in self._counts.values())

    def snapshot(self, k: int) -> dict:
        raise RuntimeError(f"checkpoint {k}: {NO_RESUME}")

    def restore(self, k: int, saved: dict) -> list:
        raise ValueError(f"resume from checkpoint {k}: {NO_RESUME}")


def start_reporter(
    rollout: PartialRollout,
    rounds: Iterable[int],
    process: int,
    send: Callable[[RoundClosed], None],
    stopping: threading.Event,
    fail: Callable[[BaseException], None],
) -> threading.Thread:
    """The generation side: a thread that sends a `RoundClosed` per round of `rounds`,
    in order, once this process's `rollout` closed it (every segment of the round
    returned). It ends when `stopping` is set (checked twice a second) or the rollout
    fails (the run's failure is already known); a send that raises fails the run
    through `fail` (a lost channel, or a bug, named as the round reporter's)."""

    def report() -> None:
        for r in rounds:
            while True:
                if stopping.is_set():
                    return
                try:
                    groups = rollout.wait_round(r, 0.5)
                    break
                except TimeoutError:
                    continue
                except StreamError:
                    return
            counts = rollout.in_flight()
            closed = RoundClosed(
                process,
                r,
                tuple(groups),
                counts["paused"],
                counts["waiting_members"],
                rollout.regenerated,
                rollout.dropped,
            )
            try:
                send(closed)
            except Exception as e:
                fail(e)
                return

    thread = threading.Thread(target=report, name="round-reporter", daemon=True)
    thread.start()
    return thread
