"""DAPO's dynamic sampling: groups without reward variance never reach the trainer.

`pipeline.rollout="dynamic_sampling"` (DAPO, arXiv 2503.14476 §3.2): a GRPO group
whose rewards are all equal has zero advantage everywhere and only dilutes the
step, so it is skipped, and replacement prompts are drawn until the step holds
`pipeline.prompts_per_step` informative groups, or `pipeline.dynamic_sampling_max_draws`
extra prompts were drawn for it (then the step trains the informative groups it has;
`dynamic_short` in its metrics says so).

Where each part runs (one process; across processes see below):

* **judge** (`scored`, the reward pool's callback threads): the scored members of
  each group are held until the group is complete; its rewards (the outcome
  score plus the overlong penalty: what the advantages see) either vary, and
  the members go into the sample stream, or are all equal, and the group is
  recorded as skipped. Skipped groups never enter the stream.
* **refill** (`settle`, the generation driver's thread, right after it
  submitted batch b and before it draws batch b+1 or loads other weights):
  rounds of "wait until every group of b submitted so far is judged, then draw
  as many new prompts as groups are missing" (group indices continue after
  `prompts_per_step`; per-sample seeds from (run seed, batch, group, member) as
  for every sample). Refills therefore run under the same weights as the batch,
  W_{g(b)}: the version contract (DESIGN.md §2) holds in every mode; the batch's
  draws (originals, then its refill rounds) come before the next batch's
  from the prompt iterator, and a round's size depends only on the samples, so
  a resumed run draws and regenerates the same prompts (`resume.py`).
* **take** (`micro_batches`, `finish`, the trainer): a step trains the informative
  groups of its batch: all of them once the batch is settled (at most
  `prompts_per_step`, since each round draws only the missing number); a skipped
  group's prompt is still consumed (`consumed.jsonl` lists trained and skipped
  prompts of the step).

Costs: the next batch's generation waits for the current batch's refill rounds
(scoring its last group and generating the refills), which in stream_async
moves generation of b+1 later by that much.

Across processes (any number of generation and training processes): each generation
process judges the groups it made itself (`RolloutContext.score`: its own reward pool,
the same deterministic reward function) and publishes each verdict to the run's
`Verdicts` (`processes/verdicts.py`, the coordination service's store). Every process
decides a batch's refill rounds from all of them: a round waits until every group
submitted so far has a verdict, whichever process made it, and its size depends only on
those verdicts, so every generation process draws the same prompts (and submits its
share: `roster.py`) whatever the timing. Every sample still goes to the training process
that owns its group, which scores and judges it again; its own verdict must equal the
published one (else the run fails naming the group: the reward is not deterministic).
With a judge (`judge.model`) the rewards that decide a group hold its verdicts, which
only the training processes compute (the scoring stage, `pipeline/scoring.py`): then the
training processes judge the groups they own and publish the verdicts instead
(`RolloutContext.trainers_judge`), and the generation processes only read them. The
trainers *mirror* the rounds from the same verdicts (`_mirror`, on the trainer's
thread whenever it waits for the batch), drawing the round's missing number from their
own prompt sources, so their prompt iterators and their record of each batch's draws
stay the generation processes'. A refill group judged on a trainer before its round is
mirrored there is held and handed to the trainer's taker once it is
(`GroupTaker.park`). A trainer draws a batch's originals at the step's start and its
refills during the step, so its draws keep the generation processes' order: originals
of b, refills of b, originals of b+1. With one training process the step trains what
one process trains, in the same order (bit for bit). With T > 1 training processes each
trains the informative groups it owns (by index, `shards.Ownership`, as every group),
once the batch is settled, `micro_batch_groups / T` per micro-batch in index order, as
many micro-batches as the process with the most needs (one with fewer feeds padding
rows): the same groups as one process, summed in another order (the two-trainer
tolerance of `tests/multicontroller_test.py`). The first training process publishes how
many refills each trained batch drew (a restarted generation process moves its prompt
iterator past them) and drops old verdicts.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from streamrl_jax.data import Prompt
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.pipeline.micro_batches import Group, GroupTaker, Scored, shaped_rewards
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    RolloutContext,
    StepOutcome,
    Submit,
)

_SLICE_S = 0.5  # waits poll the failure latch and the driver's stop at this period


@dataclasses.dataclass
class Outcome:
    """One batch's groups as dynamic sampling judged them."""

    submitted: int = 0  # groups submitted (originals and refills)
    # group -> informative: this process's judgments; across processes every generation
    # process's, from the run's `Verdicts`
    verdicts: dict[int, bool] = dataclasses.field(default_factory=dict)
    prompt_ids: dict[int, str] = dataclasses.field(default_factory=dict)  # group -> prompt
    draws: int = 0  # extra prompts drawn for the batch
    settled: bool = False  # no more groups will come for the batch

    @property
    def informative(self) -> list[int]:
        return sorted(g for g, v in self.verdicts.items() if v)

    @property
    def skipped(self) -> list[int]:
        return sorted(g for g, v in self.verdicts.items() if not v)

    def missing(self) -> int | None:
        """The first group submitted so far without a verdict (None: the round is judged)."""
        return next((g for g in range(self.submitted) if g not in self.verdicts), None)

    def skipped_prompts(self) -> list[str]:
        return [self.prompt_ids[g] for g in self.skipped]


class DynamicSampling:
    """Judges complete groups, refills batches, tells the trainer what to take
    (module docstring). Thread-safe."""

    def __init__(self, ctx: RolloutContext):
        p = ctx.pipeline
        # Who judges the groups across processes and publishes the verdicts: the
        # generation processes, or with a judge in the reward the training processes.
        self.publisher = "trainer" if ctx.trainers_judge else "generator"
        if ctx.where == "generator" and self.publisher == "generator" and ctx.score is None:
            raise ValueError("dynamic sampling in a generation process needs RolloutContext.score")
        if ctx.where != "here" and ctx.verdicts is None:
            raise ValueError("dynamic sampling across processes needs RolloutContext.verdicts")
        self.ctx, self.p, self.where = ctx, p, ctx.where
        self.verdicts = ctx.verdicts
        self.need, self.group_size = p.prompts_per_step, p.group_size
        self.max_draws, self.timeout = p.dynamic_sampling_max_draws, p.timeout_s
        self.taker = GroupTaker(ctx.stream, p.timeout_s)
        self._cv = threading.Condition()
        self._members: dict[tuple[int, int], list[Scored]] = collections.defaultdict(list)
        self._batches: dict[int, Outcome] = collections.defaultdict(Outcome)
        # The trainer across processes: informative groups judged before their refill
        # round was mirrored here, handed to the taker once it is; and its own verdicts
        # on the groups it received, held until the generation process's are read.
        self._held: dict[tuple[int, int], Group] = {}
        self._own: dict[tuple[int, int], bool] = {}
        ctx.latch.add_listener(lambda component, exc: self._wake())

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ generation side
    def draw(self, batch: int) -> list[Prompt]:
        prompts = self.ctx.prompts.draw(batch, self.need)
        self._expect(batch, prompts, 0)
        return prompts

    def _expect(self, batch: int, prompts: list[Prompt], first: int) -> None:
        """Groups first.. of `batch` (their prompts) about to be submitted."""
        with self._cv:
            out = self._batches[batch]
            out.submitted += len(prompts)
            out.prompt_ids.update((first + i, q.problem.prompt_id) for i, q in enumerate(prompts))

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        del batch
        return requests

    def _next_round(self, out: Outcome) -> int | None:
        """Under `_cv`: the size of the batch's next refill round once every group
        submitted so far is judged (None before); 0 when the batch is settled (then
        marked so). Only the groups submitted so far count: across processes another
        process may already have judged groups of the next round."""
        if out.settled:
            return 0
        if out.missing() is not None:
            return None
        informative = sum(out.verdicts[g] for g in range(out.submitted))
        n = min(self.need - informative, self.max_draws - out.draws)
        if n <= 0:
            out.settled = True
            self._cv.notify_all()
            return 0
        return n

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        """Refill rounds for `batch` until it holds `prompts_per_step` informative groups
        or its draws are spent: each round waits until every group submitted so far has
        a verdict (across processes, every generation process's), then draws the missing
        number (every process draws the same prompts and submits its share). Returns
        early once `stopped()` or the run failed.

        Raises:
          TimeoutError: a round's groups were not all judged within the timeout.
        """
        while True:
            if self._wait(batch, lambda o: o.missing() is None, stopped) is None:
                return
            with self._cv:
                out = self._batches[batch]
                n = self._next_round(out)
                if n == 0:
                    if self.where == "generator":  # no step here reads it
                        self._batches.pop(batch, None)
                    return
                out.draws += n
                first = out.submitted
            prompts = self.ctx.prompts.draw(batch, n)
            self._expect(batch, prompts, first)
            submit(prompts, first)

    def _wait(
        self,
        batch: int,
        ready: Callable[[Outcome], bool],
        stopped: Callable[[], bool],
    ) -> Outcome | None:
        """Waits until `ready(outcome)` (returned), a failure or `stopped()` (None),
        reading the other processes' verdicts meanwhile; the trainer across processes
        mirrors the batch's rounds as they are decided.

        Raises:
          TimeoutError: not ready within the timeout (naming the batch and its counts).
        """
        deadline = time.monotonic() + self.timeout
        while True:
            self._pull(batch)
            self._mirror(batch)
            with self._cv:
                out = self._batches[batch]
                if ready(out):
                    return out
                if stopped() or self.ctx.latch.failed:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"dynamic sampling: batch {batch}: {len(out.verdicts)} of "
                        f"{out.submitted} groups judged after {self.timeout:.0f} s "
                        f"(first without a verdict: {out.missing()}; generation or reward "
                        "stalled?)"
                    )
                missing = out.missing()
                if self.verdicts is None or missing is None:
                    self._cv.wait(min(left, _SLICE_S))
                    continue
            self.verdicts.wait(batch, missing, min(left, _SLICE_S))

    def _pull(self, batch: int) -> None:
        """Across processes: the verdicts every process published for `batch` into its
        outcome; a verdict that contradicts this process's own judgment of the same
        group is an error (the reward must be deterministic)."""
        if self.verdicts is None:
            return
        board = self.verdicts.read(batch)
        with self._cv:
            out = self._batches[batch]
            new = False
            for g, (informative, prompt_id) in board.items():
                mine = out.verdicts.get(g, self._own.pop((batch, g), None))
                if mine is not None and mine != informative:
                    raise RuntimeError(_disagree(batch, g, mine, informative))
                if g not in out.verdicts:
                    out.verdicts[g], new = informative, True
                out.prompt_ids.setdefault(g, prompt_id)
            if new:
                self._cv.notify_all()

    def returned(self, sample: Sample) -> Returned:
        """A finished sample goes on as it is; in a generation process it is also scored
        here, for this process's judge (module docstring)."""
        if self.where == self.publisher == "generator" and not sample.tag.is_eval:
            self.ctx.score(sample).add_done_callback(self._scored_here)
        return Returned(sample, [])

    def _scored_here(self, future: Future[Scored]) -> None:
        """A generation process's own score of one of its samples: judged here and
        published, never streamed (the trainer judges the sample it receives)."""
        try:
            scored = future.result()
            judged = self._complete(scored)
            if judged is not None:
                self._record(*judged)
        except BaseException as e:  # noqa: BLE001 - the run's failure, named
            self.ctx.latch.fail("dynamic sampling's judge (reward)", e)

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        """A scored training sample; its complete group goes into the stream unless its
        rewards are all equal (then it is recorded as skipped). Across processes the
        trainer holds a refill group until its round is mirrored (module docstring)."""
        judged = self._complete(scored)
        if judged is None:
            return
        members, informative = judged
        tag = members[0].sample.tag
        if self.where == "trainer" and tag.group >= self.need:  # a refill: as mirrored?
            with self._cv:
                drew = self._batches[tag.batch].prompt_ids.get(tag.group, tag.prompt_id)
            if drew != tag.prompt_id:
                raise RuntimeError(_out_of_step(tag.batch, tag.group, tag.prompt_id, drew))
        if informative:
            with self._cv:
                early = self.where == "trainer" and tag.group >= self._registered(tag.batch)
                if early:
                    self._held[(tag.batch, tag.group)] = members
            if not early:
                for s in members:
                    self.ctx.stream.put(s, timeout=self.timeout)
        self._record(members, informative)

    def _complete(self, scored: Scored) -> tuple[Group, bool] | None:
        """The group's members and whether their rewards vary, once all are scored."""
        tag = scored.sample.tag
        key = (tag.batch, tag.group)
        with self._cv:
            members = self._members[key]
            members.append(scored)
            if len(members) < self.group_size:
                return None
            del self._members[key]
        rewards = shaped_rewards(members, self.ctx.overlong)
        return members, bool(np.ptp(rewards) > 0)

    def _record(self, members: Group, informative: bool) -> None:
        """This process's verdict on a complete group: the batch's (published where the
        groups are judged across processes: a generation process, or a training process
        when a judge is part of the reward); a training process that does not publish
        keeps its own apart and checks it against the generation process's."""
        tag = members[0].sample.tag
        b, g = tag.batch, tag.group
        if self.where == self.publisher:
            self.verdicts.publish(b, g, informative, tag.prompt_id)
        with self._cv:
            out = self._batches[b]
            out.prompt_ids.setdefault(g, tag.prompt_id)
            if self.where != "trainer" or self.publisher == "trainer":
                out.verdicts[g] = informative
                self._cv.notify_all()
                return
            known = out.verdicts.get(g)
            if known is None:
                self._own[(b, g)] = informative
        if known is not None and known != informative:
            raise RuntimeError(_disagree(b, g, informative, known))

    def _registered(self, batch: int) -> int:
        """Groups of `batch` the trainer's mirror has drawn so far (under `_cv`)."""
        return max(self._batches[batch].submitted, self.need)

    def _mirror(self, batch: int) -> None:
        """The trainer across processes: the generation processes' refill rounds of
        `batch`, as their verdicts decide them (module docstring). The trainer's thread
        only (it draws from the prompt source after the step's start drew the
        originals)."""
        if self.where != "trainer":
            return
        released = []
        with self._cv:
            out = self._batches[batch]
            out.submitted = max(out.submitted, self.need)  # the originals: the step drew them
            while (n := self._next_round(out)) is not None and n > 0:
                first = out.submitted
                prompts = self.ctx.prompts.draw(batch, n)
                out.draws += n
                out.submitted += n
                for g, q in enumerate(prompts, start=first):
                    # What the generation processes' verdicts (or a group already here)
                    # say the group was generated for must be what this trainer drew.
                    claimed = out.prompt_ids.get(g)
                    if claimed is not None and claimed != q.problem.prompt_id:
                        raise RuntimeError(_out_of_step(batch, g, claimed, q.problem.prompt_id))
                    out.prompt_ids[g] = q.problem.prompt_id
                for g in range(first, out.submitted):
                    group = self._held.pop((batch, g), None)
                    if group is not None:
                        released.append(group)
        for group in released:
            self.taker.park(batch, group)

    def report(self, report: RoundClosed) -> None:
        raise TransportError(
            f"generation-{report.process} reported round {report.round}: dynamic sampling "
            "has no rounds"
        )

    # ------------------------------------------------------------------ trainer side
    def _target(self, batch: int) -> int | None:
        """The number of groups batch `batch` trains, once it is settled (else None)."""
        self._pull(batch)
        self._mirror(batch)
        with self._cv:
            out = self._batches[batch]
            return len(out.informative) if out.settled else None

    def outcome(self, batch: int) -> Outcome:
        """Blocks until `batch` is settled; its outcome (a copy).

        Raises:
          TimeoutError: not settled within the timeout (naming the batch).
          RuntimeError: the run failed meanwhile.
        """
        out = self._wait(batch, lambda o: o.settled, lambda: False)
        if out is None:
            raise RuntimeError(f"dynamic sampling: batch {batch}: the run failed") from (
                self.ctx.latch.error
            )
        with self._cv:
            return dataclasses.replace(
                out, verdicts=dict(out.verdicts), prompt_ids=dict(out.prompt_ids)
            )

    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        """The informative groups of batch b (skipped ones never enter the stream), as
        many as the settled batch holds. Deterministic and batch modes wait for the batch
        to settle and take its groups in index order; streaming takes them as they come,
        at least `min_groups` at a time while more may come. Several training processes
        take their own (`_owned`)."""
        del mini  # one mini-batch (config/rules.py)
        if self.ctx.trainers.count > 1:
            yield from self._owned(batch)
            return
        p, taken = self.p, 0
        order = None
        if p.deterministic or not self.ctx.schedule.streaming:
            order = self.outcome(batch).informative
        while True:
            target = len(order) if order is not None else self._target(batch)
            remaining = (p.prompts_per_step if target is None else target) - taken
            if remaining <= 0:
                return
            count = min(p.micro_batch_groups, remaining)
            if p.deterministic:
                groups = self.taker.take_indexed(batch, order[taken : taken + count])
            elif target is not None:
                groups = self.taker.take(batch, count, count)
            else:
                min_groups = self.ctx.schedule.min_groups(p, remaining)
                groups = self.taker.take_until(
                    batch, min_groups, count, lambda: self._target(batch) is not None
                )
                if not groups:
                    continue  # settled meanwhile: the target is known now
            taken += len(groups)
            yield groups

    def _owned(self, batch: int) -> Iterator[list[Group]]:
        """Several training processes (module docstring): once the batch is settled,
        this process's informative groups (those it owns by index, `shards.Ownership`,
        as every group) in index order, `micro_batch_groups / T` per micro-batch, as
        many micro-batches as the process with the most needs (every process makes the
        same calls; one with fewer feeds padding rows)."""
        share = self.ctx.trainers
        informative = self.outcome(batch).informative
        for mine in share.own.settled_slices(informative, lambda g: g, share.index):
            yield self.taker.take_indexed(batch, mine)

    def finish(self, batch: int) -> StepOutcome:
        """Batch b's skipped prompts (consumed too) and its metrics."""
        out = self.outcome(batch)
        with self._cv:
            self._batches.pop(batch, None)
            for key in [k for k in self._own if k[0] <= batch]:
                del self._own[key]
        if self.where == "trainer" and self.ctx.trainers.index == 0:
            self.verdicts.settled(batch, out.draws)
            old = batch - (self.p.staleness + 2)  # no generation process settles it any more
            if old >= 0:
                self.verdicts.forget(old)
        return StepOutcome(
            metrics={
                "groups_skipped": float(len(out.skipped)),
                "dynamic_draws": float(out.draws),  # replacement prompts drawn
                # 1: the draws ran out before prompts_per_step informative groups
                "dynamic_short": float(len(out.informative) < self.need),
            },
            consumed=out.skipped_prompts(),
        )

    def plannable(self, start: int, steps: int) -> range | None:
        del start, steps
        return None  # the refills depend on the rewards

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        """Nothing: a batch's draws (originals and refills) are in the prompt source's
        record, and a resumed run regenerates and judges them again alike."""
        del k
        return {}

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        del k, state
        return []

    def fail(self, exc: BaseException) -> None:
        del exc  # the latch's listener wakes every wait here


def _out_of_step(batch: int, group: int, generated: str, drew: str) -> str:
    return (
        f"batch {batch} group {group}: generated for prompt {generated}, the trainer drew "
        f"{drew} (prompt pipelines out of step)"
    )


def _disagree(batch: int, group: int, here: bool, there: bool) -> str:
    word = {True: "informative", False: "skipped"}
    return (
        f"dynamic sampling: batch {batch} group {group}: this process judged it "
        f"{word[here]}, the generation process that made it {word[there]} (the reward "
        "must be deterministic: every process judges a group alike)"
    )
