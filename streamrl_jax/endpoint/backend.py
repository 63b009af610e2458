"""What the endpoint generates with: a generation service, its samples routed back to
the request that asked for them.

`ServiceBackend` owns a `GenerationService` and one `endpoint-dispatch` thread that
takes every finished sample and resolves the future of the request with its id. A
request whose future nobody waits for any more (its client went away, its deadline
passed) is still collected, then dropped, and its kept slot given up: nothing leaks
and nothing waits on it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Protocol

from absl import logging

from streamrl_jax.generation.service import GenerationService, StreamClosed
from streamrl_jax.generation.types import GenerationRequest, Sample


class Backend(Protocol):
    """Generation for the endpoint."""

    version: int  # the policy version new tokens are sampled with

    def submit(self, request: GenerationRequest) -> Future[Sample]:
        """Queues `request`; the future resolves to its sample (or its failure)."""

    def release(self, request_id: Any) -> None:
        """The episode of `request_id` ended: its kept slot is given up."""

    def validate(self, request: GenerationRequest) -> None:
        """Raises ValueError naming what is wrong with `request` for this engine."""


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

    def validate(self, request: GenerationRequest) -> None:
        self.service.engines[0].validate(request)

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
