"""The trainer loop: micro-batches as groups arrive, one optimizer step per global batch, publish.

For step b = start .. steps-1 (the calling thread):

1. For each of the `pipeline.mini_batches` mini-batches (PPO mini-batches by
   group count; 1 by default), take each micro-batch's complete groups
   (`micro_batches.GroupTaker`: streaming modes as soon as `min_groups` are
   ready, batch modes once all are), gate, pack and place them on the training
   mesh; reference log-probs when `kl_coef > 0`; with the critic
   (`algorithm.advantage="gae"`) its values and per-sample GAE advantages; then
   accumulate the gradients (the critic's too) into the donated accumulator.
2. Apply the optimizer step(s) at the mini-batch boundary; W_{b+1} goes to the
   generation side through the weight sync (on its background thread in
   stream_async, so the copy overlaps the next step) and onto the weight board.
3. Write the step's row (`step_metrics`) and run the step hooks: checkpoint
   every `checkpoint.every`, the online ranker refresh and the scheduling
   decision log every step.

DESIGN.md §2: versions count batches, so W_{b+1} is published once per batch,
after its last mini-batch step. With one mini-batch, stream_sync computes the
same update as disaggregated_batch up to float summation order
(`pipeline.deterministic` makes it bitwise).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.metrics import Progress, compile_seconds
from streamrl_jax.pipeline import micro_batches, precompile
from streamrl_jax.pipeline.components import Components
from streamrl_jax.pipeline.hooks import Hooks
from streamrl_jax.pipeline.parts import RunParts
from streamrl_jax.pipeline.schedules import VersionGate
from streamrl_jax.pipeline.shards import TrainingGroup, host, pad_batch
from streamrl_jax.pipeline.step_metrics import StepMeter, sample_stats
from streamrl_jax.pipeline.supervisor import PipelineError
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.step import NonFiniteError


@dataclasses.dataclass
class _Step:
    """What one step gathers while it trains."""

    stats: dict[str, list] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    micro: int = 0  # micro-batches accumulated
    device: list[dict[str, jax.Array]] = dataclasses.field(default_factory=list)  # per apply
    busy_s: float = 0.0  # seconds of accumulate compute
    prompt_ids: list[str] = dataclasses.field(default_factory=list)


class TrainerLoop:
    """The trainer side of a run (see the module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        c: Components,
        parts: RunParts,
        *,
        start: int,
        workdir: str,
        group: TrainingGroup | None,
        num_instances: int,
        check_prompts: bool,
    ):
        """Args:
        cfg, c, parts: the run's config, components and shared parts.
        start: the first batch (a resumed run's checkpoint step).
        workdir: where the scheduling decisions are logged.
        group: the training processes of a multi-controller run (None: this one alone).
        num_instances: generation instances over all processes (for `gen_busy`).
        check_prompts: several processes: check each group's prompt against this
          process's own draw of the batch (the seeded pipelines stay in step).
        """
        self.cfg, self.c = cfg, c
        self.stream, self.board, self.ckpts = parts.stream, parts.board, parts.ckpts
        self.live, self.supervisor, self.tracer = parts.live, parts.supervisor, parts.tracer
        self.meter, self.schedule, self.rewards = parts.meter, parts.schedule, parts.ingest.pool
        self.steps = StepMeter(parts.writer, start)
        self.group, self.num_instances, self.check_prompts = group, num_instances, check_prompts
        self._drawn: dict[int, list[str]] = {}  # batch -> its prompt ids (check_prompts)
        p = cfg.pipeline
        self.timeout = p.timeout_s
        self.gate = VersionGate(self.schedule, strict=p.strict_versions)
        self.overlong = OverlongPenalty.from_config(cfg)
        self.rollout = parts.rollout
        self.dynamic = parts.dynamic
        self.taker = micro_batches.GroupTaker(
            p,
            self.schedule,
            self.stream,
            group,
            self.timeout,
            rollout=self.rollout,
            dynamic=self.dynamic,
        )
        self._one = c.trainer.scalar(1.0)  # the micro-batch normaliser, on the training mesh
        # pipeline.precompile: seconds before the first step, until a row reports them
        self.precompile_s: float | None = None
        if p.precompile:
            self.precompile_s = precompile.timed("trainer", self._precompile)
        compile_seconds()  # starts counting (the build's compilations are not a step's)
        self.trained = start  # batches trained so far (the next checkpoint's step)
        self.at_boundary = True  # the state is W_trained (no mini-batch step of a batch yet)
        self._acc = c.trainer.init_accumulator()
        self._critic_acc = c.critic.init_accumulator() if c.critic is not None else None
        self.hooks = Hooks()
        self.hooks.add("checkpoint", cfg.checkpoint.every, self.checkpoint, at_zero=False)
        self.hooks.add("ranker refresh", 1, self.live.refresh_async)
        decisions = os.path.join(workdir, "scheduling.jsonl")
        self.hooks.add("scheduling decisions", 1, lambda k: self.live.write_decisions(decisions))

    # ------------------------------------------------------------------ loop
    def run(self, progress: Progress) -> bool:
        """Trains to the last step; True when a shutdown request stopped it at a step
        boundary (one process polls the flag after each step: the watchdog's interrupt
        alone comes up to a second late, after which a short run may have ended)."""
        t0, done = time.perf_counter(), 0
        for b in range(self.steps.start, self.cfg.pipeline.steps):
            done += self._train_step(b, t0, done)
            progress.update(b + 1, self.steps.rows[-1], self.steps.writer.last("eval/"))
            # Several training processes stop together through the stream's failure.
            if self.group is None and self.supervisor.shutdown_requested.is_set():
                return True
        self.steps.flush()
        return False

    def _gen_busy(self, w_start: float) -> float:
        """Fraction of the wall time since `w_start` the instances spent decoding or
        prefilling (mean over instances)."""
        w_end = time.time()
        busy = self.meter.busy_between(w_start, w_end)
        return busy / (max(w_end - w_start, 1e-9) * self.num_instances)

    def _train_step(self, b: int, t_run: float, done: int) -> int:
        """Trains batch b and publishes W_{b+1}; returns the samples trained."""
        p = self.cfg.pipeline
        t_step, w_step = time.perf_counter(), time.time()  # chunk reports carry wall times
        cpu_step = time.process_time()
        waits0 = dataclasses.replace(self.stream.metrics)
        compile0 = compile_seconds(this_thread=True)
        step = _Step()
        if self.check_prompts:  # the generation processes drew the same prompts
            self._drawn[b] = [q.problem.prompt_id for q in self.ckpts.draw(b, p.prompts_per_step)]
            # Partial rollout trains groups of batches up to max_lag - s steps back.
            for old in [j for j in self._drawn if j < b - self.schedule.max_lag - 1]:
                del self._drawn[old]
        for k in range(p.mini_batches):
            for groups in self.taker.micro_batches(b, k):
                step.prompt_ids += [g[0].sample.tag.prompt_id for g in groups]
                if self.check_prompts:
                    micro_batches.check_prompts(groups, self._drawn)
                self._accumulate(b, groups, step)
            if step.micro or (self.rollout is None and self.dynamic is None):
                self._apply(b, k, step)
            # else: partial rollout, a round that completed no trainable group, or dynamic
            # sampling, a batch whose every group was skipped: no update (W_{b+1} = W_b is
            # still published: versions count steps).
        dynamic = self._dynamic_outcome(b, step)
        sync_s = self._publish(b + 1)
        self.at_boundary, self.trained = True, b + 1
        self.supervisor.tick("trainer")
        self.ckpts.log_consumed(b, step.prompt_ids)
        if self.check_prompts:  # no local driver frees the board: keep what g() needs
            self.board.discard_below(self.schedule.generation_version(self.trained))
        stats, n = sample_stats(b, step.stats, self.gate.dropped, self.group)
        now = time.perf_counter()
        wall = max(now - t_step, 1e-9)
        m = self.stream.metrics
        row = stats | {
            "dropped_overlong": float(self.c.prompts.dropped_overlong),
            "truncated_overlong": float(self.c.prompts.truncated_overlong),
            "queue_depth": float(self.stream.depth()["ready_samples"]),
            "step_s": wall,
            # CPU seconds of this process (every thread: trainer, scoring, ingest, weight
            # sync) within the step: a process pinned to one core cannot do a step's
            # work faster (tools/bench_pipeline.py --processes).
            "process_cpu_s": time.process_time() - cpu_step,
            # The trainer's own tracing and compiling within the step (new micro-batch
            # shapes): not steady state (tools/bench_pipeline.py).
            "compile_s": compile_seconds(this_thread=True) - compile0,
            "train_busy": step.busy_s / wall,
            # Fraction of this step's wall time the instances spent decoding or
            # prefilling (mean over instances).
            "gen_busy": self._gen_busy(w_step),
            # Trainer blocked waiting for complete groups / reward threads blocked on
            # back-pressure, seconds within this step.
            "stream_wait_s": m.consumer_wait_s - waits0.consumer_wait_s,
            "stream_backpressure_s": m.producer_wait_s - waits0.producer_wait_s,
            "weight_sync_s": sync_s,
            "samples_per_s": (done + n) / (now - t_run),
            "samples": float(n),  # trained this step (partial rollout: varies by step)
            "micro_batches": float(step.micro),
            "optimizer_steps": float(len(step.device)),
            "reward_errors": float(self.rewards.num_errors),
            "reward_timeouts": float(self.rewards.num_timeouts),
            "watchdog_alerts": float(len(self.supervisor.alerts)),
        }
        row |= dynamic
        if self.precompile_s is not None and step.device:  # the first row written
            row["precompile_s"] = self.precompile_s  # before the first step, in no step_s
            self.precompile_s = None
        if self.rollout is not None:
            carried = self.rollout.in_flight()
            row |= {
                "carried_paused": float(carried["paused"]),
                "carried_members": float(carried["waiting_members"]),
                "regenerated": float(self.rollout.regenerated),
                "dropped_lag": float(self.rollout.dropped),
            }
        row |= self.live.end_of_step(b, self.meter.pop_span(b), step.busy_s)
        self.steps.add(row, list(step.stats["versions"]), step.device)
        self.hooks.run(self.trained)
        return n

    def _dynamic_outcome(self, b: int, step: _Step) -> dict[str, float]:
        """Dynamic sampling: batch b's skipped prompts into the step's consumed ones, and
        its metrics ({} when off)."""
        if self.dynamic is None:
            return {}
        out = self.dynamic.outcome(b)
        self.supervisor.raise_if_failed()
        step.prompt_ids += out.skipped_prompts()  # a skipped prompt is consumed too
        self.dynamic.forget(b)
        return {
            "groups_skipped": float(len(out.skipped)),
            "dynamic_draws": float(out.draws),  # replacement prompts drawn
            # 1: the draws ran out before prompts_per_step informative groups
            "dynamic_short": float(len(out.informative) < self.cfg.pipeline.prompts_per_step),
        }

    # ------------------------------------------------------------------ one micro-batch
    def _accumulate(self, b: int, groups: list[micro_batches.Group], step: _Step) -> None:
        """One micro-batch's gradients (policy, and critic) into the accumulators."""
        t0 = self.tracer.now()
        placed = self._place(b, groups, step.stats)
        if placed is None:
            return
        dev, shape = placed
        self._acc, self._critic_acc = self._grads(dev, self._acc, self._critic_acc)
        t1 = self.tracer.now()
        tokens = sum(len(s.sample.prompt) + len(s.sample.response) for g in groups for s in g)
        self.tracer.add(
            "trainer/micro-batch",
            "accumulate",
            t0,
            t1,
            groups=len(groups),
            tokens=tokens,  # prompt + response of every sample
            rows=shape[0],  # the padded batch actually trained (shared-prompt / packed rows)
            columns=shape[1],
        )
        step.micro += 1
        step.busy_s += t1 - t0
        self.supervisor.tick("trainer")

    def _place(self, b: int, groups: list[micro_batches.Group], stats: dict) -> Any:
        """The micro-batch on the training mesh and its padded (rows, columns) (None if the
        gate dropped every group), with pi_old recomputed when TIS is on, reference
        log-probs and, with the critic, GAE advantages and returns."""
        c, t = self.c, self.c.trainer
        batch = micro_batches.pack_groups(
            b,
            groups,
            gate=self.gate,
            advantage=self.cfg.algorithm.advantage,
            **t.cfg.layout,
            pad_id=c.tokenizer.pad_id,
            stats=stats,
            overlong=self.overlong,
        )
        if self.group is not None:  # every training process feeds the same global shape
            batch = self.group.agree(batch, c.tokenizer.pad_id, t.cfg.batch_buckets)
        if batch is None:
            return None
        return self._on_device(batch), batch.shape

    def _grads(self, dev: TrainBatch, acc: Any, critic_acc: Any) -> tuple[Any, Any]:
        """The micro-batch's gradients (policy, and critic) added into the donated
        accumulators; returns the new ones once computed (a deliberate sync point: the
        trace span must cover the compute, and it bounds the micro-batches queued)."""
        c = self.c
        acc, _ = c.trainer.accumulate(c.state, acc, dev, self._one)
        if c.critic is not None:
            critic_acc, _ = c.critic.accumulate(c.critic_state, critic_acc, dev, self._one)
        return jax.block_until_ready((acc, critic_acc))

    def _on_device(self, batch: TrainBatch) -> TrainBatch:
        """A host micro-batch placed on the training mesh, with the targets the loss
        reads computed there (pi_old, reference log-probs, the critic's GAE)."""
        c, t = self.c, self.c.trainer
        dev = t.place_batch(batch)
        if t.cfg.tis_cap is not None:
            # pi_old under the trainer's weights (not yet updated this batch: tis_cap needs
            # one mini-batch), so the TIS weight min(pi_old / mu, cap) sees the sampler's
            # mismatch: int8 rollout, staleness, a mid-sample weight swap (docs/trainer.md).
            dev = dev.replace(old_logp=t.logprobs(c.state.params, dev))
        if c.ref_params is not None:
            dev = dev.replace(ref_logp=t.logprobs(c.ref_params, dev))
        if c.critic is not None:
            # GAE from the critic's values under its weights from before its update on
            # this batch (per sample: any split into micro-batches gives the same targets).
            dev = c.critic.fill_gae(c.critic_state.params, dev)
        return dev

    # ------------------------------------------------------------------ precompile
    def _precompile(self) -> int:
        """`pipeline.precompile` (pipeline/precompile.py): every micro-batch shape the
        remaining batches can produce, run once before the first step on an all-padding
        batch into a throwaway accumulator (the state is not touched). Returns the shapes
        compiled (0 when the lengths are not known in advance)."""
        cfg, c, p = self.cfg, self.c, self.cfg.pipeline
        if not cfg.generation.length_replay or self.dynamic is not None:
            logging.info(
                "pipeline.precompile: the trainer's micro-batch shapes depend on what is "
                "sampled (%s): only the generation instances precompile",
                "dynamic sampling" if cfg.generation.length_replay else "no length replay",
            )
            return 0
        start = self.steps.start
        ahead = p.staleness if p.partial_budget_tokens > 0 else 0
        batches = range(start, p.steps)
        lens = self.ckpts.preview(range(start, p.steps + ahead), p.prompts_per_step)
        shapes = precompile.micro_batch_shapes(
            cfg,
            c.trainer.cfg.layout,
            self.schedule,
            precompile.group_lengths(cfg, lens),
            batches,
            count=1 if self.group is None else self.group.count,
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
        acc = c.trainer.init_accumulator()
        critic_acc = c.critic.init_accumulator() if c.critic is not None else None
        for rows, columns, width in shapes:
            dev = self._on_device(pad_batch(None, rows, columns, c.tokenizer.pad_id, width))
            acc, critic_acc = self._grads(dev, acc, critic_acc)
        logging.info("pipeline.precompile: trainer shapes (rows, columns, loss width): %s", shapes)
        return len(shapes)

    # ------------------------------------------------------------------ boundaries
    def _apply(self, b: int, k: int, step: _Step) -> None:
        """The optimizer step(s) closing mini-batch k of batch b."""
        c, t0 = self.c, self.tracer.now()
        self.at_boundary = False
        c.state, self._acc, m = c.trainer.apply(c.state, self._acc)
        if c.critic is not None:
            c.critic_state, self._critic_acc, cm = c.critic.apply(c.critic_state, self._critic_acc)
            m = m | {f"critic_{name}": v for name, v in cm.items()}
        step.device.append(m)
        if self.cfg.pipeline.nonfinite == "stop":
            skipped = [key for key in ("nonfinite", "critic_nonfinite") if key in m]
            if any(float(host(m[key])) > 0 for key in skipped):
                raise NonFiniteError(
                    f"step {b}: non-finite loss or gradients (pipeline.nonfinite='stop'); the "
                    "update was not applied"
                )
        name = f"step {b}" if self.cfg.pipeline.mini_batches == 1 else f"step {b}.{k}"
        self.tracer.add("trainer/optimizer", name, t0, self.tracer.now())

    def _publish(self, version: int) -> float:
        """Sends W_version to generation; background in stream_async. Returns sync seconds.

        Raises:
          PipelineError("weight sync"): this transfer (or, in stream_async, the previous
            background one) failed.
        """
        ws, params = self.c.weight_sync, self.c.state.params
        try:
            if self.schedule.mode == "stream_async":
                if ws.in_flight:
                    ws.result(self.timeout)
                t0 = self.tracer.now()

                def landed(published, stats):
                    self.tracer.add(
                        "weight_sync/transfer", f"W{version}", t0, self.tracer.now(), **stats.report
                    )
                    self.board.publish(version, published)

                ws.start(params, version, on_done=landed)
                return ws.history[-1].seconds if ws.history else 0.0
            t0 = self.tracer.now()
            published, stats = ws.transfer(params, version)
            self.tracer.add(
                "weight_sync/transfer", f"W{version}", t0, self.tracer.now(), **stats.report
            )
            self.board.publish(version, published)
            return stats.seconds
        except Exception as e:
            raise PipelineError("weight sync", e) from e

    def checkpoint(self, k: int, force: bool = False) -> None:
        """Checkpoint k at the boundary after batch k-1 (the checkpoint hook; forced at
        the end of a run and before a stop)."""
        if not self.ckpts.due(k, force):
            return
        t0 = self.tracer.now()
        try:
            self.ckpts.save(k, self.board, force=force)
        except Exception as e:
            raise PipelineError("checkpoint writer", e) from e
        self.tracer.add("checkpoint/save", f"step {k}", t0, self.tracer.now())

    def checkpoint_at_boundary(self, raise_errors: bool = False) -> None:
        """On a failure or a stop: save the last step boundary if the state is at one
        (not mid-way through a batch's mini-batch steps) and it is not saved yet."""
        k = self.trained
        if self.ckpts.ckpt is None or not self.at_boundary or k == 0 or k in self.ckpts.saved:
            return
        try:
            self.checkpoint(k, force=True)
            self.ckpts.close()
            logging.warning("saved checkpoint %d before stopping", k)
        except Exception as e:
            if raise_errors:
                raise
            logging.error("best-effort checkpoint %d failed: %r", k, e)
