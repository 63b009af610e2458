"""The generation driver: a thread feeding a `GenerationService` and a collector
thread draining it (DESIGN.md §4).

* **driver**: for batch b = start .. steps-1: W_{g(b)} from `weights`, swapped into
  the service only once every earlier request has finished (so no sample mixes
  versions), or with `pipeline.weight_update="inflight"` at once: each instance takes
  it at its next decode-chunk boundary while earlier requests keep running (their
  later tokens record the new version); the batch's prompts from the rollout
  (`Rollout.draw`), made into requests (`Requests.train`: per-sample seeds, so a
  sample depends only on weights, prompt and seed); this process's share of them
  (`Share`); the rollout's requests for the batch (`Rollout.open`: partial rollout
  adds its continuations); the `LiveScheduler`'s instance plan; submit; the batch
  hooks (the held-out evaluation, `hooks.py`); then the rollout settles the batch
  (`Rollout.settle`: dynamic sampling's refills, under the same weights) before the
  next batch is drawn or other weights load. After the last batch, the final
  evaluation of W_steps when evaluation is on.
* **again**: a `Share` may hand back requests of batches already drawn that this
  process owns now (a lost generation process's, `processes/roster_share.py`);
  `regenerate()` (the driver thread: before each batch, while it waits for weights
  and while the rollout settles a batch; the owner's once it has ended) generates them
  under their batch's version W_{g(b)} (`Weights.kept`), swapping it in and back only
  when the service holds another.
* **collector**: each finished sample, the moment it completes, goes to the rollout
  (`Rollout.returned`: handed on, or kept and continued; an episode's environment step
  runs off this thread and comes back as the rollout's `Returned.later`, counted as a
  request still out meanwhile) and then to `emit`: in one process the run scores it
  (`ingest.py`); in a generation process it is sent to the training process
  (`processes/generation.py`). A sample handed on gives up the slot its episode kept.

The same class runs in both places; what differs is passed in (`weights`, `share`,
`emit`). Failures: an exception in either thread fails the owner's `FailureLatch`
naming the component; any failure on that latch (here or elsewhere) wakes every wait
here, and `stop()` ends both threads quietly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from streamrl_jax.data import Prompt
from streamrl_jax.generation.service import StreamClosed
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline.hooks import Hooks
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.pipeline.rollouts import Returned, Rollout
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.supervisor import caused_by_shutdown
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.weight_sync import Params


class Service(Protocol):
    """What the driver feeds and drains: a `GenerationService`, or one learner's view of
    a service several learners share (`learners.View`)."""

    def submit(
        self, requests: Sequence[GenerationRequest], instances: Sequence[int] | None = None
    ) -> None:
        """Queues requests (on `instances`, one per request, or where the service puts them)."""

    def release(self, request_id: Any) -> None:
        """The episode of `request_id` ended: the slot kept for its continuation is freed."""

    def get(self, timeout: float) -> Sample:
        """The next completed sample (`StreamClosed` once the service has closed)."""

    def update_weights(self, params: Params | Sequence[Params], version: int) -> None:
        """W_version for every instance (one tree, or one per instance already placed)."""

    def close(self, timeout: float) -> None:
        """Stops what this service owns (naming what did not stop in `timeout`)."""


class Weights(Protocol):
    """Where the driver takes each policy version from."""

    def wait(self, version: int, idle: Callable[[], None]) -> list[Params]:
        """W_version placed on every instance (one tree per instance), once it exists;
        `idle()` is called now and then while it waits (the driver generates a lost
        process's groups again meanwhile: the trainer may need them to make W_version)."""

    def kept(self, version: int) -> list[Params] | None:
        """W_version placed on every instance if still kept here, else None."""


class Share(Protocol):
    """Which of a batch's groups and held-out prompts this process generates."""

    def before_draw(self, batch: int) -> None:
        """Called before batch `batch` is drawn (with its weights loaded)."""

    def keep(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """This process's share of `requests` of `batch` (a batch may add some: refills)."""

    def keep_held_out(
        self, version: int, batch: int, requests: list[GenerationRequest]
    ) -> list[GenerationRequest]:
        """This process's share of the held-out requests of `version`, drawn at `batch`."""

    def again(self) -> dict[int, list[GenerationRequest]]:
        """Requests to generate again, by the policy version they need (taken once)."""


class Whole:
    """One process generates everything: the whole share, nothing to do again."""

    def before_draw(self, batch: int) -> None:
        del batch

    def keep(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        del batch
        return requests

    def keep_held_out(
        self, version: int, batch: int, requests: list[GenerationRequest]
    ) -> list[GenerationRequest]:
        del version, batch
        return requests

    def again(self) -> dict[int, list[GenerationRequest]]:
        return {}


@dataclasses.dataclass(frozen=True)
class DriverPlan:
    """Which batches a driver generates and how it evaluates."""

    schedule: Schedule  # g(b), in-flight weight updates
    start: int  # the first batch (a resumed run's checkpoint step)
    steps: int  # batches in the run
    loaded_version: int  # the version the service holds now (-1: load at the start)
    held_out: Sequence[Prompt]  # the held-out prompts (all: the share decides)
    timeout: float  # the stall bound of every wait
    emit_component: str = "generation service"  # named when `emit` raises


class GenerationDriver:
    """Driver and collector threads around one `Service` (module docstring)."""

    def __init__(
        self,
        service: Service,
        rollout: Rollout,
        live: LiveScheduler,
        weights: Weights,
        share: Share,
        requests: Requests,
        emit: Callable[[Sample], None],
        latch: FailureLatch,
        plan: DriverPlan,
    ):
        """Args:
        service: the generation instances of this process.
        rollout: what each batch's requests are and what becomes of a returned sample.
        live: dispatch plan over this process's instances; observes finished samples.
        weights: where W_v comes from.
        share: which requests this process generates.
        requests: how prompts become requests.
        emit: receives every sample the rollout hands on, and every held-out sample.
        latch: the owner's failure latch: this driver reports its threads' failures
          to it, and stops waiting once anything has failed it.
        plan: the batches, the evaluation and the stall bound.
        """
        self.service, self.rollout, self.live = service, rollout, live
        self.weights, self.share, self.requests = weights, share, requests
        self.emit, self.latch, self.plan = emit, latch, plan
        self.version = plan.loaded_version
        self.evaluated: set[int] = set()  # versions whose held-out requests were submitted
        self._instances: list[int] | None = None  # the last batch's instance plan
        self._cv = threading.Condition()
        self._submitted = self._collected = 0  # requests sent to / returned by the service
        self._stop = threading.Event()
        latch.add_listener(lambda component, exc: self._wake())
        self.threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ control
    def start_threads(self, hooks: Hooks) -> list[threading.Thread]:
        """Starts the driver (running `hooks` after each batch it submits) and collector."""
        self.threads = [
            threading.Thread(target=self._drive, args=(hooks,), name="generation-driver"),
            threading.Thread(target=self._collect, name="collector"),
        ]
        for th in self.threads:
            th.daemon = True
            th.start()
        return self.threads

    def pending(self) -> int:
        """Requests submitted and not yet collected."""
        with self._cv:
            return self._submitted - self._collected

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def stop(self) -> None:
        self._stop.set()
        self._wake()

    @property
    def driving(self) -> bool:
        """The driver thread still has batches (or the final evaluation) to submit."""
        return bool(self.threads) and self.threads[0].is_alive()

    def _fail(self, component: str, exc: BaseException) -> None:
        if self._stop.is_set():
            return  # stopping: the wait that raised was woken on purpose
        self.latch.fail(component, exc)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Blocks until every submitted request has been collected and emitted."""
        timeout = self.plan.timeout if timeout is None else timeout
        with self._cv:
            ok = self._cv.wait_for(
                lambda: (
                    self._collected >= self._submitted or self.latch.failed or self._stop.is_set()
                ),
                timeout=timeout,
            )
            if self.latch.failed:
                error = self.latch.error
                raise RuntimeError(f"generation stopped: {error!r}") from error
            if self._stop.is_set():
                raise RuntimeError("generation stopped")
        if not ok:
            raise TimeoutError(
                f"generation service: {self._submitted - self._collected} requests unfinished "
                f"after {timeout:.0f} s"
            )

    # ------------------------------------------------------------------ driver
    def _drive(self, hooks: Hooks) -> None:
        try:
            plan = self.plan
            for b in range(plan.start, plan.steps):
                needed = plan.schedule.generation_version(b)
                if needed != self.version:
                    self._load(needed)
                if self._stop.is_set():
                    return
                self.share.before_draw(b)
                requests = self.share.keep(b, self.requests.train(b, self.rollout.draw(b)))
                self.regenerate()
                self._plan_and_submit(b, self.rollout.open(b, requests))
                hooks.run(b)
                self.rollout.settle(
                    b, lambda prompts, first, b=b: self._refill(b, prompts, first), self._settling
                )
            self._final_evaluation()
        except BaseException as e:  # noqa: BLE001 - reported to the owner
            if caused_by_shutdown(e):
                # A stop request ended the wait (`RunParts.interrupt`): the trainer turns
                # it into a checkpointed stop; reported as a failure, it would race that
                # stop and end the run with an error instead.
                return
            self._fail("generation driver", e)

    def _plan_and_submit(self, b: int, requests: list[GenerationRequest]) -> None:
        requests, self._instances = self.live.plan(b, requests)
        self._submit(requests, self._instances)

    def _settling(self) -> bool:
        """The rollout's `stopped` while it settles a batch, polled as it waits: a lost
        process's groups handed back meanwhile are generated again here, for the batch
        may wait on exactly those (dynamic sampling waits for every group's verdict, and
        the lost process's groups get theirs only once this process generates them)."""
        self.regenerate()
        return self._stop.is_set()

    def _refill(self, b: int, prompts: list[Prompt], first: int) -> None:
        """A batch's further prompts (dynamic sampling), as groups first.., under the
        weights the batch was generated with (still loaded)."""
        self._plan_and_submit(b, self.share.keep(b, self.requests.train(b, prompts, first)))

    def _load(self, version: int) -> None:
        """W_version into the service: once every earlier request has finished, or in
        flight (the instances swap at their next chunk boundary, nothing drained).
        The weights are fetched first: while a generation process waits for them it
        generates a lost process's groups again (`regenerate`), under the loaded
        version, and those must finish before the swap too."""
        weights = self.weights.wait(version, self.regenerate)
        if not self.plan.schedule.inflight:
            self.wait_idle()
        self.service.update_weights(weights, version)
        self.version = version

    def _submit(self, requests: list[GenerationRequest], instances: list[int] | None = None):
        if not requests:
            return
        with self._cv:
            self._submitted += len(requests)
        self.service.submit(requests, instances)

    def regenerate(self) -> None:
        """Generates the requests the share hands back under their own versions (the
        driver thread, or the owner's thread once the driver has ended)."""
        for version, requests in sorted(self.share.again().items()):
            if not requests:
                continue
            if version == self.version:
                self._submit(requests)
                continue
            held = self.version
            w, back = self.weights.kept(version), self.weights.kept(held)
            if w is None or back is None:
                raise RuntimeError(
                    f"generation: W_{version} (to generate a lost process's groups again) or "
                    f"W_{held} (loaded) is no longer kept here"
                )
            self.wait_idle()  # no sample mixes versions
            self.service.update_weights(w, version)
            self._submit(requests)
            self.wait_idle()
            self.service.update_weights(back, held)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, batch: int) -> None:
        """The held-out prompts under the loaded weights, once per policy version (in
        stream_async several batches share one); round robin over the active instances
        when the batch had an instance plan. A batch hook (`hooks.generation_hooks`)."""
        if self.version in self.evaluated or not self.plan.held_out:
            return
        self.evaluated.add(self.version)
        every = self.requests.held_out(self.version, self.plan.held_out)
        mine = self.share.keep_held_out(self.version, batch, every)
        instances = None
        if self._instances is not None:
            instances = [i % self.live.active for i in range(len(mine))]
        self._submit(mine, instances)

    def _final_evaluation(self) -> None:
        """Greedy evaluation of the final weights (version = steps), when evaluation is on."""
        version = self.plan.steps
        if not self.plan.held_out or version in self.evaluated or self._stop.is_set():
            return
        self.evaluated.add(version)
        self._load(version)
        every = self.requests.held_out(version, self.plan.held_out)
        self._submit(self.share.keep_held_out(version, version, every))

    # ------------------------------------------------------------------ collector
    def _collect(self) -> None:
        later: list[Future[Returned]] = []  # the rollout's work off this thread, in order
        try:
            while not self._stop.is_set():
                try:  # poll briefly while the rollout finishes work (environment steps)
                    sample = self.service.get(timeout=0.005 if later else 0.1)
                except TimeoutError:
                    sample = None
                except StreamClosed:
                    return
                if sample is not None:
                    self._settle(self.rollout.returned(sample), later)
                for f in [f for f in later if f.done()]:  # an episode has one out at a time
                    later.remove(f)
                    self._settle(f.result(), later)
        except BaseException as e:  # noqa: BLE001 - reported to the owner
            self._fail(self._component, e)

    _component = "generation service"  # what the collector was doing when it failed

    def _settle(self, returned: Returned, later: list[Future[Returned]]) -> None:
        """One returned sample's outcome: continuations submitted, work off this thread
        kept as a request still out, the sample handed on (its kept KV given up)."""
        out, now, pending = returned.sample, returned.now, returned.later
        if returned.release is not None:
            self.service.release(returned.release)  # re-prefilled in a later round
        for request_id in returned.released:
            self.service.release(request_id)
        self._submit(now)  # continuations whose round is already open
        if pending is not None:
            with self._cv:
                self._submitted += 1  # settled by the future's own `Returned`
            later.append(pending)
        for x in (out, *returned.also) if out is not None else ():
            if not x.tag.is_eval and x.finish_reason != "paused":
                self.live.observe(x.prompt, x.num_tokens)
            self.service.release(x.request_id)  # an episode ended: its slot is free
            self._component = self.plan.emit_component
            self.emit(x)
            self._component = "generation service"
        with self._cv:
            self._collected += 1
            self._cv.notify_all()
