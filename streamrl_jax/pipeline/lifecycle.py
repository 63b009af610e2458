"""A run's lifecycle: wire the parts, restore, start, train, finish, shut down.

`run(cfg, workdir)` builds the components and runs the schedule of
`pipeline.mode` (DESIGN.md §3). Threads: the generation driver and collector
(`pipeline/driver.py`) in one process, or a `GenerationLink` in a training process of a
multi-controller run (`training_process.py`); the reward pool (`ingest.py`);
the watchdog (`supervisor.py`); the ranker refresh (`scheduling/live.py`). The
trainer loop runs on the calling thread (`trainer_loop.py`). The first failure
of any thread ends the run with `PipelineError` naming the component;
SIGINT/SIGTERM save the last step boundary and stop; every thread is joined
with a timeout.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from absl import logging

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.config import ExperimentConfig, Processes, check
from streamrl_jax.metrics import Progress
from streamrl_jax.pipeline.components import Components, build
from streamrl_jax.pipeline.driver import GenerationDriver, GenerationLink
from streamrl_jax.pipeline.parts import wire
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.pipeline.supervisor import PipelineError
from streamrl_jax.pipeline.trainer_loop import TrainerLoop
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.stream.sample_stream import StreamError

FINAL_PARAMS = "final_params.npz"


class _Run:
    """One run's parts, threads and ending (module docstring)."""

    def __init__(self, cfg: ExperimentConfig, c: Components, workdir: str, link: Any):
        self.cfg, self.c, self.workdir, self.link = cfg, c, workdir, link
        rounds = getattr(link, "rollout", None)  # partial rollout across processes
        self.parts = parts = wire(
            cfg,
            c,
            workdir,
            getattr(link, "checkpoints", None),
            rounds,
            across_processes=link is not None,
        )
        self.sup, self.board, self.stream = parts.supervisor, parts.board, parts.stream
        self.service: Any = None
        self.driver: GenerationDriver | None = None
        self.loop: TrainerLoop | None = None
        self.outcome = "failed"  # how the run ended, told to generation processes

    def _weights(self, version: int) -> list[Any]:
        """The local driver's `weights` hook: W_version from the board, per instance."""
        published = self.board.wait_for(version, self.sup.timeout)
        # Keep what a checkpoint of the trainer's next boundary still needs.
        oldest = self.parts.schedule.generation_version(self.loop.trained)
        self.board.discard_below(min(version, oldest))
        return [w.params for w in published]

    def _busy(self) -> dict[str, bool]:
        return {
            "generation": self.driver is not None and self.driver.pending() > 0,
            "reward": self.parts.ingest.pool.pending() > 0,
            "trainer": self.stream.depth()["ready_groups"] > 0,
        }

    def start(self) -> list[threading.Thread]:
        """Restores a checkpoint if there is one, publishes the weights generation needs
        first, then starts the threads."""
        c, parts, link = self.c, self.parts, self.link
        resume = parts.ckpts.restore()
        weights = {0: c.initial_weights} if resume is None else dict(resume.gen_weights)
        start = 0 if resume is None else resume.batch
        if link is not None:
            # Generation processes: where to start, and the restored versions, in order,
            # before W_start below; ranker refreshes go to their dispatchers.
            link.schedule(parts.live)
            link.begin(resume, weights)
        if start not in weights:
            weights[start] = c.weight_sync.transfer(c.state.params, start)[0]
        for v in sorted(weights):
            self.board.publish(v, weights[v])
        self.loop = TrainerLoop(
            self.cfg,
            c,
            parts,
            start=start,
            workdir=self.workdir,
            group=getattr(link, "group", None),
            num_instances=link.num_instances if link else len(self.cfg.mesh.instance_slots),
            check_prompts=link is not None,
        )
        threads = [self.sup.watchdog(self._busy, lambda: str(self.stream.depth()), parts.interrupt)]
        if link is not None:
            link.attach(
                parts.ingest.on_sample, parts.meter.chunk, parts.tracer.add_wall, self.sup.fail
            )
            return threads
        params = [p.params for p in c.initial_weights]
        self.service = c.generation.service(
            params, 0, on_chunk=parts.meter.chunk, pipeline=self.cfg.pipeline
        )
        self.driver = GenerationDriver(
            self.cfg,
            self.service,
            parts.live,
            c.eval_prompts,
            weights=self._weights,
            draw=parts.ckpts.draw,
            emit=parts.ingest.on_sample,
            latch=self.sup.latch,
            start=start,
            # A resumed run's service holds the build's W_0: always load its version.
            loaded_version=0 if resume is None else -1,
            expected_ids=resume.expected_ids if resume is not None else None,
            rollout=parts.rollout,
            dynamic=parts.dynamic,
            draw_more=parts.ckpts.draw_more,
        )
        for sample in [] if resume is None else resume.carried:
            parts.ingest.on_sample(sample)  # scored again; its group completes later
        return threads + self.driver.start_threads()

    def train(self, progress: Progress) -> bool:
        """The trainer loop to the last step; True when a signal stopped it."""
        try:
            if not self.loop.run(progress):
                return False
        except StreamError as e:
            if not self.sup.shutdown_requested.is_set():
                self.loop.checkpoint_at_boundary()
                self.sup.raise_if_failed()
                raise PipelineError("sample stream", e) from e
        except BaseException as e:
            self.sup.fail(e.component if isinstance(e, PipelineError) else "trainer", e)
            self.loop.checkpoint_at_boundary()
            raise
        logging.warning("stopping on signal after step %d", self.loop.trained)
        self.loop.steps.flush()
        self.loop.checkpoint_at_boundary(raise_errors=True)
        return True

    def finish(self, stopped: bool) -> None:
        """The last weight transfer, final checkpoint and evaluation, the last write."""
        self._last_transfer()
        if not stopped:
            if self.parts.ckpts.enabled:
                self.loop.checkpoint(self.loop.trained, force=True)  # the end of the run
            if self.cfg.eval.num_problems > 0 and self.c.eval_prompts:
                self.parts.evals.wait(self.cfg.pipeline.steps, self.sup.timeout)
        try:
            self.parts.ckpts.close()  # bounded wait for the last write
        except Exception as e:
            raise PipelineError("checkpoint writer", e) from e
        self.outcome = "stopped" if stopped else "ok"

    def shutdown(self, threads: list[threading.Thread]) -> None:
        """Stops and joins everything, closing in order; names any stalled thread."""
        self.sup.stop()
        if self.driver is not None:
            self.driver.stop()
        self.stream.close()
        self.board.fail(RuntimeError("run finished"))
        stalled, timeout = self.sup.join(threads), self.sup.timeout
        stalled += self.sup.close_all(
            [
                ("weight sync", self._last_transfer),
                ("generation link", self._close_link),
                ("generation service", lambda: self.service and self.service.close(timeout)),
                ("reward pool", self.parts.ingest.close),
                ("ranker refresh", lambda: self.parts.live.close(timeout)),
                ("checkpoint writer", self.parts.ckpts.close),
            ]
        )
        self.parts.tracer.save(os.path.join(self.workdir, "trace.json"))
        self.parts.writer.close()
        if stalled:
            raise TimeoutError(f"pipeline threads did not stop: {stalled}")

    def _last_transfer(self) -> None:
        if self.c.weight_sync.in_flight:
            self.c.weight_sync.result(self.sup.timeout)

    def _close_link(self) -> None:
        if self.link is None:
            return
        latch = self.sup.latch
        if self.outcome == "failed" and latch.failed:
            self.outcome = f"failed: {latch.component}: {latch.error!r}"
        self.link.close(self.outcome, self.sup.timeout)


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
    return run_components(cfg, build(cfg, devices), workdir, reward_fn=reward_fn)


def run_components(
    cfg: ExperimentConfig,
    components: Components,
    workdir: str,
    *,
    reward_fn: RewardFn | None = None,
    link: GenerationLink | None = None,
) -> RunResult:
    """Runs built components; with `link`, generation runs in other processes and
    samples arrive through it."""
    if reward_fn is not None:  # the caller's own function: inline unless asked otherwise
        components.reward_fn = reward_fn
        if cfg.data.reward_sandbox != "process":
            components.reward_sandbox = None
    r, threads, signals, progress = _Run(cfg, components, workdir, link), [], None, None
    t0 = time.perf_counter()
    try:
        threads = r.start()
        if cfg.checkpoint.on_signal and threading.current_thread() is threading.main_thread():
            signals = ckpt_lib.install_shutdown_handler(lambda sig: r.sup.shutdown_requested.set())
        progress = Progress(
            cfg.pipeline.steps, enabled=cfg.log.progress, initial=r.loop.steps.start
        )
        stopped = r.train(progress)
        r.finish(stopped)
    finally:
        if signals is not None:
            signals.uninstall()
        r.shutdown(threads)
        if progress is not None:
            progress.close()
    steps = r.loop.steps
    result = RunResult(
        state=components.state,
        steps=steps.rows,
        evals=dict(r.parts.evals.metrics),
        trained_versions=steps.versions,
        wall_s=time.perf_counter() - t0,
        samples=steps.samples,
        start_batch=steps.start,
        stopped=stopped,
        checkpoints=list(r.parts.ckpts.saved),
        critic_state=components.critic_state,
    )
    if cfg.log.final_params:
        ckpt_lib.save_params_npz(os.path.join(workdir, FINAL_PARAMS), components.state.params)
    logging.info(
        "run finished: %d samples in %.1f s; evals %s",
        steps.samples,
        result.wall_s,
        r.parts.evals.metrics,
    )
    return result
