"""The Stream Generation Service (SGS): N engines, one thread each, one output stream.

Each instance is an `Engine` on its own ("tp",) mesh cut from the generation
mesh, with its own `EngineConfig` (so a long-tail instance can run a small
batch). `submit(requests, instances)` sends each request to its target
instance (round-robin by default; the skew-aware dispatcher chooses later);
the instance admits its queue in its own order (FIFO or LPT); a continuation of a
request whose slot an instance keeps (`GenerationRequest.keep_kv`: an episode's next
turn) goes to that instance, and `release` gives such a slot up. Every finished
sample goes into one bounded `sample_queue` (the package's `Mailbox`) in
completion order, the moment its instance's chunk returns.

A **tenant** shares an instance's devices and thread: `run_on(i, fn)` runs `fn` on
instance i's thread between two decode chunks (a judge's forward, `pipeline/tenant.py`),
so the tenant's work and the policy's decode take turns on the instance's devices
rather than contend for them; its future resolves to `fn`'s result or error, and a
service that closes or fails first fails it.

Failure and shutdown: an exception in an instance thread is recorded and
raised to the consumer by its next `get` as `InstanceError` naming the
instance; `close(timeout)` stops the threads, joins them with a timeout and
raises `TimeoutError` naming any instance that did not stop. Every blocking
wait here is a timed wait.

On CPU, XLA runs every device of a process on one thread pool, so instance
threads interleave rather than overlap (DESIGN.md §5); correctness does not
depend on it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from absl import logging
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import ChunkReport, GenerationRequest, Sample
from streamrl_jax.mailbox import Mailbox
from streamrl_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class _Release:
    """An instance inbox's order to give up the slot kept for `request_id`."""

    request_id: Any


@dataclasses.dataclass(frozen=True)
class _Task:
    """A tenant's work for an instance's thread (`GenerationService.run_on`)."""

    fn: Callable[[], Any]
    future: Future
    what: str


class InstanceError(RuntimeError):
    """A generation instance's thread raised; the original exception is chained."""


class StreamClosed(RuntimeError):
    """The sample stream was closed and holds no more samples."""


def sample_queue(capacity: int, name: str = "sgs") -> Mailbox[Sample]:
    """The service's bounded output: a `Mailbox` of samples in the service's vocabulary.

    `get` raises `InstanceError` (naming the instance, before any queued
    sample), `StreamClosed` once closed and drained, `TimeoutError`; `offer`
    returns False while full past its timeout, or once closed or failed.
    """
    return Mailbox(
        name,
        capacity=capacity,
        failed=InstanceError,
        closed=StreamClosed,
        timeout_error=TimeoutError,
    )


def precompiled(name: str, engine: Engine, continuations: bool) -> None:
    """`engine.compile_shapes`, logged with its count and time."""
    t0 = time.perf_counter()
    n = engine.compile_shapes(continuations)
    logging.info("%s: precompiled %d executables in %.1f s", name, n, time.perf_counter() - t0)


class GenerationService:
    """N generation instances behind `submit` / `get` / `update_weights` / `close`."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        model_cfg: ModelConfig,
        meshes: Sequence[Mesh],
        engine_cfgs: EngineConfig | Sequence[EngineConfig],
        *,
        version: int = 0,
        capacity: int = 4096,
        poll_s: float = 0.05,
        name: str = "sgs",
        on_chunk: Callable[[ChunkReport], None] | None = None,
        precompile: bool = False,
        continuations: bool = False,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ):
        """Builds one engine per mesh and starts its thread.

        Args:
          graphdef, params: the model; params are placed on every instance.
          model_cfg: the model's config.
          meshes: one ("tp",) mesh per instance (`mesh.instance_meshes`).
          engine_cfgs: one config for all instances, or one per instance.
          version: policy version of `params`.
          capacity: bound of the output sample queue (back-pressure).
          poll_s: the period of every timed wait inside the instance threads.
          name: used in errors and logs.
          on_chunk: observer of every engine step's `ChunkReport`, called on the
            instance's thread (see `Engine`).
          precompile: each instance thread compiles every executable its engine can
            run before it serves (`Engine.compile_shapes`; `continuations`: partial
            rollout's re-prefill buckets too); submitted requests wait in its inbox.
          detokenize: the tokenizer's decode, for requests with stop strings (`Engine`).
        """
        if isinstance(engine_cfgs, EngineConfig):
            engine_cfgs = [engine_cfgs] * len(meshes)
        if len(engine_cfgs) != len(meshes) or not meshes:
            raise ValueError(
                f"{name}: need one EngineConfig per instance mesh "
                f"({len(engine_cfgs)} configs for {len(meshes)} meshes)"
            )
        self.name, self.poll_s = name, poll_s
        self._precompile, self._continuations = precompile, continuations
        self.engines = [
            Engine(
                graphdef,
                params,
                model_cfg,
                c,
                m,
                instance_id=i,
                version=version,
                on_chunk=on_chunk,
                detokenize=detokenize,
            )
            for i, (c, m) in enumerate(zip(engine_cfgs, meshes, strict=True))
        ]
        self.queue = sample_queue(capacity, name)
        self._inboxes: list[collections.deque] = [collections.deque() for _ in self.engines]
        self._tasks: list[collections.deque[_Task]] = [collections.deque() for _ in self.engines]
        self.tenant_s = [0.0] * len(self.engines)  # seconds each instance ran tenants' work
        self._ended: dict[int, BaseException] = {}  # instances whose thread ended: why
        self._wake = [threading.Event() for _ in self.engines]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._round_robin = itertools.cycle(range(len(self.engines)))
        self._kept: dict[Any, int] = {}  # request id -> the instance keeping its slot
        self._submitted = self._delivered = 0
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-instance-{i}", daemon=True)
            for i in range(len(self.engines))
        ]
        for t in self._threads:
            t.start()

    @property
    def num_instances(self) -> int:
        return len(self.engines)

    def param_shardings(self) -> list[Any]:
        """Per instance, the NamedShardings its weights live in (for weight sync)."""
        return [e.param_shardings for e in self.engines]

    # ------------------------------------------------------------------ client API
    def submit(
        self, requests: Sequence[GenerationRequest], instances: Sequence[int] | None = None
    ) -> None:
        """Queues requests on their target instances (all validated before any is queued).

        Args:
          requests: in admission order (each instance keeps this order for FIFO).
          instances: target instance per request; None = round-robin.

        Raises:
          ValueError: naming the request and field, or an unknown instance.
        """
        if self._stop.is_set():
            raise StreamClosed(f"{self.name}: submit after close")
        if instances is None:
            with self._lock:
                instances = [next(self._round_robin) for _ in requests]
        if len(instances) != len(requests):
            raise ValueError(
                f"{self.name}: instances has {len(instances)} entries for {len(requests)} requests"
            )
        with self._lock:  # a continuation goes where its slot is kept (an episode's turn)
            instances = [
                self._kept.pop(r.request_id, i) if r.continuation is not None else i
                for r, i in zip(requests, instances, strict=True)
            ]
        for r, i in zip(requests, instances, strict=True):
            if not isinstance(i, int) or not 0 <= i < len(self.engines):
                raise ValueError(
                    f"{self.name}: request {r.request_id!r}: unknown instance {i!r} "
                    f"(the service has instances 0..{len(self.engines) - 1})"
                )
            self.engines[i].validate(r)
        now = time.time()
        with self._lock:
            self._submitted += len(requests)
            for r, i in zip(requests, instances, strict=True):
                self._inboxes[i].append((r, now))
        for i in set(instances):
            self._wake[i].set()

    def release(self, request_id: Any) -> None:
        """The episode of `request_id` ended: the slot kept for its continuation (if any)
        is given up, on its instance's thread."""
        with self._lock:
            i = self._kept.pop(request_id, None)
            if i is not None:
                self._inboxes[i].append((_Release(request_id), 0.0))
        if i is not None:
            self._wake[i].set()

    def run_on(self, instance: int, fn: Callable[[], Any], what: str) -> Future:
        """Runs `fn()` on instance `instance`'s thread between two of its decode chunks
        (module docstring: a tenant); the future holds its result or its exception.

        Raises:
          StreamClosed: the service is closed (nothing queued).
          ValueError: an unknown instance.
        """
        if not 0 <= instance < len(self.engines):
            raise ValueError(
                f"{self.name}: {what}: unknown instance {instance!r} (the service has "
                f"instances 0..{len(self.engines) - 1})"
            )
        future: Future = Future()
        with self._lock:
            if self._stop.is_set():
                raise StreamClosed(f"{self.name}: {what} after close")
            if instance in self._ended:
                future.set_exception(self._ended[instance])
                return future
            self._tasks[instance].append(_Task(fn, future, what))
        self._wake[instance].set()
        return future

    def _run_tasks(self, i: int) -> None:
        """Instance i's queued tenant work, in order, on its thread."""
        while True:
            with self._lock:
                if not self._tasks[i]:
                    return
                task = self._tasks[i].popleft()
            if not task.future.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            try:
                task.future.set_result(task.fn())
            except BaseException as e:  # noqa: BLE001 - the tenant's, handed to its caller
                task.future.set_exception(e)
            self.tenant_s[i] += time.perf_counter() - t0

    def _fail_tasks(self, i: int, exc: BaseException) -> None:
        """Instance i's thread ended: its queued tenant work and any later fail with `exc`."""
        with self._lock:
            self._ended.setdefault(i, exc)
            tasks, self._tasks[i] = list(self._tasks[i]), collections.deque()
        for task in tasks:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(exc)

    def get(self, timeout: float) -> Sample:
        """The next completed sample, in completion order.

        Raises:
          InstanceError: an instance failed (named; raised before any queued sample).
          StreamClosed: the service was closed and every sample taken.
          TimeoutError: no sample finished within `timeout` seconds.
        """
        sample = self.queue.get(
            timeout=timeout,
            what=f"a sample (no sample finished on {len(self.engines)} instance(s))",
        )
        with self._lock:
            self._delivered += 1
        return sample

    @property
    def pending(self) -> int:
        """Submitted samples not yet returned by `get`."""
        with self._lock:
            return self._submitted - self._delivered

    def update_weights(self, params: nnx.State | Sequence[nnx.State], version: int) -> None:
        """New weights for every instance (one tree, or one per instance already placed),
        applied by each instance before its next decode chunk."""
        per = list(params) if isinstance(params, list | tuple) else [params] * len(self.engines)
        if len(per) != len(self.engines):
            raise ValueError(
                f"{self.name}: {len(per)} param trees for {len(self.engines)} instances"
            )
        for engine, p in zip(self.engines, per, strict=True):
            engine.update_weights(p, version)
        for w in self._wake:
            w.set()

    def update_adapter(
        self,
        slot: int,
        params: nnx.State | Sequence[nnx.State],
        version: int,
        alpha: float | None = None,
    ) -> None:
        """A LoRA adapter for adapter slot `slot` of every instance (one tree, or one per
        instance already placed: a model state or its adapters alone), at policy
        `version`, with its own `alpha` (None: the model's); each instance writes it
        before its next decode chunk, the base and the other slots untouched
        (`Engine.update_adapter`)."""
        per = list(params) if isinstance(params, list | tuple) else [params] * len(self.engines)
        if len(per) != len(self.engines):
            raise ValueError(
                f"{self.name}: {len(per)} adapter trees for {len(self.engines)} instances"
            )
        for engine, p in zip(self.engines, per, strict=True):
            engine.update_adapter(slot, p, version, alpha)
        for w in self._wake:
            w.set()

    def metrics(self) -> dict[int, dict[str, Any]]:
        """Per instance: tokens, busy_s, tokens_per_s, mean_occupancy, queue_length,
        tenant_s (seconds of tenants' work), and the (time, running slots, queued, tokens)
        timeline of its chunks."""
        out = {}
        for i, e in enumerate(self.engines):
            m = e.metrics()
            m["queue_length"] = len(self._inboxes[i]) + e.queue_length
            m["num_slots"] = e.cfg.num_slots
            m["tenant_s"] = self.tenant_s[i]
            out[i] = m
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Stops every instance and closes the stream (queued samples stay readable).

        Raises:
          TimeoutError: naming the instances whose thread did not stop in time.
        """
        self._stop.set()
        for w in self._wake:
            w.set()
        deadline = time.monotonic() + timeout
        stalled = []
        for i, t in enumerate(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stalled.append(f"instance {i} ({t.name})")
        self.queue.close()
        if stalled:
            raise TimeoutError(
                f"{self.name}: did not stop within {timeout} s: {', '.join(stalled)}"
            )

    def __enter__(self) -> GenerationService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ instance threads
    def _loop(self, i: int) -> None:
        engine, inbox, wake = self.engines[i], self._inboxes[i], self._wake[i]
        try:
            if self._precompile:
                precompiled(f"{self.name} instance {i}", engine, self._continuations)
            while not self._stop.is_set():
                with self._lock:
                    batch = list(inbox)
                    inbox.clear()
                for r, t in batch:
                    if isinstance(r, _Release):
                        engine.release(r.request_id)
                    else:
                        engine.submit([r], enqueue_time=t)
                self._run_tasks(i)
                if not engine.has_work():
                    wake.wait(self.poll_s)
                    wake.clear()
                    continue
                for sample in engine.step():
                    if engine.holding(sample.request_id):
                        with self._lock:
                            self._kept[sample.request_id] = i
                    while not self.queue.offer(sample, timeout=self.poll_s):
                        # Full: wait for the consumer; closed or failed: nobody will take it.
                        if self._stop.is_set() or self.queue.closed or self.queue.error is not None:
                            return
                        # A consumer held up behind a tenant (a judge's verdicts) is freed.
                        self._run_tasks(i)
        except BaseException as e:  # noqa: BLE001 - reported to the consumer, never swallowed
            logging.exception("%s: instance %d failed", self.name, i)
            self.queue.fail(e, f"generation instance {i}")
            self._fail_tasks(
                i, InstanceError(f"{self.name}: generation instance {i} failed: {e!r}")
            )
        finally:
            self._fail_tasks(i, StreamClosed(f"{self.name}: instance {i} stopped"))
