"""Runs reward functions on a host thread pool as samples arrive.

`RewardPool.submit(text, metadata)` returns a `Future[RewardResult]` at once;
`map(samples)` scores many and returns results in input (arrival) order. A
reward function that raises is never silently dropped:

* `on_error="raise"`: the exception is stored in the future and re-raised to
  whoever calls `future.result()` (or `map`), with the prompt id in the log.
* `on_error="zero"`: the sample scores 0 (`RewardResult.error` holds the
  exception's repr), the error is counted (`num_errors`) and logged.

Every blocking wait takes a timeout and names the reward pool and the prompt
in its `TimeoutError`. Rule-based rewards are cheap Python; threads keep the
trainer loop free while they run (the scorers release little of the GIL, so
this is for overlap, not for parallel speed-up).
"""

import concurrent.futures
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from absl import logging

from streamrl_jax.rewards.base import RewardFn, RewardResult

OnError = Literal["raise", "zero"]


class RewardPool:
    """Thread pool that scores samples with one `RewardFn`.

    Args:
      reward_fn: the reward function, called as `reward_fn(text, metadata)`.
      num_workers: threads.
      on_error: `"raise"` or `"zero"` (module docstring).
    """

    def __init__(self, reward_fn: RewardFn, *, num_workers: int = 2, on_error: OnError = "raise"):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error={on_error!r}; expected 'raise' or 'zero'")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self._reward_fn = reward_fn
        self._on_error = on_error
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="reward"
        )
        self._lock = threading.Lock()
        self._num_errors = 0
        self._num_scored = 0
        self._num_submitted = 0

    @property
    def num_errors(self) -> int:
        """Calls that raised (scored 0 under `on_error="zero"`, re-raised otherwise)."""
        with self._lock:
            return self._num_errors

    @property
    def num_scored(self) -> int:
        """Calls that finished, with or without error."""
        with self._lock:
            return self._num_scored

    def pending(self) -> int:
        """Calls submitted and not finished yet."""
        with self._lock:
            return self._num_submitted - self._num_scored

    def _score(self, text: str, metadata: dict[str, Any]) -> RewardResult:
        try:
            result = self._reward_fn(text, metadata)
        except Exception as e:
            with self._lock:
                self._num_errors += 1
                self._num_scored += 1
            logging.warning(
                "reward fn raised on prompt %s (on_error=%s): %r",
                metadata.get("prompt_id", "?"),
                self._on_error,
                e,
            )
            if self._on_error == "raise":
                raise
            return RewardResult(
                score=0.0, correct=False, extracted_answer=None, format_ok=False, error=repr(e)
            )
        with self._lock:
            self._num_scored += 1
        return result

    def submit(
        self, text: str, metadata: dict[str, Any]
    ) -> "concurrent.futures.Future[RewardResult]":
        """Schedules one sample; the future holds its result (or its exception)."""
        with self._lock:
            self._num_submitted += 1
        return self._executor.submit(self._score, text, metadata)

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
        """Stops the workers (waits for running calls; drops queued ones if asked)."""
        self._executor.shutdown(wait=True, cancel_futures=cancel_pending)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_pending=True)
