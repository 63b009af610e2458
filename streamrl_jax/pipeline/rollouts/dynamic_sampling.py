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

Across processes (one generation and one training process, `config/rules.py`): the
generation process judges the groups it made itself (`RolloutContext.score`: its own
reward pool, the same deterministic reward function) and runs the refill rounds as
above; every sample still goes to the trainer, which scores and judges it again and
*mirrors* the rounds (`_mirror`, on the trainer's thread whenever it waits for the
batch): once every group of the rounds so far is judged, it draws the round's missing
number from its own prompt source, so its prompt iterator and its record of each
batch's draws stay the generation process's, and its step trains the same groups. A
refill group judged on the trainer before its round is mirrored there is held and
handed to the trainer's taker once it is (`GroupTaker.park`). The trainer draws a
batch's originals at the step's start and its refills during the step, so its draws
keep the generation process's order: originals of b, refills of b, originals of b+1.
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
    informative: list[int] = dataclasses.field(default_factory=list)  # group indices
    skipped: list[int] = dataclasses.field(default_factory=list)  # group indices
    prompt_ids: dict[int, str] = dataclasses.field(default_factory=dict)  # group -> prompt
    draws: int = 0  # extra prompts drawn for the batch
    settled: bool = False  # no more groups will come for the batch

    @property
    def judged(self) -> int:
        return len(self.informative) + len(self.skipped)

    def skipped_prompts(self) -> list[str]:
        return [self.prompt_ids[g] for g in sorted(self.skipped)]


class DynamicSampling:
    """Judges complete groups, refills batches, tells the trainer what to take
    (module docstring). Thread-safe."""

    def __init__(self, ctx: RolloutContext):
        p = ctx.pipeline
        if ctx.where == "generator" and ctx.score is None:
            raise ValueError("dynamic sampling in a generation process needs RolloutContext.score")
        self.ctx, self.p, self.where = ctx, p, ctx.where
        self.need, self.group_size = p.prompts_per_step, p.group_size
        self.max_draws, self.timeout = p.dynamic_sampling_max_draws, p.timeout_s
        self.taker = GroupTaker(ctx.stream, p.timeout_s)
        self._cv = threading.Condition()
        self._members: dict[tuple[int, int], list[Scored]] = collections.defaultdict(list)
        self._batches: dict[int, Outcome] = collections.defaultdict(Outcome)
        # The trainer across processes: informative groups judged before their refill
        # round was mirrored here, handed to the taker once it is.
        self._held: dict[tuple[int, int], Group] = {}
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

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        """Refill rounds for `batch` until it holds `prompts_per_step` informative groups
        or its draws are spent. Returns early once `stopped()` or the run failed.

        Raises:
          TimeoutError: a round's groups were not all judged within the timeout.
        """
        while True:
            with self._cv:
                out = self._batches[batch]
                self._wait(batch, out, lambda o: o.judged >= o.submitted, stopped)
                if stopped() or self.ctx.latch.failed:
                    return
                missing = self.need - len(out.informative)
                n = min(missing, self.max_draws - out.draws)
                if n <= 0:
                    out.settled = True
                    self._cv.notify_all()
                    return
                out.draws += n
                first = out.submitted
            prompts = self.ctx.prompts.draw(batch, n)
            self._expect(batch, prompts, first)
            submit(prompts, first)

    def _wait(
        self,
        batch: int,
        out: Outcome,
        ready: Callable[[Outcome], bool],
        stopped: Callable[[], bool],
    ) -> None:
        """Waits (holding `_cv`) until `ready(out)`, a failure or `stopped()`; the trainer
        across processes mirrors the batch's rounds meanwhile."""
        deadline = time.monotonic() + self.timeout
        self._mirror(batch)
        while not (ready(out) or stopped() or self.ctx.latch.failed):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"dynamic sampling: batch {batch}: {out.judged} of {out.submitted} groups "
                    f"judged after {self.timeout:.0f} s (generation or reward stalled?)"
                )
            self._cv.wait(min(left, _SLICE_S))
            self._mirror(batch)

    def returned(self, sample: Sample) -> Returned:
        """A finished sample goes on as it is; in a generation process it is also scored
        here, for this process's judge (module docstring)."""
        if self.where == "generator" and not sample.tag.is_eval:
            self.ctx.score(sample).add_done_callback(self._scored_here)
        return Returned(sample, [])

    def _scored_here(self, future: Future[Scored]) -> None:
        """A generation process's own score of one of its samples: judged here, never
        streamed (the trainer judges the sample it receives)."""
        try:
            scored = future.result()
        except BaseException as e:  # noqa: BLE001 - the run's failure, named
            self.ctx.latch.fail("dynamic sampling's judge (reward)", e)
            return
        judged = self._complete(scored)
        if judged is not None:
            self._record(*judged)

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
        tag = members[0].sample.tag
        with self._cv:
            out = self._batches[tag.batch]
            (out.informative if informative else out.skipped).append(tag.group)
            out.prompt_ids.setdefault(tag.group, tag.prompt_id)
            self._cv.notify_all()

    def _registered(self, batch: int) -> int:
        """Groups of `batch` the trainer's mirror has drawn so far (under `_cv`)."""
        return max(self._batches[batch].submitted, self.need)

    def _mirror(self, batch: int) -> None:
        """The trainer across processes: the generation process's refill rounds of
        `batch`, as far as this process's judgments decide them (module docstring). The
        trainer's thread only (it draws from the prompt source after the step's start
        drew the originals)."""
        if self.where != "trainer":
            return
        released = []
        with self._cv:
            out = self._batches[batch]
            out.submitted = max(out.submitted, self.need)  # the originals: the step drew them
            while not out.settled:
                judged = set(out.informative) | set(out.skipped)
                if not judged.issuperset(range(out.submitted)):
                    break
                round_informative = sum(g < out.submitted for g in out.informative)
                n = min(self.need - round_informative, self.max_draws - out.draws)
                if n <= 0:
                    out.settled = True
                    self._cv.notify_all()
                    break
                first = out.submitted
                prompts = self.ctx.prompts.draw(batch, n)
                out.draws += n
                out.submitted += n
                out.prompt_ids.update(
                    (first + i, q.problem.prompt_id) for i, q in enumerate(prompts)
                )
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
        self._mirror(batch)
        with self._cv:
            out = self._batches[batch]
            return len(out.informative) if out.settled else None

    def outcome(self, batch: int) -> Outcome:
        """Blocks until `batch` is settled; its outcome (a copy).

        Raises:
          TimeoutError: not settled within the timeout (naming the batch).
        """
        with self._cv:
            out = self._batches[batch]
            self._wait(batch, out, lambda o: o.settled, lambda: False)
            return dataclasses.replace(
                out,
                informative=sorted(out.informative),
                skipped=sorted(out.skipped),
                prompt_ids=dict(out.prompt_ids),
            )

    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        """The informative groups of batch b (skipped ones never enter the stream), as
        many as the settled batch holds. Deterministic and batch modes wait for the batch
        to settle and take its groups in index order; streaming takes them as they come,
        at least `min_groups` at a time while more may come."""
        del mini  # one mini-batch (config/rules.py)
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

    def finish(self, batch: int) -> StepOutcome:
        """Batch b's skipped prompts (consumed too) and its metrics."""
        out = self.outcome(batch)
        with self._cv:
            self._batches.pop(batch, None)
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
