"""The Rollout seam: what a step trains (DESIGN.md §8).

A rollout kind decides, for one run:

* **which requests batch b gets** (`draw`, then `open`) **and refills** (`settle`,
  on the generation driver's thread right after the batch is submitted);
* **what happens to a returned sample** (`returned`, the collector thread): handed
  on (finished), or kept and continued (paused);
* **where a scored sample goes** (`scored`, the reward pool's threads): into the
  grouping sample stream, or held until its group can be judged;
* **which groups step b trains** (`micro_batches`, the trainer thread), and what the
  step adds to its metrics row and to the prompts it consumed (`finish`);
* **its checkpoint state** at a step boundary (`state`) and the restore (`restore`).

The core (driver, ingest, trainer loop, resume, lifecycle) calls these and never
branches on which kind runs. Each kind is one module beside this one, chosen from
`pipeline.rollout` through the registry in `rollouts/__init__.py`; a kind imports
this protocol and lower layers only (`tests/layering_test.py`). A wrapper (a kind
around an inner one) derives from `Wrapper`, which hands every method to the inner
kind, and overrides only what it changes. What a kind needs beyond the context (an
environment, the endpoint) the registry hands it (`rollouts.Kits`): this protocol
knows no environment and no endpoint.

Threads: `draw`/`open`/`settle` run on the generation driver's thread, `returned`
on the collector's, `scored` on reward threads, `micro_batches`/`finish`/`state` on
the trainer's, `fail` on whichever thread failed first. A kind keeps its own state
thread-safe.

Across processes a rollout has two halves: a generation process's driver calls the
generation side (`where="generator"`), a training process the trainer side
(`where="trainer"`); a kind that cannot run split is refused at start-up
(`config/rules.py`). `report` is the one message from a generation process's half
to the trainer's (partial rollout's round closures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.config import PipelineSection
from streamrl_jax.data import Prompt
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline.micro_batches import Group, Scored
from streamrl_jax.pipeline.prompts import Prompts
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import TrainerShare
from streamrl_jax.stream.sample_stream import SampleStream

# "here": one process runs both halves; "trainer" / "generator": a training /
# generation process of a multi-controller run runs its half.
Where = Literal["here", "trainer", "generator"]

# The driver's `submit(prompts, first_group)`: a batch's further prompts, as its
# groups first_group.., made into requests, shared out, planned and submitted.
Submit = Callable[[list[Prompt], int], None]


class Returned(NamedTuple):
    """What becomes of a sample the service returned."""

    sample: Sample | None  # to hand on (scored, trained); None: the rollout keeps it
    now: list[GenerationRequest]  # requests to submit at once (continuations)
    # Work the rollout finishes off this thread (an episode's environment step): the
    # collector takes its `Returned` once done, as if the sample returned then, and
    # counts it as a request still out (a swap of weights waits for it).
    later: Future[Returned] | None = None
    # A request id whose kept KV slot is given up now (an episode carried into a later
    # round, which re-prefills it there under that round's weights).
    release: Any = None
    # More samples handed on with `sample` (a multi-agent episode's other roles'
    # conversations), each as `sample` is (its kept KV given up).
    also: tuple[Sample, ...] = ()
    # Request ids whose kept KV is given up now, their samples not handed on (a held-out
    # multi-agent episode's roles other than the one evaluated).
    released: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What a rollout adds to step b once its groups are trained."""

    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # Prompt ids consumed at this step without a trained group (skipped, passed over):
    # with the trained groups' prompts they are the step's row of consumed.jsonl.
    consumed: list[str] = dataclasses.field(default_factory=list)


class Verdicts(Protocol):
    """Across processes: the run's shared record of judged groups, so that every process
    decides a batch's refill rounds from every generation process's judgments
    (dynamic sampling; `pipeline/processes/verdicts.py` keeps it in the coordination
    service's key-value store). A verdict is (informative, prompt id); publishing one
    again (a lost process's group generated again) gives the same value."""

    def publish(self, batch: int, group: int, informative: bool, prompt_id: str) -> None:
        """Group `group` of `batch` judged (any process may publish it, any number of
        times: the reward is deterministic)."""

    def read(self, batch: int) -> dict[int, tuple[bool, str]]:
        """Every verdict of `batch` published so far: group -> (informative, prompt id)."""

    def wait(self, batch: int, group: int, timeout_s: float) -> None:
        """Returns once group `group`'s verdict is published, or after `timeout_s`."""

    def forget(self, batch: int) -> None:
        """The verdicts of `batch` are no longer needed by anyone (dropped)."""

    def settled(self, batch: int, draws: int) -> None:
        """`batch` is trained, having drawn `draws` refills (kept for restarted
        processes, which move their prompt iterators past it)."""


class Outcomes(Protocol):
    """Across processes: what each training process's step b taught, per prompt (the
    curriculum's signal: (prompt id, whether its group's answers varied)), read by every
    process that draws prompts (`pipeline/processes/outcomes.py`, the coordination
    service's store)."""

    def publish(self, step: int, trainer: int, outcomes: list[tuple[str, bool]]) -> None:
        """Training process `trainer`'s outcomes of step `step` (once per step)."""

    def read(self, step: int, timeout_s: float) -> list[tuple[str, bool]]:
        """Every training process's outcomes of `step`, in training-process order, once
        all published them (waits up to `timeout_s`; TimeoutError naming the step)."""


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """What every rollout kind is built from."""

    pipeline: PipelineSection
    schedule: Schedule
    stream: SampleStream[Scored]  # complete groups, to the trainer
    prompts: Prompts  # the batches' prompts
    latch: FailureLatch  # the run's failures (every wait gives up once it is failed)
    overlong: OverlongPenalty | None  # DAPO's soft overlong punishment (None: off)
    trainers: TrainerShare  # this process's share of every micro-batch
    seed: int  # the run seed
    where: Where = "here"
    generation_processes: tuple[int, ...] = ()  # where="trainer": the reporting processes
    # where="generator": scores a returned training sample here (dynamic sampling judges
    # its groups in the generation process: the reward function is deterministic, so the
    # trainer's own scores agree)
    score: Callable[[Sample], Future[Scored]] | None = None
    # Across processes (dynamic sampling): every generation process's verdicts on the
    # groups it judged (None in one process, where one judge sees every group)
    verdicts: Verdicts | None = None
    # Across processes (the curriculum): the training processes' outcomes of each step
    # (None in one process, whose trainer observes them itself)
    outcomes: Outcomes | None = None
    # Across processes (dynamic sampling with a judge): the training processes judge the
    # groups, whose rewards hold the judge's verdicts, and publish the verdicts; the
    # generation processes only read them (they hold no judge)
    trainers_judge: bool = False


class Rollout(Protocol):
    """What a step trains (module docstring)."""

    # ------------------------------------------------------------------ generation side
    def draw(self, batch: int) -> list[Prompt]:
        """Batch b's prompts, its groups 0.. (the driver makes the requests)."""

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """The requests to submit for batch b, given its new ones (this process's share)."""

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        """After batch b is submitted, before the next batch is drawn or other weights
        load: the batch's refills, if any, through `submit`. Returns early once
        `stopped()`; a kind that waits here polls `stopped()` as it waits (at most
        every half second: the driver generates a lost process's groups again in
        it, which the wait may need)."""

    def returned(self, sample: Sample) -> Returned:
        """A sample the service returned (the collector thread): a training sample, or a
        held-out evaluation's (`sample.tag.is_eval`; a kind without episodes hands those
        on as they are)."""

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        """A scored training sample: where it goes (the sample stream, or held)."""

    def report(self, report: RoundClosed) -> None:
        """A generation process's report on this rollout (across processes).

        Raises:
          TransportError: a kind that takes no reports, or a report that cannot be right.
        """

    # ------------------------------------------------------------------ trainer side
    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        """The groups of each micro-batch of mini-batch `mini` of step b, each taken once
        the previous one is accumulated."""

    def finish(self, batch: int) -> StepOutcome:
        """Step b's groups are trained: its metrics and consumed prompts."""

    def plannable(self, start: int, steps: int) -> range | None:
        """The batches whose prompts the trainer steps start.. steps-1 can train, when
        known before anything is generated (`pipeline.precompile` plans their shapes);
        None when they depend on what is sampled."""

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        """JSON of the work a checkpoint at step boundary k carries."""

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        """A run (resumed at k, or starting at k = 0 with `{}`) takes `state` back;
        returns finished samples to hand to ingest again."""

    def fail(self, exc: BaseException) -> None:
        """The run failed or stops: every wait of the rollout ends (raising)."""


@runtime_checkable
class Rounds(Protocol):
    """A kind that generates in rounds of a token budget (partial rollout) also places
    an episode's turns in them (the `episodes` wrapper asks)."""

    def next_turn(self, turn: Sample, request: GenerationRequest) -> Returned:
        """An episode's `turn` ended in round r and its environment answered; `request`
        is its next turn (a continuation holding the turns so far and the environment's
        tokens). The turn joins round r with what is left of the episode's budget
        there, or, with none left, is carried into round r + 1 as a paused sample is
        (or, past `max_lag`, `turn` is handed on as `Returned.sample`, finish reason
        "paused", to be dropped with its group)."""


class Wrapper:
    """A rollout around an inner one (`pipeline.rollout="wrapper+...+kind"`): every
    protocol method goes to `inner`, so a wrapper overrides only what it changes. It is
    no `Rounds`, whatever its inner kind: a wrapper that places an episode's turns asks
    `inner` itself."""

    def __init__(self, inner: Rollout):
        self.inner = inner

    def draw(self, batch: int) -> list[Prompt]:
        return self.inner.draw(batch)

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        return self.inner.open(batch, requests)

    def settle(self, batch: int, submit: Submit, stopped: Callable[[], bool]) -> None:
        self.inner.settle(batch, submit, stopped)

    def returned(self, sample: Sample) -> Returned:
        return self.inner.returned(sample)

    def scored(self, scored: Scored) -> None:
        self.inner.scored(scored)

    def report(self, report: RoundClosed) -> None:
        self.inner.report(report)

    def micro_batches(self, batch: int, mini: int) -> Iterator[list[Group]]:
        return self.inner.micro_batches(batch, mini)

    def finish(self, batch: int) -> StepOutcome:
        return self.inner.finish(batch)

    def plannable(self, start: int, steps: int) -> range | None:
        return self.inner.plannable(start, steps)

    def state(self, k: int) -> dict[str, Any]:
        return self.inner.state(k)

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        return self.inner.restore(k, state)

    def fail(self, exc: BaseException) -> None:
        self.inner.fail(exc)
