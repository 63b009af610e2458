"""Partial rollout: generation in rounds of a bounded token budget, unfinished samples
carried into the next round (docs/pipeline.md, "Partial rollout").

With `pipeline.partial_budget_tokens = T > 0` (stream_async), round r is the
generation behind training step r: the new prompts of batch r plus the
continuations of the samples paused in round r - 1, every segment at most T new
tokens (`GenerationRequest.segment_tokens`). A segment that reaches T unfinished
comes back as a partial sample (finish reason "paused") and joins round r + 1 as
a continuation (`generation.types.Continuation`: the engine re-prefills prompt +
response so far and samples on with the same per-token keys), under whatever
weights generation holds then. A round *closes* once every segment in it has
returned and the round before it has closed (so no more continuations can join);
step r trains exactly the groups whose last member finished in round r, so a step
waits for at most T tokens of any sample, never for the longest one.

Lag bound: a sample paused in round r can be trained at step r + 1 at the
earliest, so if r + 1 - (its oldest token's version) exceeds `max_lag` it never
will be; `pipeline.lag_policy` then either drops it (it is handed on as it is, with
finish reason "paused", and `micro_batches.pack_groups` drops its group, counted in
`dropped_lag`) or regenerates it from its prompt under the current weights
(counted in `regenerated`).

`PartialRollout` is the bookkeeping, shared by the driver thread (`open`), the
collector thread (`returned`) and the trainer (`wait_round`), under one lock;
`snapshot(k)` / `restore` carry the work in flight across a checkpoint at step
boundary k: the samples paused into round k and the finished members of groups
still incomplete when round k - 1 closed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from streamrl_jax.config import PipelineSection
from streamrl_jax.generation.types import (
    Continuation,
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.stream.sample_stream import StreamError

Key = tuple[int, int]  # (batch, group): a GRPO group


def group_of(sample: Sample) -> Key:
    return sample.tag.batch, sample.tag.group


@dataclasses.dataclass
class _Round:
    pending: int = 0  # segments submitted and not yet returned
    opened: bool = False  # the driver submitted the round's new prompts
    completed: list[Key] = dataclasses.field(default_factory=list)  # groups finished in it
    carried: list[Sample] = dataclasses.field(default_factory=list)  # paused into it


class PartialRollout:
    """Rounds, paused samples and round closure of one run (module docstring)."""

    def __init__(self, p: PipelineSection, schedule: Schedule):
        self.budget = p.partial_budget_tokens
        self.group_size, self.max_lag, self.policy = p.group_size, schedule.max_lag, p.lag_policy
        self._cv = threading.Condition()
        self._rounds: dict[int, _Round] = collections.defaultdict(_Round)
        self._waiting: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
        # Finished members by group, and the round each complete group completed in; both
        # (and the first requests) are kept until that round closes, so the snapshot taken
        # then sees exactly the state at its end even when later rounds already ran
        # (in-flight updates: round r + 1 starts before round r closes).
        self._finished: dict[Key, list[Sample]] = {}
        self._done_in: dict[Key, int] = {}
        self._origin: dict[Any, GenerationRequest] = {}  # request id -> its first request
        self._closed: dict[int, list[Key]] = {}  # round -> groups completed in it
        self._snapshots: dict[int, dict[str, Any]] = {}  # round -> the work carried into it
        self._next_close = 0
        self._error: BaseException | None = None
        self.regenerated = 0  # samples restarted from their prompt (lag_policy="regenerate")
        self.dropped = 0  # paused samples handed on to be dropped (lag_policy="drop")

    # ------------------------------------------------------------------ driver
    def open(self, r: int, new: list[GenerationRequest]) -> list[GenerationRequest]:
        """Round r's requests: the batch's new ones and the continuations paused into r,
        each a segment of at most `budget` tokens, counted before they are submitted."""
        with self._cv:
            tagged = [self._segment(q, r) for q in new]
            self._origin.update((q.request_id, q) for q in tagged)
            tagged += self._waiting.pop(r, [])
            rnd = self._rounds[r]
            rnd.pending += len(tagged)
            rnd.opened = True
            self._close_ready()
            return tagged

    def _segment(self, request: GenerationRequest, r: int) -> GenerationRequest:
        tag = dataclasses.replace(request.tag, round=r)
        return dataclasses.replace(request, tag=tag, segment_tokens=self.budget)

    # ------------------------------------------------------------------ collector
    def returned(self, sample: Sample) -> tuple[Sample | None, list[GenerationRequest]]:
        """A segment came back. Returns the sample to hand on (finished, or paused past the
        bound under "drop"; None when it continues) and continuation requests to submit
        now (their round is already open)."""
        with self._cv:
            r = sample.tag.round
            self._rounds[r].pending -= 1
            out: Sample | None = sample
            now: list[GenerationRequest] = []
            if sample.finish_reason == "paused":
                out, follow = self._continue(sample, r + 1)
                if follow is not None:
                    if self._rounds[r + 1].opened:
                        self._rounds[r + 1].pending += 1
                        now.append(follow)
                    else:
                        self._waiting[r + 1].append(follow)
                    self._rounds[r + 1].carried.append(sample)
            if out is not None:
                key = group_of(out)
                members = self._finished.setdefault(key, [])
                members.append(out)
                if len(members) == self.group_size:
                    self._done_in[key] = r
                    self._rounds[r].completed.append(key)
            self._close_ready()
            return out, now

    def _continue(self, s: Sample, r: int) -> tuple[Sample | None, GenerationRequest | None]:
        """What becomes of a sample paused before round r (its earliest training step)."""
        if r - s.oldest_version <= self.max_lag:
            return None, self._request(s, r, Continuation.of(s))
        if self.policy == "drop":
            self.dropped += 1
            return s, None
        self.regenerated += 1
        return None, self._request(s, r, None)

    def _request(self, s: Sample, r: int, cont: Continuation | None) -> GenerationRequest:
        first = self._origin[s.request_id]
        return dataclasses.replace(
            first, tag=dataclasses.replace(s.tag, round=r), continuation=cont
        )

    def _close_ready(self) -> None:
        """Closes rounds in order once opened, drained and their predecessor closed."""
        while True:
            r = self._next_close
            rnd = self._rounds.get(r)
            if rnd is None or not rnd.opened or rnd.pending > 0:
                return
            self._closed[r] = sorted(rnd.completed)
            # The work carried into round r + 1: its continuations, and the finished
            # members of groups still incomplete (what a checkpoint at r + 1 holds).
            # (Members that finished in later rounds are regenerated by a resumed run.)
            finished = [
                (s, None)
                for key, members in self._finished.items()
                if self._done_in.get(key, r + 1) > r
                for s in members
                if s.tag.round <= r
            ]
            carried = self._rounds[r + 1].carried
            self._snapshots[r + 1] = {
                "paused": [(s, self._origin[s.request_id]) for s in carried],
                "finished": finished,
            }
            for key in [k for k, q in self._done_in.items() if q <= r]:
                for s in self._finished.pop(key):
                    self._origin.pop(s.request_id, None)
                del self._done_in[key]
            del self._rounds[r]
            self._next_close = r + 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ trainer
    def wait_round(self, r: int, timeout: float) -> list[Key]:
        """The groups completed in round r, sorted, once it closed.

        Raises:
          TimeoutError: naming the round and the segments it still waits for.
          StreamError: the run failed or was stopped (`fail`; chained to the cause), as
            the sample stream raises for the trainer.
        """

        def stalled() -> str:
            pending = {q: x.pending for q, x in self._rounds.items() if q <= r}
            return (
                f"partial rollout: round {r} not closed after {timeout:.0f} s (segments "
                f"still running per round: {pending}); the generation service stalled"
            )

        return wait_closed(self._cv, self._closed, lambda: self._error, r, timeout, stalled)

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, k: int) -> dict[str, Any]:
        """JSON of the work carried into round k (k = 0: none); frees older snapshots."""
        with self._cv:
            snap = self._snapshots.get(k, {"paused": [], "finished": []}) if k else None
            for q in [q for q in self._snapshots if q < k]:
                del self._snapshots[q]
        snap = snap or {"paused": [], "finished": []}
        return {name: [to_json(s, q) for s, q in pairs] for name, pairs in snap.items()}

    def restore(self, k: int, saved: dict[str, Any]) -> list[Sample]:
        """Round k starts with the saved work: paused samples continue in it; returns
        the finished members of incomplete groups, to hand on again (ingest)."""
        finished = [from_json(x)[0] for x in saved.get("finished", [])]
        with self._cv:
            self._next_close = k
            for s, first in (from_json(x) for x in saved.get("paused", [])):
                self._origin[s.request_id] = first
                _, follow = self._continue(s, k)
                self._waiting[k].append(follow)
                self._rounds[k].carried.append(s)
            for s in finished:
                self._finished.setdefault(group_of(s), []).append(s)
        return finished

    def in_flight(self) -> dict[str, int]:
        """Samples paused or waiting for their group's other members (for the step's row)."""
        with self._cv:
            return {
                "paused": sum(len(x) for x in self._waiting.values())
                + sum(x.pending for x in self._rounds.values()),
                "waiting_members": sum(
                    len(m) for k, m in self._finished.items() if k not in self._done_in
                ),
            }


def wait_closed(
    cv: threading.Condition,
    closed: dict[int, list[Key]],
    failure: Callable[[], BaseException | None],
    r: int,
    timeout: float,
    stalled: Callable[[], str],
) -> list[Key]:
    """Round r's groups, popped from `closed` (guarded by `cv`) once it is there.

    Raises:
      StreamError: `failure()` is set (chained to it), as the sample stream raises.
      TimeoutError: after `timeout` seconds, with `stalled()`'s text (called under `cv`).
    """
    with cv:
        ok = cv.wait_for(lambda: r in closed or failure() is not None, timeout=timeout)
        error = failure()
        if error is not None:
            raise StreamError(f"partial rollout: {error!r}") from error
        if not ok:
            raise TimeoutError(stalled())
        return closed.pop(r)


def to_json(s: Sample, first: GenerationRequest | None) -> dict[str, Any]:
    """A sample (and the first request of a paused one) as JSON for the checkpoint's
    metadata: every field a continuation or the trainer reads; floats round-trip exactly
    (float32 -> float64 -> float32)."""
    out = {
        "request_id": s.request_id,
        "prompt": s.prompt.tolist(),
        "response": s.response.tolist(),
        "logprobs": s.logprobs.astype(np.float64).tolist(),
        "sampling_logprobs": s.sampling_logprobs.astype(np.float64).tolist(),
        "versions": s.versions().tolist(),
        "finish_reason": s.finish_reason,
        "policy_version": s.policy_version,
        "last_policy_version": s.last_policy_version,
        "instance_id": s.instance_id,
        "timings": dataclasses.asdict(s.timings),
        "tag": dataclasses.asdict(s.tag),
        "metadata": s.metadata,
    }
    if first is not None:
        out["request"] = {
            "max_new_tokens": first.max_new_tokens,
            "sampling": dataclasses.asdict(first.sampling),
            "seed": first.seed,
            "forced_length": first.forced_length,
            "priority": first.priority,
            "segment_tokens": first.segment_tokens,
        }
    return out


def from_json(x: dict[str, Any]) -> tuple[Sample, GenerationRequest | None]:
    sample = Sample(
        request_id=x["request_id"],
        prompt=np.asarray(x["prompt"], np.int32),
        response=np.asarray(x["response"], np.int32),
        logprobs=np.asarray(x["logprobs"], np.float32),
        sampling_logprobs=np.asarray(x["sampling_logprobs"], np.float32),
        finish_reason=x["finish_reason"],
        policy_version=int(x["policy_version"]),
        last_policy_version=int(x["last_policy_version"]),
        instance_id=int(x["instance_id"]),
        timings=Timings(**x["timings"]),
        tag=RequestTag(**x["tag"]),
        metadata=x["metadata"],
        token_versions=np.asarray(x["versions"], np.int32),
    )
    q = x.get("request")
    if q is None:
        return sample, None
    sampling = q["sampling"] | {"stop_ids": tuple(q["sampling"]["stop_ids"])}
    first = GenerationRequest(
        request_id=sample.request_id,
        prompt=sample.prompt.tolist(),
        max_new_tokens=q["max_new_tokens"],
        sampling=SamplingParams(**sampling),
        seed=q["seed"],
        forced_length=q["forced_length"],
        priority=q["priority"],
        tag=sample.tag,
        metadata=sample.metadata,
        segment_tokens=q["segment_tokens"],
    )
    return sample, first
