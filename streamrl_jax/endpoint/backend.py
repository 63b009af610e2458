"""What the endpoint generates with: a generation service, its samples routed back to
the request that asked for them.

`ServiceBackend` owns a `GenerationService` and one `endpoint-dispatch` thread that
takes every finished sample and resolves the future of the request with its id. A
request whose future nobody waits for any more (its client went away, its deadline
passed) is still collected, then dropped, and its kept slot given up: nothing leaks
and nothing waits on it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from absl import logging

from streamrl_jax.generation.service import GenerationService, StreamClosed
from streamrl_jax.generation.types import GenerationRequest, Sample


class Backend(Protocol):
    """Generation for the endpoint."""

    version: int  # the policy version new tokens are sampled with

    def submit(self, request: GenerationRequest) -> Future[Sample]:
        """Queues `request`; the future resolves to its sample (or its failure).

        Raises:
          ValueError: naming what is wrong with `request` for this engine (nothing queued).
        """

    def release(self, request_id: Any) -> None:
        """The episode of `request_id` ended: its kept slot is given up."""

    def choices(self, eid: str, n: int, fresh: Callable[[str], bool]) -> list[str] | None:
        """The episodes whose first turns are the n choices of a request of episode `eid`
        (`fresh(e)`: whether episode e has no turn yet, none in flight), `eid` first; None
        where the endpoint opens the others (a served endpoint).

        Raises:
          ValueError: naming why this request cannot have n choices.
        """


class ServiceBackend:
    """A `GenerationService` behind futures (module docstring)."""

    def __init__(self, service: GenerationService, version: int = 0):
        self.service, self.version = service, version
        self._lock = threading.Lock()
        self._waiting: dict[Any, Future[Sample]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._dispatch, name="endpoint-dispatch", daemon=True
        )
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future[Sample]:
        future: Future[Sample] = Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(RuntimeError(f"generation failed: {self._error!r}"))
                return future
            if request.request_id in self._waiting:
                raise ValueError(f"request {request.request_id!r} is already generating")
            self._waiting[request.request_id] = future
        try:
            self.service.submit([request])
        except BaseException:
            with self._lock:
                self._waiting.pop(request.request_id, None)
            raise
        return future

    def release(self, request_id: Any) -> None:
        self.service.release(request_id)

    def choices(self, eid: str, n: int, fresh: Callable[[str], bool]) -> list[str] | None:
        del eid, n, fresh  # every choice but the first is a new episode
        return None

    def update_weights(self, params: Any, version: int) -> None:
        """New weights for new tokens (a running turn keeps its KV; tokens keep versions)."""
        self.service.update_weights(params, version)
        self.version = version

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            try:
                sample = self.service.get(timeout=0.1)
            except TimeoutError:
                continue
            except StreamClosed:
                return
            except BaseException as e:  # noqa: BLE001 - every waiter gets it
                logging.error("endpoint: the generation service failed: %r", e)
                with self._lock:
                    self._error = e
                    waiting, self._waiting = self._waiting, {}
                for f in waiting.values():
                    f.set_exception(RuntimeError(f"generation failed: {e!r}"))
                return
            with self._lock:
                future = self._waiting.pop(sample.request_id, None)
            if future is None or not future.set_running_or_notify_cancel():
                self.service.release(sample.request_id)  # nobody waits: dropped
                continue
            future.set_result(sample)

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for f in waiting.values():
            f.cancel()
        self.service.close(timeout)


class PipelineBackend:
    """Generation through a training run's driver, for the endpoint's episodes that the
    run started (`pipeline/rollouts/agents.py`).

    The run registers each episode with the request it stands for (`expect`: its id,
    tag, seed and sampling, which every turn keeps). An episode's first request is
    taken by the rollout (`first`) and submitted with its batch; each later one
    becomes the outcome of the previous turn (`returned` hands the driver a future that
    the next request, or the episode's end through `finish`, settles), so the driver
    counts every turn as a request out and a weight swap waits for whole episodes. A
    streamed turn's request keeps its `on_tokens`: the run's engine, in this process
    (a generation process serves its own endpoint), reports to the stream.

    A group's episodes (one prompt's, registered with the same batch and group) may
    start with one request of n choices (`choices`): asked on the first episode not
    started yet, with n the number not started, its choices are those episodes' first
    turns, in member order, each keeping its own run identity.
    """

    version = 0  # (the driver's weights decide; the samples carry the versions)

    def __init__(self, validate: Any, follow: Any):
        """`validate(request)` raises ValueError for a request the engine cannot serve;
        `follow(request)` is the rollout's outcome that submits `request` (a `Returned`)."""
        self._validate, self._follow = validate, follow
        self._lock = threading.Lock()
        self._placeholder: dict[str, GenerationRequest] = {}  # episode id -> its request
        self._first: dict[str, Future[GenerationRequest]] = {}
        self._next: dict[str, Future[Any]] = {}  # episode id -> its pending `Returned`
        self._waiting: dict[Any, tuple[str, Future[Sample]]] = {}  # request id -> turn
        self._failed: dict[str, BaseException] = {}  # scaffolds that failed with a turn out
        self._groups: dict[tuple[int, int], list[str]] = {}  # (batch, group) -> its episodes

    def expect(self, eid: str, placeholder: GenerationRequest) -> None:
        with self._lock:
            self._placeholder[eid] = placeholder
            self._first[eid] = Future()
            group = self._groups.setdefault(_group_key(placeholder), [])
            group.append(eid)
            group.sort(key=lambda e: self._placeholder[e].tag.member)

    def choices(self, eid: str, n: int, fresh: Callable[[str], bool]) -> list[str]:
        """The episodes of `eid`'s group not started yet, in member order, when `eid` is
        the first of them and they are n (class docstring)."""
        with self._lock:
            p = self._placeholder.get(eid)
            if p is None:
                raise ValueError(f"episode {eid} is not one of the run's")
            key = _group_key(p)
            group = self._groups[key]
            waiting = [e for e in group if not self._first[e].done()]
            prompts = {(tuple(self._placeholder[e].prompt), self._placeholder[e].tag.prompt_id)
                       for e in group}  # fmt: skip
        waiting = [e for e in waiting if fresh(e)]
        where = f"batch {key[0]} group {key[1]}: {len(group)} episodes, {len(waiting)} not started"
        if len(prompts) != 1:
            raise ValueError(f"n={n}: episode {eid}'s group ({where}) is not one prompt's")
        if not waiting or waiting[0] != eid:
            raise ValueError(
                f"n={n}: episode {eid} is not the first of its group's episodes not started "
                f"({where}); ask with that episode's id"
            )
        if n != len(waiting):
            raise ValueError(
                f"n={n}: each choice is one of the run's episodes of its prompt; episode "
                f"{eid}'s group has {len(waiting)} not started ({where}): ask n={len(waiting)}"
            )
        return waiting

    def submit(self, request: GenerationRequest) -> Future[Sample]:
        """The episode's next turn: `request` under its run identity, to the driver
        (validated here: the driver's thread must not meet a request it cannot serve)."""
        eid = request.request_id
        with self._lock:
            p = self._placeholder.get(eid)
            if p is None:
                raise ValueError(f"episode {eid} is not one of the run's")
            sampling = dataclasses.replace(
                p.sampling,
                stop_ids=request.sampling.stop_ids,
                stop_texts=request.sampling.stop_texts,
            )
            q = dataclasses.replace(
                request, request_id=p.request_id, tag=p.tag, metadata=p.metadata, seed=p.seed,
                sampling=sampling,
            )  # fmt: skip
            self._validate(q)
            turn: Future[Sample] = Future()
            self._waiting[p.request_id] = (eid, turn)
            first = self._first[eid]
            later = None if not first.done() else self._next.pop(eid)
        if later is None:
            first.set_result(q)
        else:
            later.set_result(self._follow(q))
        return turn

    def first(self, eid: str, timeout: float) -> GenerationRequest:
        """The episode's first request, once its scaffold sent it.

        Raises:
          TimeoutError: naming the episode, when the scaffold sent nothing in time.
          Exception: the scaffold's own failure before its first request.
        """
        try:
            return self._first[eid].result(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"episode {eid}: its scaffold sent no request within {timeout:.0f} s"
            ) from None

    def returned(self, sample: Sample) -> Future[Any]:
        """A turn of an episode finished (the collector): its HTTP request is answered;
        the returned future settles with the episode's next `Returned`."""
        with self._lock:
            eid, turn = self._waiting.pop(sample.request_id)
            nxt: Future[Any] = Future()
            error = self._failed.pop(eid, None)
            if error is None:
                self._next[eid] = nxt
        if error is not None:  # its scaffold is gone: the episode fails the run
            nxt.set_exception(error)
        turn.set_result(sample)
        return nxt

    def finish(self, eid: str, outcome: Any = None, error: BaseException | None = None) -> None:
        """The episode's scaffold ended: its last turn's future settles with `outcome` (a
        `Returned`), or `error`; the episode is forgotten."""
        with self._lock:
            pending = self._next.pop(eid, None) or self._first.get(eid)
            p = self._placeholder.pop(eid, None)
            self._first.pop(eid, None)
            if p is not None:
                group = self._groups[_group_key(p)]
                group.remove(eid)
                if not group:
                    del self._groups[_group_key(p)]
            if (pending is None or pending.done()) and error is not None:
                self._failed[eid] = error  # a turn is still out: its return fails the run
        if pending is None or pending.done():
            return
        if error is not None:
            pending.set_exception(error)
        else:
            pending.set_result(outcome)

    def release(self, request_id: Any) -> None:
        del request_id  # the driver gives the slot up when the episode is handed on

    def fail(self, exc: BaseException) -> None:
        """The run failed: every turn waiting is failed with it."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for _, turn in waiting.values():
            if not turn.done():
                turn.set_exception(RuntimeError(f"the run failed: {exc!r}"))


def _group_key(request: GenerationRequest) -> tuple[int, int]:
    """The batch and GRPO group of a run's request."""
    return request.tag.batch, request.tag.group
