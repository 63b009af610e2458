"""Scores samples as they arrive: on a host thread pool, or in confined worker processes.

`RewardPool.submit(text, metadata)` returns a `Future[RewardResult]` at once;
`map(samples)` scores many and returns results in input (arrival) order.

* **Inline** (`sandbox=None`): a thread pool in this process, for scorers known
  not to evaluate model text (`rewards.tasks.INLINE_SAFE_TASKS`, the caller's
  own functions). Threads keep the trainer loop free while they run.
* **Sandboxed** (`sandbox=Limits(...)`): confined, spawned worker processes
  with a deadline per call (`sandbox.py`): a scorer that `eval`s the answer or
  computes for ever costs one timeout, never the trainer's threads.

A failed call (the scorer raised, timed out or its worker died) is never
silently dropped:

* `on_error="raise"`: the exception is stored in the future and re-raised to
  whoever calls `future.result()` (or `map`), with the prompt id in the log.
* `on_error="zero"`: the sample scores 0 (`RewardResult.error` holds the
  exception's repr), the error is counted (`num_errors`; timeouts also in
  `num_timeouts`) and logged.

Every blocking wait takes a timeout and names the reward pool and the prompt
in its `TimeoutError`.
"""

import concurrent.futures
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from absl import logging

from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.sandbox import Limits, RewardTimeout, SandboxPool

OnError = Literal["raise", "zero"]


class RewardPool:
    """Scores samples with one `RewardFn`, inline or sandboxed (module docstring).

    Args:
      reward_fn: the reward function, called as `reward_fn(text, metadata)`; picklable
        (and importable by module path) when sandboxed.
      num_workers: threads, or worker processes when sandboxed.
      on_error: `"raise"` or `"zero"` (module docstring).
      sandbox: the worker limits (deadline, memory, ...) to score in confined
        processes; None scores in this process.
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        *,
        num_workers: int = 2,
        on_error: OnError = "raise",
        sandbox: Limits | None = None,
    ):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error={on_error!r}; expected 'raise' or 'zero'")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self._reward_fn = reward_fn
        self._on_error = on_error
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._sandbox: SandboxPool | None = None
        if sandbox is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=num_workers, thread_name_prefix="reward"
            )
        else:
            self._sandbox = SandboxPool(reward_fn, workers=num_workers, limits=sandbox)
        self._lock = threading.Lock()
        self._num_errors = 0
        self._num_timeouts = 0
        self._num_scored = 0
        self._num_submitted = 0

    @property
    def num_timeouts(self) -> int:
        """Calls that ran past the sandbox's deadline (their worker was replaced)."""
        with self._lock:
            return self._num_timeouts

    @property
    def num_errors(self) -> int:
        """Calls that raised (scored 0 under `on_error="zero"`, re-raised otherwise)."""
        with self._lock:
            return self._num_errors

    def pending(self) -> int:
        """Calls submitted and not finished yet."""
        with self._lock:
            return self._num_submitted - self._num_scored

    def _settle(
        self, inner: concurrent.futures.Future, outer: concurrent.futures.Future, metadata: dict
    ) -> None:
        """The call's outcome into `outer`, applying `on_error` to a failure."""
        try:
            result = inner.result()
        except Exception as e:  # noqa: BLE001 - handed on, or scored 0 and counted
            with self._lock:
                self._num_errors += 1
                self._num_timeouts += isinstance(e, RewardTimeout)
                self._num_scored += 1
            logging.warning(
                "reward fn raised on prompt %s (on_error=%s): %r",
                metadata.get("prompt_id", "?"),
                self._on_error,
                e,
            )
            if self._on_error == "raise":
                outer.set_exception(e)
            else:
                outer.set_result(
                    RewardResult(
                        score=0.0,
                        correct=False,
                        extracted_answer=None,
                        format_ok=False,
                        error=repr(e),
                    )
                )
            return
        with self._lock:
            self._num_scored += 1
        outer.set_result(result)

    def submit(
        self, text: str, metadata: dict[str, Any]
    ) -> "concurrent.futures.Future[RewardResult]":
        """Schedules one sample; the future holds its result (or its exception)."""
        with self._lock:
            self._num_submitted += 1
        if self._sandbox is not None:
            inner = self._sandbox.submit(
                text, metadata, label=f"prompt {metadata.get('prompt_id', '?')}"
            )
        else:
            inner = self._executor.submit(self._reward_fn, text, metadata)
        outer: concurrent.futures.Future = concurrent.futures.Future()
        inner.add_done_callback(lambda f: self._settle(f, outer, metadata))
        return outer

    def map(
        self, samples: Iterable[tuple[str, dict[str, Any]]], *, timeout_s: float = 60.0
    ) -> list[RewardResult]:
        """Scores `(text, metadata)` pairs; results in input order.

        Raises:
          TimeoutError: a result was not ready within `timeout_s` of the call.
          Exception: the reward fn's exception, under `on_error="raise"`.
        """
        pending: Sequence[tuple[concurrent.futures.Future[RewardResult], dict[str, Any]]] = [
            (self.submit(text, metadata), metadata) for text, metadata in samples
        ]
        done, not_done = concurrent.futures.wait([f for f, _ in pending], timeout=timeout_s)
        if not_done:
            stuck = [m.get("prompt_id", "?") for f, m in pending if f in not_done]
            raise TimeoutError(
                f"reward pool: {len(not_done)} of {len(pending)} reward calls did not finish "
                f"within {timeout_s} s (prompt ids {stuck[:5]})"
            )
        return [f.result() for f, _ in pending]

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops the workers. Threads: waits for running calls (drops queued ones if
        asked). Sandboxed: terminates the workers at once, stuck or not."""
        if self._sandbox is not None:
            self._sandbox.close()
        else:
            self._executor.shutdown(wait=True, cancel_futures=cancel_pending)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_pending=True)
