"""The trainer loop: micro-batches as groups arrive, one optimizer step per global batch, publish.

For step b = start .. steps-1 (the calling thread):

1. For each of the `pipeline.mini_batches` mini-batches (PPO mini-batches by
   group count; 1 by default), the rollout's micro-batches of complete groups
   (`Rollout.micro_batches`: which groups, and when), gated, packed and placed on
   the training mesh with the inputs of the learner's targets (`learner/`: reference
   log-probs, pi_old, a teacher's, the critic's GAE advantages); then the gradients
   (the policy's and every trained target's) are added into the donated accumulators.
2. The optimizer step(s) at each mini-batch boundary that accumulated anything;
   the rollout's end of the step (`Rollout.finish`: its metrics, the prompts it
   consumed without training); W_{b+1} goes to the generation side through the
   weight sync (on its background thread in stream_async, so the copy overlaps the
   next step) and onto the weight board, whether or not an update was applied
   (versions count steps).
3. The step's row (`step_metrics`) and the trainer's periodic work
   (`hooks.trainer_hooks`: checkpoints, the online ranker refresh, the scheduling
   decisions).

DESIGN.md §2: versions count batches, so W_{b+1} is published once per batch,
after its last mini-batch step. With one mini-batch, stream_sync computes the
same update as disaggregated_batch up to float summation order
(`pipeline.deterministic` makes it bitwise).
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.learner import Rows
from streamrl_jax.metrics import Progress, compile_seconds
from streamrl_jax.pipeline import micro_batches, precompile, stage_balance
from streamrl_jax.pipeline.generation import Generation
from streamrl_jax.pipeline.hooks import Hooks
from streamrl_jax.pipeline.micro_batches import Group
from streamrl_jax.pipeline.parts import RunParts
from streamrl_jax.pipeline.rollouts import StepOutcome
from streamrl_jax.pipeline.schedules import VersionGate
from streamrl_jax.pipeline.shards import host, pad_batch
from streamrl_jax.pipeline.step_metrics import (
    StepClock,
    StepMeter,
    StepWork,
    sample_stats,
    step_breakdown,
)
from streamrl_jax.pipeline.supervisor import PipelineError
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.step import NonFiniteError


class TrainerLoop:
    """The trainer side of a run (see the module docstring)."""

    def __init__(self, parts: RunParts, generation: Generation, start: int):
        """Args:
        parts: the run's shared objects.
        generation: where the samples come from (its instances, for `gen_busy`; a
          training process of several checks each group against its own draws).
        start: the first batch (a resumed run's checkpoint step).
        """
        self.parts, self.generation = parts, generation
        self.cfg, self.c = parts.cfg, parts.components
        self.learner = self.c.learner
        self.rollout, self.trainers = parts.rollout, parts.trainers.share
        t = self.learner.trainer
        # A target's own batches (the supervised target's demonstrations) split as every
        # micro-batch is: this process's rows, in the shape the training processes agree on.
        self.learner.set_rows(
            Rows(
                self.trainers.index,
                self.trainers.count,
                lambda host: self.trainers.agree(
                    host, self.c.tokenizer.pad_id, t.cfg.batch_buckets, t.cfg.routing_replay
                ),
            )
        )
        self.steps = StepMeter(parts.writer, start)
        p = self.cfg.pipeline
        self.timeout = p.timeout_s
        self.gate = VersionGate(parts.schedule, strict=p.strict_versions)
        self.overlong = OverlongPenalty.from_config(
            self.cfg.algorithm, self.cfg.generation.max_new_tokens
        )
        # pipeline.precompile: seconds before the first step, until a row reports them
        self.precompile_s: float | None = None
        if p.precompile:
            self.precompile_s = precompile.timed("trainer", self._precompile)
        compile_seconds()  # starts counting (the build's compilations are not a step's)
        self.trained = start  # batches trained so far (the next checkpoint's step)
        self.at_boundary = True  # the state is W_trained (no mini-batch step of a batch yet)
        self._accs = self.learner.init_accumulators()
        # Algorithm 1 over generation, scoring and training from each step's seconds
        procs = len(generation.generation_processes)
        self._stages = stage_balance.of(self.cfg, self.c.judge, procs, self.trainers.count)

    # ------------------------------------------------------------------ loop
    def run(self, progress: Progress, hooks: Hooks) -> bool:
        """Trains to the last step, running `hooks` at every step boundary; True when a
        shutdown request stopped it at a step boundary (one process polls the flag after
        each step: the watchdog's interrupt alone comes up to a second late, after which
        a short run may have ended; several training processes stop together through the
        stream's failure)."""
        t0, done = time.perf_counter(), 0
        alone = self.trainers.count == 1
        for b in range(self.steps.start, self.cfg.pipeline.steps):
            done += self._train_step(b, t0, done)
            hooks.run(self.trained)
            progress.update(b + 1, self.steps.rows[-1], self.parts.evals.latest())
            if alone and self.parts.supervisor.shutdown_requested.is_set():
                return True
        self.steps.flush()
        return False

    def _train_step(self, b: int, t_run: float, done: int) -> int:
        """Trains batch b and publishes W_{b+1}; returns the samples trained."""
        clock, work = StepClock.start(self.parts.stream.metrics), StepWork()
        self.generation.step_started(b)
        for k in range(self.cfg.pipeline.mini_batches):
            for groups in self.rollout.micro_batches(b, k):
                self.generation.verify(groups)
                work.prompt_ids += [g[0].sample.tag.prompt_id for g in groups]
                self._accumulate(b, groups, work)
            if work.micro > work.applied:  # nothing accumulated: no update (W_b+1 = W_b)
                self._apply(b, k, work)
        outcome = self.rollout.finish(b)
        self.parts.supervisor.raise_if_failed()
        compiled, t_publish = compile_seconds(this_thread=True), time.perf_counter()
        sync_s = self._publish(b + 1)
        # The trainer thread's share of the sync (stream_async: waiting for the previous
        # transfer and starting this one; `sync_s` is then the previous one's duration).
        work.publish_s = time.perf_counter() - t_publish
        work.sync_compile_s = compile_seconds(this_thread=True) - compiled
        self.at_boundary, self.trained = True, b + 1
        self.parts.supervisor.tick("trainer")
        self.parts.ckpts.log_consumed(b, work.prompt_ids + outcome.consumed)
        # Older weights are no longer needed: W_v for v >= g(trained) may still be.
        self.parts.board.discard_below(self.parts.schedule.generation_version(self.trained))
        stats, n = sample_stats(b, work.stats, self.gate.dropped, self.trainers)
        row = self._row(b, stats, n, done, t_run, clock, work, sync_s, outcome)
        self.steps.add(row, list(work.stats["versions"]), work.device)
        return n

    def _row(
        self,
        b: int,
        stats: dict[str, float],
        n: int,
        done: int,
        t_run: float,
        clock: StepClock,
        work: StepWork,
        sync_s: float,
        outcome: StepOutcome,
    ) -> dict[str, float]:
        """Step b's metrics row: sample statistics, time figures, counts, the rollout's
        and the scheduler's figures."""
        p = self.parts
        times = clock.figures(p.stream.metrics)
        row = stats | times
        row |= {
            "dropped_overlong": float(self.c.prompts.dropped_overlong),
            "truncated_overlong": float(self.c.prompts.truncated_overlong),
            "queue_depth": float(p.stream.depth()["ready_samples"]),
            "train_busy": work.busy_s / times["step_s"],
            # Fraction of this step's wall time the instances spent decoding or
            # prefilling (mean over every process's instances).
            "gen_busy": self._gen_busy(clock.wall),
            "weight_sync_s": sync_s,
            "samples_per_s": (done + n) / (time.perf_counter() - t_run),
            "samples": float(n),  # trained this step (partial rollout: varies by step)
            "micro_batches": float(work.micro),
            "optimizer_steps": float(len(work.device)),
            "reward_errors": float(p.ingest.pool.num_errors),
            "reward_timeouts": float(p.ingest.pool.num_timeouts),
            "watchdog_alerts": float(len(p.supervisor.alerts)),
        }
        publish = max(work.publish_s - work.sync_compile_s, 0.0)
        row |= step_breakdown(times, work.busy_s, publish, row["gen_busy"])
        if self.precompile_s is not None and work.device:  # the first row written
            row["precompile_s"] = self.precompile_s  # before the first step, in no step_s
            self.precompile_s = None
        row |= outcome.metrics | p.meter.pop_kv() | p.ingest.pop_row()
        # The targets' figures (e.g. distill_reverse_kl), from what their micro-batches
        # recorded (fetched here: those have computed).
        row |= self.learner.row(work.totals, self.trainers.sum)
        t_gen = p.meter.pop_span(b)
        return (
            row
            | self._stages.figures(row, t_gen, work.busy_s)
            | p.live.end_of_step(b, t_gen, work.busy_s)
        )

    def _gen_busy(self, w_start: float) -> float:
        """Fraction of the wall time since `w_start` the instances spent decoding or
        prefilling (mean over instances)."""
        w_end = time.time()
        busy = self.parts.meter.busy_between(w_start, w_end)
        return busy / (max(w_end - w_start, 1e-9) * self.generation.num_instances)

    # ------------------------------------------------------------------ one micro-batch
    def _accumulate(self, b: int, groups: list[Group], work: StepWork) -> None:
        """One micro-batch's gradients (the policy's and its trained targets') into the
        accumulators."""
        tracer = self.parts.tracer
        t0 = tracer.now()
        placed = self._place(b, groups, work)
        if placed is None:
            return
        dev, shape = placed
        self._accs = self.learner.accumulate(b, dev, self._accs)
        t1 = tracer.now()
        tokens = sum(len(s.sample.prompt) + len(s.sample.response) for g in groups for s in g)
        tracer.add(
            "trainer/micro-batch",
            "accumulate",
            t0,
            t1,
            groups=len(groups),
            tokens=tokens,  # prompt + response of every sample
            rows=shape[0],  # the padded batch actually trained (shared-prompt / packed rows)
            columns=shape[1],
        )
        work.micro += 1
        work.busy_s += t1 - t0
        self.parts.supervisor.tick("trainer")

    def _place(
        self, b: int, groups: list[Group], work: StepWork
    ) -> tuple[TrainBatch, tuple[int, int]] | None:
        """The micro-batch on the training mesh and its padded (rows, columns) (None if the
        gate dropped every group), with the inputs of the learner's targets filled in
        (`Learner.place`: pi_old, reference log-probs, the critic's GAE, ...)."""
        c, t = self.c, self.learner.trainer
        batch = micro_batches.pack_groups(
            b,
            groups,
            gate=self.gate,
            advantage=self.cfg.algorithm.advantage,
            **t.cfg.layout,
            pad_id=c.tokenizer.pad_id,
            stats=work.stats,
            overlong=self.overlong,
        )
        # Every training process feeds the same global shape (one process: as it is).
        batch = self.trainers.agree(
            batch, c.tokenizer.pad_id, t.cfg.batch_buckets, t.cfg.routing_replay
        )
        if batch is None:
            return None
        return self.learner.place(b, batch, work.totals), batch.shape

    # ------------------------------------------------------------------ precompile
    def _precompile(self) -> int:
        """`pipeline.precompile` (pipeline/precompile.py): every micro-batch shape the
        remaining batches can produce, run once before the first step on an all-padding
        batch into a throwaway accumulator (the state is not touched). Returns the shapes
        compiled (0 when the lengths are not known in advance)."""
        cfg, c, p, t = self.cfg, self.c, self.cfg.pipeline, self.learner.trainer
        start = self.steps.start
        batches = self.rollout.plannable(start, p.steps)
        if not cfg.generation.length_replay or batches is None:
            logging.info(
                "pipeline.precompile: the trainer's micro-batch shapes depend on what is "
                "sampled (%s): only the generation instances precompile",
                f"pipeline.rollout={p.rollout}" if batches is None else "no length replay",
            )
            return 0
        lens = self.parts.prompts.preview(batches, p.prompts_per_step)
        shapes = precompile.micro_batch_shapes(
            cfg,
            t.cfg.layout,
            self.parts.schedule,
            precompile.group_lengths(cfg, lens),
            range(start, p.steps),
            count=self.trainers.count,
        )
        # The group advantages run op by op on the host's device, and each op compiles
        # once per sample count: every count a micro-batch of 1..micro_batch_groups
        # complete groups can have (the gate may keep fewer).
        if cfg.algorithm.advantage != "gae":
            for k in range(1, p.micro_batch_groups + 1):
                ids = np.repeat(np.arange(k, dtype=np.int32), p.group_size)
                micro_batches.group_advantages(
                    cfg.algorithm.advantage, np.zeros(len(ids), np.float32), ids, k
                )
        accs = self.learner.init_accumulators()  # thrown away: the state is not touched
        for rows, columns, width in shapes:
            empty = pad_batch(None, rows, columns, c.tokenizer.pad_id, width, t.cfg.routing_replay)
            # batch -1: no step's figures, no target's draw (the run's remain as without)
            accs = self.learner.accumulate(-1, self.learner.place(-1, empty), accs)
        logging.info("pipeline.precompile: trainer shapes (rows, columns, loss width): %s", shapes)
        return len(shapes)

    # ------------------------------------------------------------------ boundaries
    def _apply(self, b: int, k: int, work: StepWork) -> None:
        """The optimizer step(s) closing mini-batch k of batch b."""
        tracer = self.parts.tracer
        t0 = tracer.now()
        self.at_boundary = False
        work.applied = work.micro
        self._accs, m = self.learner.apply(self._accs)
        work.device.append(m)
        if self.cfg.pipeline.nonfinite == "stop":
            # the policy's "nonfinite" and every trained target's ("critic_nonfinite")
            skipped = [key for key in m if key.endswith("nonfinite")]
            if any(float(host(m[key])) > 0 for key in skipped):
                raise NonFiniteError(
                    f"step {b}: non-finite loss or gradients (pipeline.nonfinite='stop'); the "
                    "update was not applied"
                )
        name = f"step {b}" if self.cfg.pipeline.mini_batches == 1 else f"step {b}.{k}"
        tracer.add("trainer/optimizer", name, t0, tracer.now())

    def _publish(self, version: int) -> float:
        """Sends W_version to generation; background in stream_async. Returns sync seconds.

        Raises:
          PipelineError("weight sync"): this transfer (or, in stream_async, the previous
            background one) failed.
        """
        ws, params, tracer = self.c.weight_sync, self.learner.state.params, self.parts.tracer
        board = self.parts.board
        try:
            if self.parts.schedule.mode == "stream_async":
                if ws.in_flight:
                    ws.result(self.timeout)
                t0 = tracer.now()

                def landed(published, stats):
                    tracer.add(
                        "weight_sync/transfer", f"W{version}", t0, tracer.now(), **stats.report
                    )
                    board.publish(version, published)

                ws.start(params, version, on_done=landed)
                return ws.history[-1].seconds if ws.history else 0.0
            t0 = tracer.now()
            published, stats = ws.transfer(params, version)
            tracer.add("weight_sync/transfer", f"W{version}", t0, tracer.now(), **stats.report)
            board.publish(version, published)
            return stats.seconds
        except Exception as e:
            raise PipelineError("weight sync", e) from e

    def checkpoint(self, k: int, force: bool = False) -> None:
        """Checkpoint k at the boundary after batch k-1 (the checkpoint hook; forced at
        the end of a run and before a stop)."""
        ckpts, tracer = self.parts.ckpts, self.parts.tracer
        if not ckpts.due(k, force):
            return
        # Samples of batches >= k (counted at the boundary, before the save's seconds let
        # the stage drain): a resume from k generates and judges them again.
        waiting = self.parts.ingest.waiting()
        # Batch k-1's row is written before the checkpoint that says it trained (a resume
        # from k writes rows from k on: a kill after the save would lose it otherwise).
        self.steps.flush()
        t0 = tracer.now()
        try:
            ckpts.save(k, self.parts.board, force=force)
        except Exception as e:
            raise PipelineError("checkpoint writer", e) from e
        tracer.add("checkpoint/save", f"step {k}", t0, tracer.now())
        if waiting:
            logging.info("checkpoint %d: %d samples waiting in the scoring stage", k, waiting)

    def checkpoint_at_boundary(self, raise_errors: bool = False) -> None:
        """On a failure or a stop: save the last step boundary if the state is at one
        (not mid-way through a batch's mini-batch steps) and it is not saved yet."""
        k, ckpts = self.trained, self.parts.ckpts
        if ckpts.ckpt is None or not self.at_boundary or k == 0 or k in ckpts.saved:
            return
        try:
            self.checkpoint(k, force=True)
            ckpts.close()
            logging.warning("saved checkpoint %d before stopping", k)
        except Exception as e:
            if raise_errors:
                raise
            logging.error("best-effort checkpoint %d failed: %r", k, e)
