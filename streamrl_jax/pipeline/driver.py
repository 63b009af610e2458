"""The generation driver: a thread feeding a `GenerationService` and a collector
thread draining it (DESIGN.md §4).

* **driver**: for batch b = start .. steps-1: W_{g(b)} from `weights`, swapped
  into the service only once every earlier request has finished (so no sample
  mixes versions), or with `pipeline.weight_update="inflight"` at once: each
  instance takes it at its next decode-chunk boundary while earlier requests
  keep running (their later tokens record the new version); the batch's prompts
  from `draw`; `make_requests` (per-sample seeds, so a sample depends only on
  weights, prompt and seed); this process's share of them (`share=(k, G)`: the
  groups it owns, index k mod G while no generation process is lost, `roster.py`;
  all of them when G = 1); the `LiveScheduler`'s
  instance plan; then its hooks: the held-out evaluation (its share too) every
  `eval.every` batches and at batch 0, once per policy version. After the last
  batch, the final evaluation of W_steps when evaluation is on.
* **partial rollout** (`rollout`, `pipeline.partial_budget_tokens`): batch b is
  round b, its requests segments of at most the budget plus the continuations of
  the samples paused in round b - 1 (`rollout.py`); the collector hands a paused
  sample back to the rollout (its continuation is submitted at once when its round
  is open) instead of to `emit`.
* **a lost generation process** (across processes; `roster.py`): `lose(update)`
  hands this driver the groups (and held-out prompts) of batches it already drew that
  it owns now (each batch split under `update.lost_at(batch)`: reserved processes own
  batches from their activation on; `before_draw(b)` reads the roster first);
  `regenerate()`, on the driver thread (or the owner's once that has ended),
  generates them under the batch's own version W_{g(b)} (`weights_at`: the recent
  placed versions), swapping it in and back only when the service holds another.
* **collector**: each finished sample, the moment it completes, goes to `emit`:
  in one process the run scores it and puts it into the sample stream
  (`ingest.py`); in a generation process it is sent to the training process
  (`generation_process.py`).

The same class runs in both places; only the three hooks differ (`weights`,
`draw`, `emit`). A training process of a multi-controller run has no driver: it
sees the generation processes through a `GenerationLink` (below).
Failures: an exception in either thread fails the owner's `FailureLatch`
naming the component; any failure on that latch (here or elsewhere) wakes
every wait here, and `stop()` ends both threads quietly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import Prompt, make_requests
from streamrl_jax.generation.service import GenerationService, StreamClosed
from streamrl_jax.generation.types import (
    ChunkReport,
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
)
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline.hooks import Hooks
from streamrl_jax.pipeline.rollout import PartialRollout
from streamrl_jax.pipeline.roster import RosterUpdate, owner, regenerate
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import TrainingGroup
from streamrl_jax.scheduling.live import LiveScheduler


class GenerationDriver:
    """Driver and collector threads around one `GenerationService` (module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        service: GenerationService,
        live: LiveScheduler,
        eval_prompts: Sequence[Prompt],
        *,
        weights: Callable[[int], list[Any]],
        draw: Callable[[int, int], list[Prompt]],
        emit: Callable[[Sample], None],
        latch: FailureLatch,
        start: int = 0,
        loaded_version: int = 0,
        expected_ids: dict[int, list[str]] | None = None,
        share: tuple[int, int] = (0, 1),
        emit_component: str = "generation service",
        rollout: PartialRollout | None = None,
        weights_at: Callable[[int], list[Any] | None] | None = None,
        dynamic: Any = None,
        draw_more: Callable[[int, int], list[Prompt]] | None = None,
    ):
        """Args:
        cfg: the experiment.
        service: the generation instances of this process.
        live: dispatch plan over this process's instances.
        eval_prompts: the held-out prompts (all of them; this process takes its share).
        weights: `weights(v)` blocks until W_v is available and returns it placed on
          every instance (one tree per instance).
        draw: `draw(batch, n)`: the batch's n prompts (every process draws all of them).
        emit: receives every finished sample (training and evaluation).
        latch: the owner's failure latch: this driver reports its threads' failures
          to it, and stops waiting once anything has failed it.
        start: first batch (a resumed run's checkpoint step).
        loaded_version: policy version the service holds now (-1: reload at the start).
        expected_ids: batch -> prompt ids the batch must draw (resume check).
        share: (k, G): this process keeps groups and eval prompts with index % G == k.
        emit_component: the component named when `emit` raises.
        rollout: partial rollout (`pipeline.partial_budget_tokens`): batch b is round b,
          with the continuations of the samples paused in round b - 1; a paused sample
          goes back to it, never to `emit`.
        weights_at: `weights_at(v)`: W_v placed on every instance if still kept here
          (None otherwise): groups generated again after a loss use their batch's version.
        dynamic: dynamic sampling's `DynamicSampler` (`pipeline.dynamic_sampling`): after
          submitting batch b the driver settles it (refill rounds under the same
          weights) before it draws batch b + 1 or loads other weights.
        draw_more: `draw_more(batch, n)`: n replacement prompts for `batch` (with `dynamic`).
        """
        self.cfg, self.service, self.live = cfg, service, live
        self.eval_prompts = list(eval_prompts)
        self.weights, self.draw, self.emit, self.latch = weights, draw, emit, latch
        self.start, self.version = start, loaded_version
        self.expected_ids = expected_ids or {}
        self.share, self.emit_component, self.rollout = share, emit_component, rollout
        self.dynamic, self.draw_more = dynamic, draw_more
        self.sched = Schedule.from_config(cfg.pipeline)
        self.timeout = cfg.pipeline.timeout_s
        self.sampling = SamplingParams(
            temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k,
            top_p=cfg.generation.top_p,
        )
        self.eval_versions: set[int] = set()  # versions whose eval was submitted
        self.hooks = Hooks()  # run after each batch is submitted, with the batch index
        if cfg.eval.num_problems > 0 and self.eval_prompts:
            # eval.every = 0: at the start only (and the final evaluation).
            self.hooks.add("eval", cfg.eval.every or cfg.pipeline.steps, self._eval)
        self._instances: list[int] | None = None  # the last batch's instance plan
        self._cv = threading.Condition()
        self._submitted = self._collected = 0  # requests sent to / returned by the service
        self._stop = threading.Event()
        latch.add_listener(lambda component, exc: self._wake())
        self.threads: list[threading.Thread] = []
        # Losing a generation process (roster.py): the lost set, the requests of the
        # recent batches and of every held-out version (all processes' shares), and
        # the requests to generate again, by the version they need.
        self.weights_at = weights_at
        # The roster in force (roster.py: lost and reserved processes); `before_draw(b)`
        # applies the updates published before W_{g(b)} was sent (elastic activations
        # name the batch they start from).
        self.roster = RosterUpdate(0, (), 0, {}, (), {})
        self.before_draw: Callable[[int], None] | None = None
        self._drawn: dict[int, list[GenerationRequest]] = {}
        self._evals: dict[int, list[GenerationRequest]] = {}
        self._eval_batch: dict[int, int] = {}  # held-out version -> batch it was drawn at
        self._again: dict[int, list[GenerationRequest]] = {}
        self._roster_lock = threading.Lock()
        self._keep = cfg.pipeline.staleness + 2  # the trainer is at most s + 1 batches behind

    # ------------------------------------------------------------------ control
    def start_threads(self) -> list[threading.Thread]:
        self.threads = [
            threading.Thread(target=self._drive, name="generation-driver", daemon=True),
            threading.Thread(target=self._collect, name="collector", daemon=True),
        ]
        for th in self.threads:
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
        timeout = self.timeout if timeout is None else timeout
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
    def _mine(self, index: int, batch: int) -> bool:
        k, g = self.share
        return owner(index, g, self.roster.lost_at(batch)) == k

    def _eval_requests(self, version: int, batch: int) -> list[GenerationRequest]:
        """This process's share of the held-out prompts of `version`, submitted at `batch`."""
        with self._roster_lock:
            self._evals[version] = every = self._all_eval_requests(version)
            self._eval_batch[version] = batch
            return [r for r in every if self._mine(r.tag.group, batch)]

    def _all_eval_requests(self, version: int) -> list[GenerationRequest]:
        g = self.cfg.generation
        return [
            GenerationRequest(
                request_id=f"eval/{version}/{i}",
                prompt=p.tokens,
                max_new_tokens=g.max_new_tokens,
                sampling=SamplingParams.greedy(),
                tag=RequestTag(group=i, prompt_id=p.problem.prompt_id, eval_version=version),
                metadata=p.problem.metadata,
            )
            for i, p in enumerate(self.eval_prompts)
        ]

    # ------------------------------------------------------------------ roster
    def lose(self, update: RosterUpdate) -> int:
        """A new roster (a generation process lost, back, or activated): queues the
        requests of batches and held-out versions already drawn that this process owns
        now and did not, except what the trainer already has. Returns how many."""
        k, g = self.share
        n = 0
        with self._roster_lock:
            before, self.roster = self.roster, update
            for b, requests in self._drawn.items():
                if b < update.floor:
                    continue
                have = set(update.complete.get(b, ()))
                groups = {r.tag.group for r in requests} - have
                mine = set(regenerate(groups, k, g, before.lost_at(b), update.lost_at(b)))
                again = [r for r in requests if r.tag.group in mine]
                self._again.setdefault(self.sched.generation_version(b), []).extend(again)
                n += len(again)
            for v, requests in self._evals.items():
                if v in update.evals_done:
                    continue
                have = set(update.evals.get(v, ()))
                at = self._eval_batch[v]
                indices = [r.tag.group for r in requests]
                mine = set(regenerate(indices, k, g, before.lost_at(at), update.lost_at(at)))
                again = [r for r in requests if r.tag.group in mine - have]
                self._again.setdefault(v, []).extend(again)
                n += len(again)
        self._wake()
        return n

    def regenerate(self) -> None:
        """Generates the queued requests of a lost process under their own versions
        (the driver thread, or the owner's thread once the driver has ended)."""
        with self._roster_lock:
            again, self._again = self._again, {}
        for version, requests in sorted(again.items()):
            if not requests:
                continue
            if version == self.version:
                self._submit(requests)
                continue
            held = self.version
            w, back = self.weights_at(version), self.weights_at(held)
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

    def _record(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Keeps a drawn batch's requests (all shares) a few batches; returns this
        process's share under the current roster."""
        with self._roster_lock:
            self._drawn.setdefault(batch, []).extend(requests)  # refills add groups
            for b in [b for b in self._drawn if b < batch - self._keep]:
                del self._drawn[b]
            return [r for r in requests if self._mine(r.tag.group, batch)]

    def _eval(self, batch: int) -> None:
        """The eval hook: the held-out prompts under the loaded weights, once per policy
        version (in stream_async several batches share one); round robin over the active
        instances when the batch had an instance plan."""
        if self.version in self.eval_versions:
            return
        self.eval_versions.add(self.version)
        requests = self._eval_requests(self.version, batch)
        instances = None
        if self._instances is not None:
            instances = [i % self.live.active for i in range(len(requests))]
        self._submit(requests, instances)

    def _load(self, version: int) -> None:
        """W_version into the service: once every earlier request has finished, or in
        flight (the instances swap at their next chunk boundary, nothing drained).
        The weights are fetched first: while a generation process waits for them it
        generates a lost process's groups again (`regenerate`), under the loaded
        version, and those must finish before the swap too."""
        weights = self.weights(version)
        if not self.sched.inflight:
            self.wait_idle()
        self.service.update_weights(weights, version)
        self.version = version

    def _submit(self, requests: list[GenerationRequest], instances: list[int] | None = None):
        if not requests:
            return
        with self._cv:
            self._submitted += len(requests)
        self.service.submit(requests, instances)

    def _drive(self) -> None:
        try:
            p = self.cfg.pipeline
            for b in range(self.start, p.steps):
                needed = self.sched.generation_version(b)
                if needed != self.version:
                    self._load(needed)
                if self._stop.is_set():
                    return
                if self.before_draw is not None:
                    self.before_draw(b)
                prompts = self.draw(b, p.prompts_per_step)
                requests = self._requests(b, prompts, 0)
                self.regenerate()
                if self.rollout is not None:
                    requests = self.rollout.open(b, requests)
                requests, self._instances = self.live.plan(b, requests)
                self._submit(requests, self._instances)
                self.hooks.run(b)
                if self.dynamic is not None:
                    self.dynamic.settle(b, functools.partial(self._refill, b), self._stop.is_set)
            self._final_eval()
        except BaseException as e:  # noqa: BLE001 - reported to the owner
            self._fail("generation driver", e)

    def _requests(self, b: int, prompts: list[Prompt], first: int) -> list[GenerationRequest]:
        """This process's requests for `prompts` as groups `first`.. of batch b, after
        checking them against a resumed run's record of the batch's draws."""
        ids = [q.problem.prompt_id for q in prompts]
        if b in self.expected_ids:
            # The checkpoint may have been written while the batch was still being
            # refilled: it records a prefix of the batch's draws.
            want = self.expected_ids[b][first : first + len(ids)]
            if ids[: len(want)] != want:
                raise RuntimeError(
                    f"resume: batch {b} drew prompts {ids[:3]}... as groups {first}.., the "
                    f"checkpoint recorded {want[:3]}... (prompt iterator state does not "
                    "match the checkpoint)"
                )
        if self.dynamic is not None:
            self.dynamic.expect(b, dict(enumerate(ids, start=first)))
        requests = make_requests(
            prompts,
            batch=b,
            group_size=self.cfg.pipeline.group_size,
            max_new_tokens=self.cfg.generation.max_new_tokens,
            sampling=self.sampling,
            run_seed=self.cfg.seed,
            length_replay=self.cfg.generation.length_replay,
            first_group=first,
        )
        return self._record(b, requests)

    def _refill(self, b: int, first: int, n: int) -> None:
        """Dynamic sampling: n replacement prompts for batch b as groups first.., under
        the weights the batch was generated with (still loaded)."""
        requests = self._requests(b, self.draw_more(b, n), first)
        requests, instances = self.live.plan(b, requests)
        self._submit(requests, instances)

    def _final_eval(self) -> None:
        """Greedy evaluation of the final weights (version = steps), when eval is on."""
        version = self.cfg.pipeline.steps
        if self.cfg.eval.num_problems == 0 or not self.eval_prompts:
            return
        if version in self.eval_versions or self._stop.is_set():
            return
        self.eval_versions.add(version)
        self._load(version)
        self._submit(self._eval_requests(version, version))

    # ------------------------------------------------------------------ collector
    def _collect(self) -> None:
        component = "generation service"
        try:
            while not self._stop.is_set():
                try:
                    sample = self.service.get(timeout=0.1)
                except TimeoutError:
                    continue
                except StreamClosed:
                    return
                out = sample
                if self.rollout is not None and not sample.tag.is_eval:
                    out, now = self.rollout.returned(sample)
                    self._submit(now)  # continuations whose round is already open
                if out is not None and out.finish_reason != "paused" and not out.tag.is_eval:
                    self.live.observe(out.prompt, out.num_tokens)
                if out is not None:
                    component = self.emit_component
                    self.emit(out)
                    component = "generation service"
                with self._cv:
                    self._collected += 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to the owner
            self._fail(component, e)


class GenerationLink(Protocol):
    """Generation in other processes, as a training process sees it."""

    num_instances: int  # generation instances over all generation processes
    group: TrainingGroup | None  # several training processes: this one's share

    def attach(
        self,
        on_sample: Callable[[Sample, Callable[[], None]], None],
        on_chunk: Callable[[ChunkReport], None],
        on_span: Callable[..., None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        """Starts delivering samples (credit back after `done()`), decode chunks, other
        trace spans (wall times) and lost processes to these callbacks."""

    def schedule(self, live: LiveScheduler) -> None:
        """The run's scheduler: the link observes arriving samples for its ranker
        refresh and sends refreshed ranker parameters to the generation processes."""

    def begin(self, resume: Any, weights: dict[int, list[Any]]) -> None:
        """Tells the generation processes the first batch (a restored run's
        `ResumePoint`, or None) and sends them its restored weight versions."""

    def close(self, outcome: str, timeout: float) -> None:
        """Tells the generation processes how the run ended and closes the channels."""
