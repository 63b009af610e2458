"""The Generation seam: where a run's samples come from (DESIGN.md §8).

A `Generation` is what the lifecycle starts and the trainer loop asks; the lifecycle
never asks which one it has:

* `LocalGeneration` (here): this process's generation instances (`GenerationService`)
  and the driver that feeds them (`driver.py`), taking each version from the weight
  board the trainer publishes to.
* the link to generation processes (`processes/training.py`, the multi-controller
  sub-package, which the core never imports): samples arrive over the wire, weights
  leave through the weight sync's sender.

Its parts, in the order the lifecycle uses them: `scheduler` (the dispatch, ranker
and elastic rule this side needs), `begin` (before the trainer publishes W_start:
where the run starts, its restored weight versions), `start` (deliver every sample to
ingest, every decode chunk to the meter), then per step `step_started` / `verify`,
and at the end `Running.stop` / `close`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.pipeline.components import GenerationParts
from streamrl_jax.pipeline.driver import DriverPlan, GenerationDriver, Service, Whole
from streamrl_jax.pipeline.hooks import generation_hooks
from streamrl_jax.pipeline.micro_batches import Group
from streamrl_jax.pipeline.parts import RunParts
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.pipeline.resume import ResumePoint
from streamrl_jax.pipeline.rollouts import Outcomes, Verdicts, Where
from streamrl_jax.pipeline.schedules import WeightBoard
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.weight_sync import Params, Published


class Running(Protocol):
    """Generation once started."""

    threads: list[threading.Thread]  # joined by the run at its end

    def pending(self) -> int:
        """Requests out and not yet returned (the watchdog's "generation has work")."""

    def stop(self) -> None:
        """Ends the threads' waits (the run is shutting down)."""

    def close(self, outcome: str, timeout: float) -> None:
        """Releases everything, telling the generation side how the run ended.

        Raises:
          TimeoutError: naming what did not stop within `timeout`.
        """


class Generation(Protocol):
    """Where a run's samples come from (module docstring)."""

    num_instances: int  # generation instances over every process (for `gen_busy`)
    where: Where  # which half of the rollout this process runs
    generation_processes: tuple[int, ...]  # the generation processes ((): this one)
    verdicts: Verdicts | None  # the generation processes' judged groups (None: this one's)
    outcomes: Outcomes | None  # the training processes' step outcomes (None: this one's)

    def scheduler(self, vocab_size: int) -> LiveScheduler:
        """The dispatch / ranker / elastic scheduler this side of the run needs."""

    def begin(self, resume: ResumePoint, restored: dict[int, list[Published]]) -> None:
        """Before the trainer publishes W_start: where the run starts, and its restored
        generation weights (in version order)."""

    def start(self, run: RunParts, resume: ResumePoint) -> Running:
        """Generates from `resume.batch` on, handing every sample to `run.ingest`."""

    def step_started(self, batch: int) -> None:
        """The trainer begins step `batch`."""

    def verify(self, groups: list[Group]) -> None:
        """Groups the trainer is about to train (a training process of a multi-controller
        run checks them against its own draws).

        Raises:
          RuntimeError: naming the group whose prompt is not the one drawn for it.
        """


class BoardWeights:
    """The local driver's `Weights`: versions from the run's weight board."""

    def __init__(self, board: WeightBoard, timeout: float):
        self.board, self.timeout = board, timeout

    def wait(self, version: int, idle: Callable[[], None]) -> list[Params]:
        del idle  # nothing here is generated again: one process owns every group
        return [w.params for w in self.board.wait_for(version, self.timeout)]

    def kept(self, version: int) -> list[Params] | None:
        published = self.board.get(version)
        return None if published is None else [w.params for w in published]


class LocalRunning:
    """This process's service and driver, once started."""

    def __init__(self, driver: GenerationDriver, threads: list[threading.Thread]):
        self.driver, self.threads = driver, threads

    def pending(self) -> int:
        return self.driver.pending()

    def stop(self) -> None:
        self.driver.stop()

    def close(self, outcome: str, timeout: float) -> None:
        del outcome
        self.driver.stop()
        self.driver.service.close(timeout)


class LocalGeneration:
    """Generation in this process: its instances and their driver."""

    where: Where = "here"
    generation_processes: tuple[int, ...] = ()
    verdicts: Verdicts | None = None
    outcomes: Outcomes | None = None

    def __init__(self, cfg: ExperimentConfig, parts: GenerationParts, initial: list[Published]):
        """`parts`: how to build this process's instances; `initial`: W_0 as placed on each
        of them (the build's)."""
        self.cfg, self.parts, self.initial = cfg, parts, initial
        self.num_instances = len(cfg.mesh.instance_slots)

    def scheduler(self, vocab_size: int) -> LiveScheduler:
        """Dispatch over this process's instances; the last `scheduling.elastic_reserved`
        of them are held back for the elastic rule."""
        cfg = self.cfg
        return LiveScheduler(
            cfg.scheduling,
            cfg.mesh.instance_slots,
            vocab_size=vocab_size,
            seed=cfg.seed,
            initial_length=max(cfg.generation.max_new_tokens / 4, 1.0),
            reserved=cfg.scheduling.elastic_reserved,
        )

    def begin(self, resume: ResumePoint, restored: dict[int, list[Published]]) -> None:
        del resume, restored  # the driver takes every version from the board

    def start(self, run: RunParts, resume: ResumePoint) -> LocalRunning:
        cfg = self.cfg
        service = self.parts.service(
            [w.params for w in self.initial],
            0,
            on_chunk=run.meter.chunk,
            precompile=cfg.pipeline.precompile,
            continuations=cfg.pipeline.partial_budget_tokens > 0,
        )
        return self.drive(service, run, resume)

    def drive(self, service: Service, run: RunParts, resume: ResumePoint) -> LocalRunning:
        """The driver over `service` (this process's, or a learner's view of a shared
        one: `learners.py`), its threads started."""
        cfg = self.cfg
        driver = GenerationDriver(
            service,
            run.rollout,
            run.live,
            BoardWeights(run.board, cfg.pipeline.timeout_s),
            Whole(),
            Requests.from_config(cfg),
            run.ingest.on_sample,
            run.supervisor.latch,
            DriverPlan(
                schedule=run.schedule,
                start=resume.batch,
                steps=cfg.pipeline.steps,
                # A resumed run's service holds the build's W_0: load W_g(start) first.
                loaded_version=-1 if resume.resumed else 0,
                held_out=run.components.eval_prompts if cfg.eval.num_problems else (),
                timeout=cfg.pipeline.timeout_s,
            ),
        )
        threads = driver.start_threads(generation_hooks(cfg, driver.evaluate, run.prompts))
        return LocalRunning(driver, threads)

    def step_started(self, batch: int) -> None:
        del batch  # the driver here draws what the trainer trains

    def verify(self, groups: list[Group]) -> None:
        del groups
