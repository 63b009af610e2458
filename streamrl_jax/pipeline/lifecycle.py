"""A run's lifecycle: wire the parts, restore, start, train, finish, shut down.

`run(cfg, workdir)` builds the components of one process and runs the schedule of
`pipeline.mode` (DESIGN.md §3) with generation here (`LocalGeneration`);
`run_components` runs built components with any `Generation` (a training process of
a multi-controller run passes its link to the generation processes,
`processes/training.py`). Threads: the generation side's (`Generation.start`), the
reward pool (`ingest.py`), the watchdog (`supervisor.py`), the ranker refresh
(`scheduling/live.py`). The trainer loop runs on the calling thread
(`trainer_loop.py`). The first failure of any thread ends the run with
`PipelineError` naming the component; SIGINT/SIGTERM save the last step boundary
and stop; every thread is joined with a timeout. The periodic work of the run
(checkpoints, ranker refresh, scheduling decisions; the held-out evaluation on the
generation side) is registered once, at the top (`hooks.py`).
"""

from __future__ import annotations

import os
import threading
import time

from absl import logging

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.config import ExperimentConfig, Processes, check
from streamrl_jax.metrics import Progress
from streamrl_jax.pipeline.components import Components, build, has_checkpoint
from streamrl_jax.pipeline.generation import Generation, LocalGeneration, Running
from streamrl_jax.pipeline.hooks import trainer_hooks
from streamrl_jax.pipeline.parts import RunParts, Trainers, wire
from streamrl_jax.pipeline.shards import Alone, ownership
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.pipeline.supervisor import PipelineError
from streamrl_jax.pipeline.trainer_loop import TrainerLoop
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.stream.sample_stream import StreamError
from streamrl_jax.weight_sync import Published

FINAL_PARAMS = "final_params.npz"


class _Run:
    """One run's parts, threads and ending (module docstring)."""

    def __init__(self, parts: RunParts, generation: Generation):
        self.parts, self.generation = parts, generation
        self.cfg, self.c, self.sup = parts.cfg, parts.components, parts.supervisor
        self.outcome = "failed"  # how the run ended, told to the generation side
        self.running: list[Running] = []  # the generation side, once started

    def _busy(self) -> dict[str, bool]:
        return {
            "generation": any(r.pending() > 0 for r in self.running),
            "reward": self.parts.ingest.pool.pending() > 0,
            "trainer": self.parts.stream.depth()["ready_groups"] > 0,
        }

    def start(self) -> tuple[TrainerLoop, list[threading.Thread]]:
        """Restores a checkpoint if there is one, publishes the weights generation needs
        first, then starts the generation side and the watchdog."""
        c, parts, board = self.c, self.parts, self.parts.board
        resume = parts.ckpts.restore()
        weights: dict[int, list[Published]] = (
            dict(resume.gen_weights) if resume.resumed else {0: c.initial_weights}
        )
        self.generation.begin(resume, dict(resume.gen_weights))
        if resume.batch not in weights:
            params = c.learner.state.params
            weights[resume.batch] = c.weight_sync.transfer(params, resume.batch)[0]
        for v in sorted(weights):
            board.publish(v, weights[v])
        if c.warmup and not resume.resumed:
            parts.writer.write(0, c.warmup, prefix="warmup/")
        loop = TrainerLoop(parts, self.generation, start=resume.batch)
        threads = [
            self.sup.watchdog(self._busy, lambda: str(parts.stream.depth()), parts.interrupt)
        ]
        running = self.generation.start(parts, resume)
        self.running.append(running)
        for sample in resume.carried:
            parts.ingest.on_sample(sample)  # scored again; its group completes later
        return loop, threads + running.threads

    def train(self, loop: TrainerLoop, progress: Progress) -> bool:
        """The trainer loop to the last step; True when a signal stopped it."""
        hooks = trainer_hooks(self.cfg, loop.checkpoint, self.parts.live, self.parts.workdir)
        try:
            if not loop.run(progress, hooks):
                return False
        except StreamError as e:
            if not self.sup.shutdown_requested.is_set():
                loop.checkpoint_at_boundary()
                self.sup.raise_if_failed()
                raise PipelineError("sample stream", e) from e
        except BaseException as e:
            self.sup.fail(e.component if isinstance(e, PipelineError) else "trainer", e)
            loop.checkpoint_at_boundary()
            raise
        logging.warning("stopping on signal after step %d", loop.trained)
        loop.steps.flush()
        loop.checkpoint_at_boundary(raise_errors=True)
        return True

    def finish(self, loop: TrainerLoop, stopped: bool) -> None:
        """The last weight transfer, final checkpoint and evaluation, the last write."""
        self._last_transfer()
        if not stopped:
            if self.parts.ckpts.enabled:
                loop.checkpoint(loop.trained, force=True)  # the end of the run
            if self.cfg.eval.num_problems > 0 and self.c.eval_prompts:
                self.parts.evals.wait(self.cfg.pipeline.steps, self.sup.timeout)
        try:
            self.parts.ckpts.close()  # bounded wait for the last write
        except Exception as e:
            raise PipelineError("checkpoint writer", e) from e
        self.outcome = "stopped" if stopped else "ok"

    def shutdown(self, threads: list[threading.Thread]) -> None:
        """Stops and joins everything, closing in order; names any stalled thread."""
        parts, timeout = self.parts, self.sup.timeout
        self.sup.stop()
        for running in self.running:
            running.stop()
        parts.stream.close()
        parts.board.fail(RuntimeError("run finished"))
        stalled = self.sup.join(threads)
        stalled += self.sup.close_all(
            [
                ("weight sync", self._last_transfer),
                *[
                    ("generation", lambda r=r: r.close(self._outcome(), timeout))
                    for r in self.running
                ],
                *([("endpoint", parts.agents.close)] if parts.agents else []),
                ("reward pool", parts.ingest.close),
                *([("environment", parts.episodes.close)] if parts.episodes else []),
                ("ranker refresh", lambda: parts.live.close(timeout)),
                ("checkpoint writer", parts.ckpts.close),
            ]
        )
        parts.tracer.save(os.path.join(parts.workdir, "trace.json"))
        parts.writer.close()
        if stalled:
            raise TimeoutError(f"pipeline threads did not stop: {stalled}")

    def _outcome(self) -> str:
        latch = self.sup.latch
        if self.outcome == "failed" and latch.failed:
            return f"failed: {latch.component}: {latch.error!r}"
        return self.outcome

    def _last_transfer(self) -> None:
        if self.c.weight_sync.in_flight:
            self.c.weight_sync.result(self.sup.timeout)


def run(
    cfg: ExperimentConfig,
    workdir: str,
    devices: list | None = None,
    reward_fn: RewardFn | None = None,
) -> RunResult:
    """Builds the components (on `devices`, default all) and runs the schedule of
    `cfg.pipeline.mode`; metrics, trace and checkpoints go to `workdir`; `reward_fn`
    replaces the task's reward (tests, custom rewards)."""
    check(cfg, Processes.one())  # a config made in code, too, fails here before any model load
    warm = not has_checkpoint(os.path.join(workdir, "checkpoints"))  # a resume skips it
    c = build(cfg, devices, reward_fn=reward_fn, warm=warm)
    trainers = Trainers(
        share=Alone(ownership(cfg.pipeline, 1)), checkpoint_dir=os.path.join(workdir, "checkpoints")
    )
    generation = LocalGeneration(cfg, c.generation, c.initial_weights)
    return run_components(cfg, c, workdir, generation=generation, trainers=trainers)


def run_components(
    cfg: ExperimentConfig,
    components: Components,
    workdir: str,
    *,
    generation: Generation,
    trainers: Trainers,
    shutdown: threading.Event | None = None,
) -> RunResult:
    """Runs built components with `generation` as the source of samples; `trainers`:
    this process's place among the run's training processes; `shutdown`: the event
    that asks the run to stop at its next step boundary (several learners share one;
    None: the run's own, set by SIGINT/SIGTERM)."""
    live = generation.scheduler(components.model_cfg.vocab_size)
    parts = wire(
        cfg,
        components,
        workdir,
        trainers,
        live,
        where=generation.where,
        generation_processes=generation.generation_processes,
        verdicts=generation.verdicts,
        outcomes=generation.outcomes,
        shutdown=shutdown,
    )
    r, threads, signals, progress, stopped = _Run(parts, generation), [], None, None, False
    t0 = time.perf_counter()
    try:
        loop, threads = r.start()
        if cfg.checkpoint.on_signal and threading.current_thread() is threading.main_thread():
            signals = ckpt_lib.install_shutdown_handler(lambda sig: r.sup.shutdown_requested.set())
        progress = Progress(cfg.pipeline.steps, enabled=cfg.log.progress, initial=loop.steps.start)
        stopped = r.train(loop, progress)
        r.finish(loop, stopped)
    finally:
        if signals is not None:
            signals.uninstall()
        r.shutdown(threads)
        if progress is not None:
            progress.close()
    steps = loop.steps
    result = RunResult(
        state=components.learner.state,
        steps=steps.rows,
        evals=dict(parts.evals.metrics),
        trained_versions=steps.versions,
        wall_s=time.perf_counter() - t0,
        samples=steps.samples,
        start_batch=steps.start,
        stopped=stopped,
        checkpoints=list(parts.ckpts.saved),
        target_states=components.learner.checkpoint()[1],
    )
    if cfg.log.final_params:
        params = components.learner.state.params
        ckpt_lib.save_params_npz(os.path.join(workdir, FINAL_PARAMS), params)
    logging.info(
        "run finished: %d samples in %.1f s; evals %s",
        steps.samples,
        result.wall_s,
        parts.evals.metrics,
    )
    return result
