"""Partial rollout: generation in rounds of a bounded token budget, unfinished samples
carried into the next round (docs/pipeline.md, "Partial rollout").

With `pipeline.rollout="partial"` and `pipeline.partial_budget_tokens = T`
(stream_async), round r is the
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

Episodes (`episodes+partial`): the budget is an episode's per round; its next turn
comes through `next_turn` (`protocol.Rounds`): in the open round with what is left of
the budget (the episode stays one segment of the round while its environment steps),
else carried into the next round as a paused sample holding the environment's tokens.
`_origin` then holds the turn's request, which the episode's continuations repeat.

`PartialRollout` is the bookkeeping, shared by the driver thread (`open`), the
collector thread (`returned`) and the trainer (`micro_batches`, which waits for the
round to close), under one lock; `state(k)` / `restore` carry the work in flight
across a checkpoint at step boundary k: the samples paused into round k and the
finished members of groups still incomplete when round k - 1 closed.

**Across processes** (any number of generation and training processes): each
generation process runs the `PartialRollout` of the groups it owns (its driver's half:
rounds, paused samples, continuations) and reports each round's closure to every
training process (`RoundClosed`, sent by `processes/generation.py`); a training process
runs `RemoteRounds`, the trainer's half: step r trains the groups every generation
process's report says round r completed (with several training processes each its own,
`Ownership.settled_slices`). The work a checkpoint at k must hold lives in the generation
processes: each writes its share when it closes round k - 1, before it reports it
(`processes/carried.py`), so the checkpoint names the shares (`RemoteRounds.state`) and
a resumed run's generation processes take them back.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streamrl_jax.config import PipelineSection
from streamrl_jax.data import Prompt
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import (
    Continuation,
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.pipeline.micro_batches import Group, GroupTaker, Scored
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    RolloutContext,
    StepOutcome,
    Submit,
)
from streamrl_jax.pipeline.shards import TrainerShare
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


def make(ctx: RolloutContext) -> PartialRollout | RemoteRounds:
    """The registry's entry: the trainer's half across processes, else the rounds here."""
    if ctx.where == "trainer":
        return RemoteRounds(ctx)
    return PartialRollout(ctx)


def _round_micro_batches(
    taker: GroupTaker, p: PipelineSection, want: list[Key], trainers: TrainerShare
) -> Iterator[list[Group]]:
    """The groups round r completed (`want`, sorted), as micro-batches: deterministic: in
    (batch, group) order, members in member order; otherwise whichever are ready first
    (scored), at least `min_groups` of them. Several training processes: each its own,
    in (batch, group) order (`Ownership.settled_slices`: the same calls on every one)."""
    if trainers.count > 1:
        for mine in trainers.own.settled_slices(want, lambda k: k[1], trainers.index):
            yield [taker.key(k) for k in mine]
        return
    i = 0
    while i < len(want):
        if p.deterministic:
            keys = want[i : i + p.micro_batch_groups]
        else:
            keys = taker.ready(want[i:], min(p.min_groups, len(want) - i))
            keys = keys[: p.micro_batch_groups]
            want[i:] = keys + [k for k in want[i:] if k not in keys]
        i += len(keys)
        yield [taker.key(k) for k in keys]


def _step_metrics(counts: dict[str, int], regenerated: int, dropped: int) -> StepOutcome:
    return StepOutcome(
        metrics={
            "carried_paused": float(counts["paused"]),
            "carried_members": float(counts["waiting_members"]),
            "regenerated": float(regenerated),
            "dropped_lag": float(dropped),
        }
    )


class PartialRollout:
    """Rounds, paused samples and round closure of one run (module docstring)."""

    def __init__(self, ctx: RolloutContext):
        p = ctx.pipeline
        self.ctx, self.p = ctx, p
        self.taker = GroupTaker(ctx.stream, p.timeout_s)
        self.budget = p.partial_budget_tokens
        self.group_size, self.max_lag, self.policy = (
            p.group_size,
            ctx.schedule.max_lag,
            p.lag_policy,
        )
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
        # request id -> its policy tokens when its segment in the current round began
        self._begun: dict[Any, int] = {}
        self._closed: dict[int, list[Key]] = {}  # round -> groups completed in it
        self._snapshots: dict[int, dict[str, Any]] = {}  # round -> the work carried into it
        self._next_close = 0
        self._error: BaseException | None = None
        self.regenerated = 0  # samples restarted from their prompt (lag_policy="regenerate")
        self.dropped = 0  # paused samples handed on to be dropped (lag_policy="drop")

    # ------------------------------------------------------------------ driver
    def draw(self, batch: int) -> list[Prompt]:
        return self.ctx.prompts.draw(batch, self.p.prompts_per_step)

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        del batch, submit, stopped

    def open(self, r: int, new: list[GenerationRequest]) -> list[GenerationRequest]:
        """Round r's requests: the batch's new ones and the continuations paused into r,
        each a segment of at most `budget` tokens, counted before they are submitted."""
        with self._cv:
            tagged = [self._segment(q, r) for q in new]
            self._origin.update((q.request_id, q) for q in tagged)
            self._begun.update((q.request_id, 0) for q in tagged)
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
    def returned(self, sample: Sample) -> Returned:
        """A segment came back. Returns the sample to hand on (finished, or paused past the
        bound under "drop"; None when it continues) and continuation requests to submit
        now (their round is already open)."""
        if sample.tag.is_eval:
            return Returned(sample, [])
        with self._cv:
            r = sample.tag.round
            self._rounds[r].pending -= 1
            out: Sample | None = sample
            now: list[GenerationRequest] = []
            if sample.finish_reason == "paused":
                out, now = self._carry(sample, r)
            if out is not None:
                self._member(out, r)
            self._close_ready()
            return Returned(out, now)

    def _member(self, out: Sample, r: int) -> None:
        """`out`, handed on in round r, is a member of its group (complete: in round r).
        Under the lock."""
        key = group_of(out)
        members = self._finished.setdefault(key, [])
        members.append(out)
        if len(members) == self.group_size:
            self._done_in[key] = r
            self._rounds[r].completed.append(key)

    def next_turn(self, turn: Sample, request: GenerationRequest) -> Returned:
        """An episode's next turn (`protocol.Rounds`): in round r while the episode has
        policy tokens of the round's budget left (its segment there goes on: the round's
        count of segments out is unchanged), else carried into round r + 1 (the episode
        so far, the environment's tokens included, as a paused sample)."""
        with self._cv:
            r, rid, cont = turn.tag.round, turn.request_id, request.continuation
            self._origin[rid] = request  # what the turn's continuations repeat
            left = self.budget - (cont.policy_tokens - self._begun[rid])
            if left >= 1:
                return Returned(None, [dataclasses.replace(request, segment_tokens=left)])
            self._rounds[r].pending -= 1
            out, now = self._carry(_paused(turn, cont), r)
            if out is not None:  # past the bound: the turn as it ended, to be dropped
                out = turn
                self._member(out, r)
            self._close_ready()
            return Returned(out, now, release=rid)

    def _carry(self, sample: Sample, r: int) -> tuple[Sample | None, list[GenerationRequest]]:
        """A sample paused in round r: continued in round r + 1 (at once when that round
        is open), or handed on past the lag bound (`_continue`). Under the lock."""
        out, follow = self._continue(sample, r + 1)
        if follow is None:
            return out, []
        self._rounds[r + 1].carried.append(sample)
        if self._rounds[r + 1].opened:
            self._rounds[r + 1].pending += 1
            return out, [follow]
        self._waiting[r + 1].append(follow)
        return out, []

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
        """A segment of `s` in round r: its request (an episode's: its turn's) again."""
        self._begun[s.request_id] = 0 if cont is None else cont.policy_tokens
        return dataclasses.replace(
            self._origin[s.request_id],
            tag=dataclasses.replace(s.tag, round=r),
            continuation=cont,
            segment_tokens=self.budget,
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
                    self._begun.pop(s.request_id, None)
                del self._done_in[key]
            del self._rounds[r]
            self._next_close = r + 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        self.ctx.stream.put(scored, timeout=self.p.timeout_s)

    def report(self, report: RoundClosed) -> None:
        raise TransportError(
            f"generation-{report.process} reported round {report.round}, but this process "
            "runs the rounds itself"
        )

    # ------------------------------------------------------------------ trainer
    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        """The groups round b completed (of any batch), once it closed."""
        del mini  # one mini-batch (config/rules.py)
        yield from _round_micro_batches(
            self.taker, self.p, self.wait_round(batch, self.p.timeout_s), self.ctx.trainers
        )

    def finish(self, batch: int) -> StepOutcome:
        del batch
        return _step_metrics(self.in_flight(), self.regenerated, self.dropped)

    def plannable(self, start: int, steps: int) -> range | None:
        """A round trains groups of batches up to `staleness` ahead of the last step."""
        return range(start, steps + self.ctx.schedule.staleness)

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
    def state(self, k: int) -> dict[str, Any]:
        """JSON of the work carried into round k (k = 0: none); frees older snapshots."""
        with self._cv:
            snap = self._snapshots.get(k, {"paused": [], "finished": []}) if k else None
            for q in [q for q in self._snapshots if q < k]:
                del self._snapshots[q]
        snap = snap or {"paused": [], "finished": []}
        return {name: [to_json(s, q) for s, q in pairs] for name, pairs in snap.items()}

    def restore(self, k: int, saved: dict[str, Any]) -> list[Sample]:
        # (k = 0, {}: a fresh run, nothing carried.)
        """Round k starts with the saved work: paused samples continue in it; returns
        the finished members of incomplete groups, to hand on again (ingest)."""
        if "carried_by" in saved:
            raise ValueError(
                f"resume from checkpoint {k}: it was saved across processes, whose carried "
                "partial-rollout work is in the workdir's carried/ directory; resume it "
                "across processes"
            )
        finished = [from_json(x)[0] for x in saved.get("finished", [])]
        with self._cv:
            if any(q >= k and x.opened for q, x in self._rounds.items()):
                # Its continuations would wait for a round that already took its requests:
                # lost, and the round would close without them.
                raise RuntimeError(
                    f"partial rollout: the work carried into round {k} restored after the "
                    "round opened; restore before the driver starts"
                )
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


class RemoteRounds:
    """The trainer's half of partial rollout across processes: the generation
    processes' round closures, as the trainer's steps wait for them (module docstring).

    A report (`report`, a sample channel's reader thread) is validated: the next round
    of a known process, groups of batches the round can hold. `micro_batches(r)` takes
    the groups round r completed once every generation process reported it; the step's
    counts (paused samples, waiting members, regenerated, dropped) are the sums of the
    processes' last reports.
    """

    def __init__(self, ctx: RolloutContext):
        self.ctx, self.p = ctx, ctx.pipeline
        self.taker = GroupTaker(ctx.stream, self.p.timeout_s)
        self._cv = threading.Condition()
        self._next = dict.fromkeys(ctx.generation_processes, 0)  # process -> next round
        self._groups: dict[int, set[Key]] = {}  # round -> groups reported so far
        self._counts: dict[int, RoundClosed] = {}  # process -> its last report
        self._closed: dict[int, list[Key]] = {}
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ generation side
    def draw(self, batch: int) -> list[Prompt]:
        """Batch b's prompts, as the generation processes draw them (the training link's
        check of every group, and the checkpoints' record of the iterator)."""
        return self.ctx.prompts.draw(batch, self.p.prompts_per_step)

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        raise RuntimeError(f"partial rollout: round {batch} runs in the generation process")

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        del batch, submit, stopped

    def returned(self, sample: Sample) -> Returned:
        raise RuntimeError(
            f"partial rollout: sample {sample.request_id} returned to the trainer's half"
        )

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        self.ctx.stream.put(scored, timeout=self.p.timeout_s)

    def report(self, report: RoundClosed) -> None:
        """A generation process's round closure.

        Raises:
          TransportError: naming the process and what is wrong (an unknown process, a
            round out of order, a group no batch of the round can hold).
        """
        who, r = f"generation-{report.process}", report.round
        n = self.p.prompts_per_step
        with self._cv:
            expected = self._next.get(report.process)
            if expected is None:
                raise TransportError(f"round report from {who}, which is not generating")
            if r != expected:
                raise TransportError(f"{who} reported round {r}; expected round {expected}")
            for batch, group in report.groups:
                if not (0 <= batch <= r and 0 <= group < n):
                    raise TransportError(
                        f"{who} reported group ({batch}, {group}) complete in round {r}: "
                        f"round {r} holds batches 0..{r}, groups 0..{n - 1}"
                    )
            self._next[report.process] = r + 1
            self._counts[report.process] = report
            self._groups.setdefault(r, set()).update(report.groups)
            if all(k > r for k in self._next.values()):
                self._closed[r] = sorted(self._groups.pop(r))
                self._cv.notify_all()

    # ------------------------------------------------------------------ trainer side
    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        del mini
        yield from _round_micro_batches(
            self.taker, self.p, self.wait_round(batch), self.ctx.trainers
        )

    def wait_round(self, r: int) -> list[Key]:
        """The groups completed in round r, sorted, once every generation process
        reported it.

        Raises:
          TimeoutError: naming the round and the processes that did not report it.
          StreamError: the run failed or was stopped (`fail`).
        """
        timeout = self.p.timeout_s

        def stalled() -> str:
            late = sorted(k for k, n in self._next.items() if n <= r)
            return (
                f"partial rollout: round {r} not reported closed after {timeout:.0f} s by "
                f"generation processes {late}; generation stalled"
            )

        return wait_closed(self._cv, self._closed, lambda: self._error, r, timeout, stalled)

    def finish(self, batch: int) -> StepOutcome:
        del batch
        with self._cv:
            reports = list(self._counts.values())
        counts = {
            "paused": sum(x.paused for x in reports),
            "waiting_members": sum(x.waiting_members for x in reports),
        }
        return _step_metrics(
            counts, sum(x.regenerated for x in reports), sum(x.dropped for x in reports)
        )

    def plannable(self, start: int, steps: int) -> range | None:
        return range(start, steps + self.ctx.schedule.staleness)

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        """The work carried into round k is the generation processes' (each wrote its
        share when it closed round k - 1, before reporting it: `processes/carried.py`);
        the checkpoint names them."""
        del k
        return {"carried_by": sorted(self.ctx.generation_processes)}

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        """Every process reports rounds from k on; the generation processes take the
        carried work back themselves (its finished members come to ingest from them).

        Raises:
          ValueError: a checkpoint one process saved (its carried work is in it).
        """
        if k > 0 and "carried_by" not in state:
            raise ValueError(
                f"resume from checkpoint {k}: one process saved it, with its partial-"
                "rollout work carried in the checkpoint; resume it in one process"
            )
        with self._cv:
            self._next = dict.fromkeys(self._next, k)
        return []

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()


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


def _paused(turn: Sample, cont: Continuation) -> Sample:
    """An episode's `turn` as a paused sample holding `cont` (its turns so far and the
    environment's tokens: where its next turn starts)."""
    return dataclasses.replace(
        turn,
        response=cont.tokens,
        logprobs=cont.logprobs,
        sampling_logprobs=cont.sampling_logprobs,
        token_versions=cont.versions,
        policy_mask=cont.policy_mask,
        finish_reason="paused",
    )


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
        "policy_mask": None if s.policy_mask is None else s.policy_mask.tolist(),
    }
    if first is not None:
        out["request"] = {
            "max_new_tokens": first.max_new_tokens,
            "sampling": dataclasses.asdict(first.sampling),
            "seed": first.seed,
            "forced_length": first.forced_length,
            "priority": first.priority,
            "segment_tokens": first.segment_tokens,
            "keep_kv": first.keep_kv,
            # (an episode's paused sample carries its outcome should it be dropped;
            # its request, the task's metadata only)
            "metadata": first.metadata,
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
        policy_mask=None if x.get("policy_mask") is None else np.asarray(x["policy_mask"], bool),
    )
    q = x.get("request")
    if q is None:
        return sample, None
    sampling = q["sampling"] | {
        "stop_ids": tuple(q["sampling"]["stop_ids"]),
        "stop_texts": tuple(q["sampling"].get("stop_texts", ())),  # (written before them: none)
    }
    first = GenerationRequest(
        request_id=sample.request_id,
        prompt=sample.prompt.tolist(),
        max_new_tokens=q["max_new_tokens"],
        sampling=SamplingParams(**sampling),
        seed=q["seed"],
        forced_length=q["forced_length"],
        priority=q["priority"],
        tag=sample.tag,
        metadata=q.get("metadata", sample.metadata),
        segment_tokens=q["segment_tokens"],
        keep_kv=q.get("keep_kv", False),
    )
    return sample, first
