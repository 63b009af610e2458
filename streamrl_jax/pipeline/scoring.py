"""The stream's third stage: a reward model scores samples between generation and the
trainer (DESIGN.md §8: generation -> scoring -> training).

`ScoringStage.put(scored, done)` takes a sample its rule reward already scored (the
reward pool's callback, `pipeline/ingest.py`); the stage's thread judges samples in
order of arrival, up to `judge.batch` per forward (it waits `judge.max_wait_s` after
the first for more), and hands each on to the rollout (`Rollout.scored`) with

    reward = judge.rule_coef * rule score + judge.coef * verdict     (verdict in [0, 1])

then runs `done()`, which returns a sample channel's credit: so the stage's bound
reaches the generation processes. Samples leave in the order they came, each judged
once. A judge that runs forwards side by side (`Scorer.parallel`: scoring processes,
one forward each) gets that many at once, each of the forward's samples still handed on
in order (a later forward's wait for an earlier one's; a sample's verdict does not
depend on which samples share its forward).

**Back-pressure.** At most `judge.queue` samples wait; `put` blocks while the queue is
full (the reward pool's callback thread, and behind it the sample channel or the
driver's collector), at most `pipeline.timeout_s`, then fails the run naming the
scoring stage. A slow judge therefore stalls generation only up to the bound.

**Failures are masked, never zero.** A forward that raises, or does not return within
`judge.timeout_s`, gives every sample of that forward the failure; a verdict whose
score tokens got less than `judge.min_mass` is unparsable (`rewards/judge.py`). Such a
sample keeps its rule reward for the record but carries `RewardResult.masked`: the
trainer leaves it out of its group's statistics and the loss
(`micro_batches.pack_groups`), as if it had never been generated. Failures are counted
per step; once at least `MIN_JUDGED` samples were judged, a failed fraction above
`judge.max_failure_rate` fails the run (a judge that is down, not a noisy one).

**Blocking** (`judge.mode="blocking"`, the baseline the stage is measured against):
each sample's reward call runs the judge on that sample alone before it returns, as a
reward function that calls a judge model does (the reward pool's threads wait on it).

**The verdict log** (`log.judge`): each judged sample's line in `<workdir>/judge.jsonl`
(`verdict_record`: its step, group and member, the response and reference answer the
judge read, the verdict, the probability mass on the score tokens, a parsed judge's
answer, the failure if any and the reward trained), in the order judged. A resumed run
appends: a sample judged before the kill and again after it has two lines.

Held-out evaluation samples never come here: their metrics are the task's own,
independent of the judge.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

from absl import logging

from streamrl_jax.config.sections import JudgeSection
from streamrl_jax.metrics import Tracer
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.supervisor import Supervisor
from streamrl_jax.rewards.judge import Item, Scorer, Verdict
from streamrl_jax.scheduling.sample_log import SampleLog
from streamrl_jax.stream.sample_stream import StreamError

MIN_JUDGED = 16  # judged samples before the failure rate can end a run
JUDGE_LOG = "judge.jsonl"  # the verdict log, in the run's directory (`log.judge`)


class JudgeFailures(RuntimeError):
    """More of the judged samples failed than `judge.max_failure_rate` allows."""


def item_of(scored: Scored) -> Item:
    """What the judge reads of a sample: its question, response and reference answer."""
    entry = scored.sample.metadata.get("entry") or {}
    return Item(
        question=str(entry.get("question", "")),
        response=scored.text,
        answer=str(entry.get("answer", "")),
    )


def judged(scored: Scored, verdict: Verdict, coef: float, rule_coef: float = 1.0) -> Scored:
    """`scored` with the verdict folded into its reward, `rule_coef * rule score + coef *
    verdict` (or masked, naming the failure; its rule score kept for the record)."""
    r = scored.reward
    if verdict.failure is not None:
        reward = dataclasses.replace(r, masked=verdict.failure)
    else:
        score = rule_coef * r.score + coef * verdict.score
        reward = dataclasses.replace(r, score=score, judge=verdict.score)
    return dataclasses.replace(scored, reward=reward)


def verdict_record(scored: Scored, verdict: Verdict, item: Item) -> dict:
    """The verdict log's line for `scored` (judged: its reward already folded in)."""
    tag = scored.sample.tag
    masked = scored.reward.masked is not None
    return {
        "step": tag.batch,
        "group": tag.group,
        "member": tag.member,
        "response": item.response,
        "answer": item.answer,
        "verdict": verdict.score,
        "mass": verdict.mass,
        "text": verdict.text,
        "failure": verdict.failure,
        "reward": None if masked else scored.reward.score,
    }


@dataclasses.dataclass
class _Waiting:
    scored: Scored
    done: Callable[[], None] | None
    t_in: float


@dataclasses.dataclass
class _Forward:
    """One forward submitted to the judge, waiting to be handed on in order."""

    batch: list[_Waiting]
    items: list[Item]
    future: concurrent.futures.Future
    t0: float  # the tracer's clock at its start
    start: float  # time.monotonic() at its start


class _Counts:
    """The stage's per-step figures (`ScoringStage.pop_row`) and its run totals."""

    def __init__(self) -> None:
        self.judged = self.failed = 0  # run totals (the failure rate)
        self.step: collections.Counter[str] = collections.Counter()
        self.verdicts: list[float] = []
        self.waits: list[float] = []
        self.queue_max = 0


class Direct:
    """The hand-on of a run without a judge: each rule-scored sample straight to the
    rollout, then its `done` (the interface `Ingest` hands every training sample to,
    `ScoringStage`'s without the judge)."""

    def __init__(self, forward: Callable[[Scored], None]):
        self.forward = forward

    def put(self, scored: Scored, done: Callable[[], None] | None = None) -> None:
        try:
            self.forward(scored)
        finally:
            if done is not None:
                done()

    def waiting(self) -> int:
        return 0

    def pop_row(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def onward(
    judge: Scorer | None,
    cfg: JudgeSection,
    forward: Callable[[Scored], None],
    *,
    supervisor: Supervisor,
    tracer: Tracer,
    timeout_s: float,
    log_path: str | None = None,
) -> Direct | ScoringStage:
    """Where ingest hands a run's rule-scored training samples: straight to `forward`
    (`Direct`), or through a `ScoringStage` when the run has a judge (its verdicts logged
    to `log_path`, a JSONL file, unless None)."""
    if judge is None:
        return Direct(forward)
    log = None if log_path is None else SampleLog(log_path)
    return ScoringStage(
        judge, cfg, forward, supervisor=supervisor, tracer=tracer, timeout_s=timeout_s, log=log
    )


class ScoringStage:
    """A judge between the reward pool and the rollout (module docstring).

    Args:
      judge: the judge (its params on the scoring mesh).
      cfg: the `judge` section.
      forward: where a judged sample goes (`Rollout.scored`).
      supervisor: the run's failure latch (a failure rate past the bound, a stall).
      tracer: the run's trace ("scoring/judge" spans).
      timeout_s: longest `put` waits for room (`pipeline.timeout_s`).
      log: the verdict log (module docstring; None: none), closed by `close`.
    """

    def __init__(
        self,
        judge: Scorer,
        cfg: JudgeSection,
        forward: Callable[[Scored], None],
        *,
        supervisor: Supervisor,
        tracer: Tracer,
        timeout_s: float,
        log: SampleLog | None = None,
    ):
        self.judge, self.cfg, self.forward, self.log = judge, cfg, forward, log
        self.supervisor, self.tracer, self.timeout_s = supervisor, tracer, timeout_s
        self.blocking = cfg.mode == "blocking"
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._counts = _Counts()
        self._busy_s = 0.0  # seconds the judge computed (since the last row)
        self._running = 0  # samples in forwards not yet handed on
        # Threads run the forwards (as many as the judge runs side by side), so a stuck
        # one can be waited on with a deadline; forwards are handed on in order.
        self.parallel = 1 if self.blocking else max(1, judge.parallel)
        self._device = concurrent.futures.ThreadPoolExecutor(
            self.parallel, thread_name_prefix="judge"
        )
        self._forwards: collections.deque[_Forward] = collections.deque()
        self._taking = True  # the stage's thread may still submit forwards
        self._lock = threading.Lock()  # blocking mode: one forward at a time
        self._threads: list[threading.Thread] = []
        if not self.blocking:
            for target, name in ((self._run, "scoring"), (self._hand_on, "scoring-out")):
                self._threads.append(threading.Thread(target=target, name=name, daemon=True))
                self._threads[-1].start()
        supervisor.latch.add_listener(lambda component, exc: self._wake())

    # ------------------------------------------------------------------ producers
    def put(self, scored: Scored, done: Callable[[], None] | None = None) -> None:
        """One rule-scored training sample in; blocks while `judge.queue` wait.

        Raises:
          TimeoutError: no room within `timeout_s` (the judge or the trainer stalled).
        """
        if self.blocking:
            with self._lock:  # the reward path waits for its own verdict
                batch = [_Waiting(scored, done, time.monotonic())]
                with self._cv:
                    self._running += 1
                self._hand(self._submit(batch))
            return
        t0 = time.monotonic()
        with self._cv:
            ok = self._cv.wait_for(
                lambda: len(self._queue) < self.cfg.queue or self._stopping(), self.timeout_s
            )
            if not ok:
                raise TimeoutError(
                    f"scoring stage: {len(self._queue)} samples waiting for the judge "
                    f"(judge.queue={self.cfg.queue}) for {self.timeout_s:.0f} s "
                    "(judge or trainer stalled?)"
                )
            if self._stopping():
                raise StreamError("scoring stage: the run is ending")
            self._queue.append(_Waiting(scored, done, t0))
            self._counts.queue_max = max(self._counts.queue_max, len(self._queue))
            self._cv.notify_all()

    def _stopping(self) -> bool:
        return self._closed or self.supervisor.latch.failed

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the stage
    def _run(self) -> None:
        """The stage's thread: forwards of what waits, up to `parallel` at once."""
        try:
            while True:
                with self._cv:
                    while len(self._forwards) >= self.parallel and not self._stopping():
                        self._cv.wait(0.5)
                batch = self._take()
                if batch is None:
                    return
                forward = self._submit(batch)
                with self._cv:
                    self._forwards.append(forward)
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the supervisor
            self.supervisor.fail("scoring stage", e)
        finally:
            with self._cv:
                self._taking = False
                self._cv.notify_all()

    def _hand_on(self) -> None:
        """The `scoring-out` thread: each forward's verdicts, in the order submitted."""
        try:
            while True:
                with self._cv:
                    while not self._forwards:
                        if not self._taking or self._stopping():
                            return
                        self._cv.wait(0.5)
                    if self._stopping():
                        return  # what waits is dropped: the run is ending
                    forward = self._forwards[0]
                try:
                    self._hand(forward)
                finally:
                    with self._cv:
                        self._forwards.popleft()
                        self._cv.notify_all()
        except StreamError:
            pass  # the stream already carries the first failure
        except BaseException as e:  # noqa: BLE001 - reported to the supervisor
            self.supervisor.fail("scoring stage", e)

    def _take(self) -> list[_Waiting] | None:
        """The next forward's samples: the oldest waiting, and those that arrive within
        `judge.max_wait_s` of it, up to `judge.batch` (None once the stage closes)."""
        with self._cv:
            while not self._queue:
                if self._stopping():
                    return None
                self._cv.wait(0.5)
            deadline = time.monotonic() + self.cfg.max_wait_s
            while len(self._queue) < self.judge.batch and not self._stopping():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            n = min(len(self._queue), self.judge.batch)
            out = [self._queue.popleft() for _ in range(n)]
            self._running += n
            self._cv.notify_all()  # room for blocked producers
            return out

    def _submit(self, batch: list[_Waiting]) -> _Forward:
        """`batch`'s forward, started."""
        items = [item_of(w.scored) for w in batch]
        t0, start = self.tracer.now(), time.monotonic()
        return _Forward(batch, items, self._device.submit(self.judge, items), t0, start)

    def _hand(self, forward: _Forward) -> None:
        """Waits for `forward`'s verdicts (masking them past `judge.timeout_s` from its
        start), hands each sample on in order, then runs its `done`."""
        batch, items, future = forward.batch, forward.items, forward.future
        t0, start = forward.t0, forward.start
        try:
            left = max(start + self.cfg.timeout_s - time.monotonic(), 0.0)
            verdicts = future.result(timeout=left)
            if len(verdicts) != len(batch):
                raise ValueError(f"{len(verdicts)} verdicts for {len(batch)} samples")
        except concurrent.futures.TimeoutError:
            why = f"timeout: no verdict within judge.timeout_s={self.cfg.timeout_s:g} s"
            verdicts = [Verdict(None, 0.0, why)] * len(batch)
        except Exception as e:  # noqa: BLE001 - masked and counted, never a fake score
            logging.warning("judge raised on %d samples: %r", len(batch), e)
            verdicts = [Verdict(None, 0.0, f"error: {e!r}")] * len(batch)
        end = time.monotonic()
        self.tracer.add("scoring/judge", "judge", t0, self.tracer.now(), samples=len(batch))
        too_many = self._count(batch, verdicts, end - start, end)
        try:
            for w, v, item in zip(batch, verdicts, items, strict=True):
                out = judged(w.scored, v, self.cfg.coef, self.cfg.rule_coef)
                if self.log is not None and not self._closed:
                    self.log.write_row(verdict_record(out, v, item))
                self.forward(out)
                self.supervisor.tick("scoring")
        finally:
            with self._cv:
                self._running -= len(batch)
            for w in batch:
                if w.done is not None:
                    w.done()
        if too_many is not None:
            raise too_many

    def _count(
        self, batch: list[_Waiting], verdicts: list[Verdict], busy: float, now: float
    ) -> JudgeFailures | None:
        """Counts the verdicts; the error to fail the run with past the failure rate."""
        c = self._counts
        with self._cv:
            self._busy_s += busy
            for w, v in zip(batch, verdicts, strict=True):
                c.judged += 1
                c.step["judged"] += 1
                c.waits.append(now - w.t_in)
                if v.failure is None:
                    c.verdicts.append(v.score)
                    continue
                c.failed += 1
                c.step["masked"] += 1
                c.step[v.failure.split(":", 1)[0]] += 1  # timeout | error | unparsable
            rate = c.failed / c.judged
        if c.judged < MIN_JUDGED or rate <= self.cfg.max_failure_rate:
            return None
        return JudgeFailures(
            f"the judge failed on {c.failed} of {c.judged} samples ({rate:.0%} > "
            f"judge.max_failure_rate={self.cfg.max_failure_rate:g}); last: "
            f"{next((v.failure for v in reversed(verdicts) if v.failure), 'earlier')}"
        )

    # ------------------------------------------------------------------ figures
    def waiting(self) -> int:
        """Samples in the queue or in forwards not yet handed on."""
        with self._cv:
            return len(self._queue) + self._running

    def pop_row(self) -> dict[str, float]:
        """The stage's figures since the last call (the step's metrics row): samples
        judged and masked (by cause), the mean verdict, the judge's busy seconds, the mean
        seconds a sample spent in the stage and the most that waited at once."""
        with self._cv:
            c = self._counts
            row = {
                f"judge/{k}": float(c.step[k])
                for k in ("judged", "masked", "timeout", "error", "unparsable")
            }
            if c.verdicts:  # (none judged this step: no figure)
                row["judge/verdict"] = sum(c.verdicts) / len(c.verdicts)
            row["judge/busy_s"] = self._busy_s
            row["judge/stage_s"] = sum(c.waits) / len(c.waits) if c.waits else 0.0
            row["judge/queue_max"] = float(c.queue_max)
            c.step.clear()
            c.verdicts, c.waits, c.queue_max = [], [], len(self._queue)
            self._busy_s = 0.0
        return row

    def close(self) -> None:
        """Stops the stage (what waits is dropped: the run is ending)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.cfg.timeout_s + 5.0)
        self._device.shutdown(wait=False, cancel_futures=True)
        if self.log is not None:
            with self._lock:  # (blocking mode: a reward call's forward finishes first)
                self.log.flush()
                if not any(t.is_alive() for t in self._threads):  # (else one still writes)
                    self.log.close()
