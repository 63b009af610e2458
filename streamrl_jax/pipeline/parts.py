"""The objects one run shares between its driver, ingest and trainer loop, made once.

`wire(cfg, components, workdir)` creates them in dependency order: the
supervisor (failure latch, watchdog), the schedule, the weight board, the
grouping sample stream, the trace and metrics writers, the generation meter, the
evaluations, ingest (reward pool, sample log), the run's checkpoints and the
live scheduler (dispatch, ranker, elasticity; its ranker is saved with the
checkpoints) and, with partial rollout, the `PartialRollout` (saved with them
too). The first failure reported to the supervisor fails the stream and the
board, so every wait on them wakes at once.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.metrics import MetricsWriter, Tracer
from streamrl_jax.pipeline.components import Components
from streamrl_jax.pipeline.dynamic_sampling import DynamicSampler
from streamrl_jax.pipeline.ingest import Evaluations, Ingest
from streamrl_jax.pipeline.micro_batches import Scored, group_key
from streamrl_jax.pipeline.resume import RunCheckpoints
from streamrl_jax.pipeline.rollout import PartialRollout
from streamrl_jax.pipeline.round_reports import RoundReports
from streamrl_jax.pipeline.schedules import Schedule, WeightBoard
from streamrl_jax.pipeline.step_metrics import GenerationMeter
from streamrl_jax.pipeline.supervisor import Shutdown, Supervisor
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.stream.sample_stream import SampleStream


@dataclasses.dataclass
class RunParts:
    """The shared objects of one run (module docstring)."""

    supervisor: Supervisor
    schedule: Schedule
    board: WeightBoard
    stream: SampleStream[Scored]
    tracer: Tracer
    writer: MetricsWriter
    meter: GenerationMeter
    evals: Evaluations
    ingest: Ingest
    ckpts: RunCheckpoints
    live: LiveScheduler
    # Partial rollout (pipeline.partial_budget_tokens); a training process of several:
    # the generation processes' round reports.
    rollout: PartialRollout | RoundReports | None
    dynamic: DynamicSampler | None = None  # pipeline.dynamic_sampling

    def interrupt(self) -> None:
        """SIGINT/SIGTERM (the watchdog's stop): end the trainer's and driver's waits
        with `Shutdown`, which the trainer turns into a checkpointed stop."""
        self.stream.fail(Shutdown("shutdown requested by signal"), "shutdown")
        self.board.fail(Shutdown("shutdown requested by signal"))
        if self.rollout is not None:
            self.rollout.fail(Shutdown("shutdown requested by signal"))


def wire(
    cfg: ExperimentConfig,
    c: Components,
    workdir: str,
    checkpoints: tuple[str, tuple[int, ...]] | None = None,
    rounds: RoundReports | None = None,
    across_processes: bool = False,
) -> RunParts:
    """`checkpoints`: a multi-controller training process's (directory, training
    processes), see `RunCheckpoints`; `rounds`: its partial rollout's round reports
    (the rounds run in the generation processes); `across_processes`: a training
    process's run, whose elastic units are generation processes (`TrainingLink`)."""
    p = cfg.pipeline
    sup = Supervisor(p)
    schedule = Schedule.from_config(p)
    stream: SampleStream[Scored] = SampleStream(
        group_size=p.group_size,
        group_key=group_key,
        capacity=2 * p.prompts_per_step * p.group_size,
    )
    tracer = Tracer(cfg.log.trace)
    writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard)
    meter = GenerationMeter(tracer, sup.tick)
    evals = Evaluations(len(c.eval_prompts), writer, sup)
    dynamic = None
    if p.dynamic_sampling:
        overlong = OverlongPenalty.from_config(cfg)
        dynamic = DynamicSampler(p, stream, sup.latch, overlong=overlong, timeout=p.timeout_s)
    ingest = Ingest(
        cfg,
        c.tokenizer,
        c.reward_fn,
        stream,
        evals,
        supervisor=sup,
        meter=meter,
        tracer=tracer,
        workdir=workdir,
        sandbox=c.reward_sandbox,
        dynamic=dynamic,
    )
    rollout = rounds
    if rollout is None and p.partial_budget_tokens:
        rollout = PartialRollout(p, schedule)
    directory, processes = checkpoints or (None, None)
    ckpts = RunCheckpoints(
        cfg, c, workdir, schedule, rollout, directory=directory, processes=processes
    )
    reserved = 0 if across_processes else None  # across processes: reserved processes
    live = LiveScheduler(cfg, cfg.mesh.instance_slots, c.model_cfg.vocab_size, reserved)
    ckpts.ranker = live.ranker  # saved and restored with the checkpoints
    board = WeightBoard()

    def failed(component: str, exc: BaseException) -> None:  # wake every wait at once
        stream.fail(exc, component)
        board.fail(exc)
        if rollout is not None:
            rollout.fail(exc)

    sup.latch.add_listener(failed)
    return RunParts(
        supervisor=sup,
        schedule=schedule,
        board=board,
        stream=stream,
        tracer=tracer,
        writer=writer,
        meter=meter,
        evals=evals,
        ingest=ingest,
        ckpts=ckpts,
        live=live,
        rollout=rollout,
        dynamic=dynamic,
    )
