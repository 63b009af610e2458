"""The full rollout: step b trains every group of batch b (DESIGN.md §2).

Batch b draws `pipeline.prompts_per_step` prompts; every finished sample goes into
the sample stream, which releases complete groups. Step b's mini-batch k holds its
share of the groups (`prompts_per_step / mini_batches` of them), taken as micro-batches
of at most `pipeline.micro_batch_groups`:

* streaming modes train once `pipeline.min_groups` are ready (dynamic-batch
  pipelining), batch modes once all are;
* `pipeline.deterministic`: exactly the consecutive groups of each micro-batch, in
  group order, members in member order (a fixed summation order: bitwise-reproducible
  training);
* several training processes: each takes its fixed slice of every micro-batch
  (`shards.Ownership`), whichever arrive first unless deterministic, so all make the
  same calls.

Nothing is carried across a step boundary, so a checkpoint holds no rollout state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from streamrl_jax.data import Prompt
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.pipeline.micro_batches import Group, GroupTaker, Scored
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    RolloutContext,
    StepOutcome,
    Submit,
)


class FullRollout:
    """Every group of batch b at step b (module docstring)."""

    def __init__(self, ctx: RolloutContext):
        self.ctx, self.p = ctx, ctx.pipeline
        self.taker = GroupTaker(ctx.stream, self.p.timeout_s)

    # ------------------------------------------------------------------ generation side
    def draw(self, batch: int) -> list[Prompt]:
        return self.ctx.prompts.draw(batch, self.p.prompts_per_step)

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        del batch
        return requests

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        del batch, submit, stopped

    def returned(self, sample: Sample) -> Returned:
        return Returned(sample, [])

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        self.ctx.stream.put(scored, timeout=self.p.timeout_s)

    def report(self, report: RoundClosed) -> None:
        raise TransportError(
            f"generation-{report.process} reported round {report.round}, but this run's "
            f"rollout ({self.p.rollout!r}) has no rounds"
        )

    # ------------------------------------------------------------------ trainer side
    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        p, trainers = self.p, self.ctx.trainers
        if p.deterministic or trainers.count > 1:
            for j in range(trainers.own.micro_batches()):
                want = trainers.owned(mini, j)
                if p.deterministic:
                    yield self.taker.take_indexed(batch, want)
                else:  # several processes: a fixed count each, whichever arrive first
                    yield self.taker.take(batch, len(want), len(want))
            return
        remaining = p.prompts_per_step // p.mini_batches
        while remaining:
            count = min(p.micro_batch_groups, remaining)
            groups = self.taker.take(batch, self.ctx.schedule.min_groups(p, remaining), count)
            remaining -= len(groups)
            yield groups

    def finish(self, batch: int) -> StepOutcome:
        del batch
        return StepOutcome()

    def plannable(self, start: int, steps: int) -> range | None:
        return range(start, steps)

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        del k
        return {}

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        del k, state
        return []

    def fail(self, exc: BaseException) -> None:
        del exc  # every wait here is on the sample stream, which the run fails itself
