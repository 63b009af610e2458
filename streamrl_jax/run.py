"""Runs an experiment: the four modes of DESIGN.md §3 as schedules over one set of components.

Three activities, each on its own thread:

* **generation driver** and **collector** (`driver.GenerationDriver`): for
  batch b, W_{g(b)} from the weight board, swapped into the generation service
  once every earlier request has finished (no sample mixes versions), then the
  batch's `prompts_per_step x group_size` requests (plus the held-out
  evaluation prompts when one is due); each finished sample, the moment it
  completes, goes to `on_sample`: scored on the reward pool and put into the
  grouping sample stream (evaluation samples are scored and kept apart);
* **trainer** (the calling thread): takes complete groups of batch b —
  streaming modes as soon as `min_groups` are ready, batch modes once all
  are — checks their versions, computes advantages, accumulates gradients per
  micro-batch, applies one optimizer step at the batch boundary and publishes
  W_{b+1} (in the background in stream_async, so the copy overlaps the next
  step).

Several processes (docs/multicontroller.md): a training process runs the same
trainer with a `GenerationLink` instead of a local driver; samples arrive from
the generation processes through it into the same `on_sample`, and
`Components.weight_sync` sends W_{b+1} to them.

Any thread's exception fails the stream and the board, so every other wait
wakes at once; the run ends with `PipelineError` naming the component, all
threads joined with timeouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np
from absl import logging

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.build import Components, build
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.distributed.shards import TrainingGroup, host
from streamrl_jax.driver import GenerationDriver
from streamrl_jax.generation.types import Sample
from streamrl_jax.metrics import MetricsWriter, Progress, Tracer
from streamrl_jax.resume import ResumePoint, RunCheckpoints
from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.schedule import Schedule, VersionGate, WeightBoard
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.scheduling.sample_log import SampleLog
from streamrl_jax.stream.batcher import Scored, pack_groups
from streamrl_jax.stream.sample_stream import SampleStream, StreamError
from streamrl_jax.trainer.step import NonFiniteError


class PipelineError(RuntimeError):
    """A component of the pipeline failed; `component` names it."""

    def __init__(self, component: str, exc: BaseException):
        super().__init__(f"{component} failed: {exc!r}")
        self.component = component


@dataclasses.dataclass
class RunResult:
    """What a finished run hands back (tests and benchmarks read it)."""

    state: Any  # final TrainState (on the training mesh)
    steps: list[dict[str, float]]  # per-step host metrics
    evals: dict[int, dict[str, float]]  # policy version -> eval metrics
    trained_versions: list[list[int]]  # per step, the policy version of every trained sample
    wall_s: float
    samples: int
    start_batch: int = 0  # first batch of this process (> 0 when resumed from a checkpoint)
    stopped: bool = False  # ended early by SIGINT/SIGTERM (after checkpointing)
    checkpoints: list[int] = dataclasses.field(default_factory=list)  # steps saved


class _Shutdown(RuntimeError):
    """SIGINT/SIGTERM asked the run to checkpoint and stop."""


class GenerationLink(Protocol):
    """Generation running in other processes, as the training process sees it
    (`distributed/pipeline.py`; weights go out through `Components.weight_sync`)."""

    num_instances: int  # generation instances over all generation processes

    def attach(
        self,
        on_sample: Callable[[Sample, Callable[[], None]], None],
        on_chunk: Callable[..., None],
        on_span: Callable[..., None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        """Starts delivering: each sample to `on_sample(sample, done)` (the channel's
        credit comes back after `done()`: back-pressure), each decode chunk to
        `on_chunk(instance, t0, t1, tokens, running, steps, prefilled)`, other spans to
        `on_span(track, name, t0, t1, **args)` (wall times), a lost process to
        `on_error(component, exc)`."""
        ...

    def close(self, outcome: str, timeout: float) -> None:
        """Tells the generation processes how the run ended ("ok", "stopped" or the
        error) and closes the channels in order."""
        ...


class _Run:
    def __init__(
        self, cfg: ExperimentConfig, c: Components, workdir: str, link: GenerationLink | None
    ):
        self.cfg, self.c, self.workdir, self.link = cfg, c, workdir, link
        p = cfg.pipeline
        self.sched = Schedule.from_config(p)
        self.gate = VersionGate(self.sched, strict=p.strict_versions)
        self.board = WeightBoard()
        self.stream: SampleStream[Scored] = SampleStream(
            group_size=p.group_size,
            group_key=lambda s: (s.sample.metadata["batch"], s.sample.metadata["group"]),
            capacity=2 * p.prompts_per_step * p.group_size,
        )
        self.tracer = Tracer(cfg.log.trace)
        self.writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard)
        self.timeout = p.timeout_s
        self._stop = threading.Event()
        self._t_start = time.monotonic()
        self.watchdog_alerts: list[str] = []
        self._error: tuple[str, BaseException] | None = None
        self._lock = threading.Condition()
        self._evals: dict[int, list[Scored]] = defaultdict(list)
        self.eval_metrics: dict[int, dict[str, float]] = {}
        self.driver: GenerationDriver | None = None  # generation in this process (no link)
        self.sample_log = (
            SampleLog(os.path.join(workdir, "samples.jsonl")) if cfg.log.samples else None
        )
        self.reward_pool = RewardPool(
            self._traced_reward, num_workers=2, on_error=cfg.data.reward_errors
        )
        self.ckpts = RunCheckpoints(cfg, c, workdir, self.sched)
        self.live = LiveScheduler(cfg, cfg.mesh.instance_slots, c.model_cfg.vocab_size)
        self.ckpts.ranker = self.live.ranker  # saved and restored with the checkpoints
        self._spans: dict[int, list[float]] = {}  # batch -> [first admit, last finish]
        self.start = 0  # first batch (a resumed run starts at its checkpoint's)
        self.resume: ResumePoint | None = None
        self._trained = 0  # batches trained so far (the next checkpoint's step)
        self._at_boundary = True  # state is W_{_trained} (no mini-batch step of a batch yet)
        self._shutdown_req = threading.Event()
        self.rows: list[dict[str, float]] = []  # per trained step (from self.start)
        self.versions: list[list[int]] = []
        self._pending_metrics: list = []
        self._decisions_written = 0
        self._ranker_thread: threading.Thread | None = None
        # Progress counters the watchdog reads: stage -> (count, monotonic time of change).
        self._progress: dict[str, list[float]] = {}
        self._busy_lock = threading.Lock()
        self._gen_busy: dict[Any, float] = defaultdict(float)  # instance -> busy seconds
        if link is None:
            for engine in c.service.engines:
                engine.on_chunk = self._trace_chunk
        # Several training processes: this one's slice of every micro-batch (shards.py).
        self.group: TrainingGroup | None = getattr(link, "group", None)
        self._one = c.trainer.scalar(1.0)  # the micro-batch normaliser, on the training mesh
        self.outcome = "failed"  # how the run ended, told to generation processes

    def _gen_busy_s(self) -> float:
        with self._busy_lock:
            return sum(self._gen_busy.values())

    def _gen_span(self, sample: Sample) -> None:
        b, t = sample.metadata["batch"], sample.timings
        with self._busy_lock:
            span = self._spans.setdefault(b, [t.admit, t.finish])
            span[0], span[1] = min(span[0], t.admit), max(span[1], t.finish)

    # ------------------------------------------------------------------ watchdog
    def _tick(self, stage: str) -> None:
        now = time.monotonic()
        with self._busy_lock:
            entry = self._progress.setdefault(stage, [0.0, now])
            entry[0] += 1
            entry[1] = now

    def _watchdog(self) -> None:
        """Warns (once per stall) about a stage with work that has not progressed in
        `pipeline.watchdog_s`; turns a shutdown request into a stream failure (the
        signal handler itself must not take locks)."""
        limit, warned = self.cfg.pipeline.watchdog_s, set()
        while not self._stop.wait(min(1.0, limit / 4)):
            if self._shutdown_req.is_set():
                self.stream.fail(_Shutdown("shutdown requested by signal"), "shutdown")
                self.board.fail(_Shutdown("shutdown requested by signal"))
                return
            now = time.monotonic()
            busy = {
                "generation": self.driver is not None and self.driver.pending() > 0,
                "reward": self.reward_pool.pending() > 0,
                "trainer": self.stream.depth()["ready_groups"] > 0,
            }
            with self._busy_lock:
                last = {k: v[1] for k, v in self._progress.items()}
            for stage, has_work in busy.items():
                idle = now - last.get(stage, self._t_start)
                if has_work and idle > limit and stage not in warned:
                    warned.add(stage)
                    self.watchdog_alerts.append(stage)
                    logging.warning(
                        "watchdog: %s made no progress for %.0f s (queue %s); it fails at "
                        "pipeline.timeout_s=%.0f s",
                        stage,
                        idle,
                        self.stream.depth(),
                        self.timeout,
                    )
                elif idle <= limit:
                    warned.discard(stage)

    def _trace_chunk(
        self,
        instance: int | str,
        t0: float,
        t1: float,
        tokens: int,
        running: int,
        steps: int = 0,
        prefilled: int = 0,
    ) -> None:
        with self._busy_lock:
            self._gen_busy[instance] += t1 - t0
        self._tick("generation")
        self.tracer.add_wall(
            f"generation/instance {instance}",
            "decode",
            t0,
            t1,
            tokens=tokens,
            running=running,
            steps=steps,
            prefilled=prefilled,
        )

    def _traced_reward(self, text: str, metadata: dict[str, Any]) -> RewardResult:
        with self.tracer.span("reward/pool", "score"):
            return self.c.reward_fn(text, metadata)

    # ------------------------------------------------------------------ failure
    def fail(self, component: str, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = (component, exc)
                logging.error("%s failed: %r", component, exc)
            self._lock.notify_all()
        self.stream.fail(exc, component)
        self.board.fail(exc)
        if self.driver is not None:
            self.driver.abort(exc)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            component, exc = self._error
            raise PipelineError(component, exc) from exc

    # ------------------------------------------------------------------ samples in
    def _weights(self, version: int) -> list[Any]:
        """The local driver's `weights` hook: W_version from the board, per instance."""
        published = self.board.wait_for(version, self.timeout)
        # Keep what a checkpoint of the trainer's next boundary still needs.
        self.board.discard_below(min(version, self.sched.generation_version(self._trained)))
        return [w.params for w in published]

    def on_sample(self, sample: Sample, done: Callable[[], None] | None = None) -> None:
        """One finished sample (collector thread, or a sample channel's reader thread):
        decode; evaluation samples are scored here, training samples on the reward pool
        and then put into the grouping stream. `done()` runs once the sample is in the
        stream (or scored, for evaluation; or failed)."""
        text = self.c.tokenizer.decode(sample.response)
        if "eval_version" in sample.metadata:
            try:
                self._collect_eval(sample, text)
            finally:
                if done is not None:
                    done()
            return
        if self.sample_log is not None:
            self.sample_log.write(sample, sample.metadata["batch"])
        self._gen_span(sample)
        future = self.reward_pool.submit(text, sample.metadata)
        future.add_done_callback(lambda f, s=sample, t=text: self._scored(s, t, f, done))

    def _scored(
        self, sample: Sample, text: str, future: Any, done: Callable[[], None] | None
    ) -> None:
        try:
            reward = future.result()
            self._tick("reward")
            self.stream.put(Scored(sample, text, reward), timeout=self.timeout)
        except StreamError:
            pass  # the stream already carries the first failure
        except BaseException as e:  # noqa: BLE001
            self.fail("reward function", e)
        finally:
            if done is not None:
                done()

    def _collect_eval(self, sample: Sample, text: str) -> None:
        version = sample.metadata["eval_version"]
        result = self.c.reward_fn(text, sample.metadata)
        with self._lock:
            self._evals[version].append(Scored(sample, text, result))
            done = len(self._evals[version]) == len(self.c.eval_prompts)
        if done:
            group = self._evals[version]
            m = {
                "accuracy": float(np.mean([s.reward.correct for s in group])),
                "format_ok": float(np.mean([s.reward.format_ok for s in group])),
                "response_len": float(np.mean([len(s.sample.response) for s in group])),
                "num_problems": float(len(group)),
            }
            with self._lock:
                self.eval_metrics[version] = m
                self._lock.notify_all()
            self.writer.write(version, m, prefix="eval/")
            logging.info("eval at policy version %d: %s", version, m)

    # ------------------------------------------------------------------ trainer
    def _take_groups(self, batch: int, min_groups: int, max_groups: int, parked: dict):
        """Complete groups of `batch`, parking groups of later batches for later."""
        out = parked.pop(batch, [])
        while len(out) < min_groups:
            for group in self.stream.get_groups(
                min_groups=1, max_groups=max_groups, timeout=self.timeout
            ):
                b = group[0].sample.metadata["batch"]
                (out if b == batch else parked.setdefault(b, [])).append(group)
        if len(out) > max_groups:
            parked[batch] = out[max_groups:]
            out = out[:max_groups]
        return out

    def _take_indexed(self, batch: int, want: list[int], parked: dict):
        """Deterministic mode: exactly the groups `want` of `batch`, in that order,
        members in member order (a fixed summation order)."""
        have = {g[0].sample.metadata["group"]: g for g in parked.pop(batch, [])}
        while not all(i in have for i in want):
            for group in self.stream.get_groups(min_groups=1, max_groups=1, timeout=self.timeout):
                b = group[0].sample.metadata["batch"]
                if b == batch:
                    have[group[0].sample.metadata["group"]] = group
                else:
                    parked.setdefault(b, []).append(group)
        out = [sorted(have.pop(i), key=lambda s: s.sample.metadata["member"]) for i in want]
        if have:
            parked[batch] = list(have.values())
        return out

    def _micro_batch(self, step: int, groups: list[list[Scored]], stats: dict) -> Any:
        t = self.c.trainer
        batch = pack_groups(
            step,
            groups,
            gate=self.gate,
            advantage=self.cfg.algorithm.advantage,
            seq_buckets=t.cfg.seq_buckets,
            batch_buckets=t.cfg.batch_buckets,
            pad_id=self.c.tokenizer.pad_id,
            stats=stats,
        )
        if self.group is not None:  # every training process feeds the same global shape
            batch = self.group.agree(batch, self.c.tokenizer.pad_id, t.cfg.batch_buckets)
        if batch is None:
            return None
        dev = t.place_batch(batch)
        if self.c.ref_params is not None:
            dev = dev.replace(ref_logp=t.logprobs(self.c.ref_params, dev))
        return dev

    def _publish(self, version: int) -> float:
        """Sends W_version to generation; background in stream_async. Returns sync seconds.

        Raises:
          PipelineError("weight sync"): this transfer (or, in stream_async, the previous
            background one) failed.
        """
        try:
            return self._publish_unchecked(version)
        except Exception as e:
            raise PipelineError("weight sync", e) from e

    def _publish_unchecked(self, version: int) -> float:
        ws, params = self.c.weight_sync, self.c.state.params
        if self.sched.mode == "stream_async":
            if ws.in_flight:
                ws.result(self.timeout)
            t0 = self.tracer.now()

            def landed(published, stats):
                self.tracer.add("weight_sync/transfer", f"W{version}", t0, self.tracer.now())
                self.board.publish(version, published)

            ws.start(params, version, on_done=landed)
            return ws.history[-1].seconds if ws.history else 0.0
        with self.tracer.span("weight_sync/transfer", f"W{version}"):
            published, stats = ws.transfer(params, version)
        self.board.publish(version, published)
        return stats.seconds

    def _train(self, progress: Progress) -> tuple[list[dict], list[list[int]]]:
        p, t = self.cfg.pipeline, self.c.trainer
        acc = t.init_accumulator()
        parked: dict[int, list] = {}
        steps, versions = self.rows, self.versions
        start, samples_done = time.perf_counter(), 0
        for b in range(self.start, p.steps):
            t_step = time.perf_counter()
            gen_busy0, waits0 = self._gen_busy_s(), dataclasses.replace(self.stream.metrics)
            stats: dict[str, list] = defaultdict(list)
            micro_metrics, apply_metrics, train_busy = [], [], 0.0
            prompt_ids: list[str] = []
            drawn = None
            if self.link is not None:  # the generation processes drew the same prompts
                drawn = [q.problem.prompt_id for q in self.ckpts.draw(b, p.prompts_per_step)]
            # PPO mini-batches: `mini_batches` optimizer steps per global batch, each
            # over the next prompts_per_step / mini_batches complete groups in arrival
            # order; W_{b+1} is published once, after the last (DESIGN.md §2: versions
            # count batches).
            for k in range(p.mini_batches):
                for groups in self._micro_groups(b, k, parked):
                    prompt_ids += [g[0].sample.metadata["prompt_id"] for g in groups]
                    if drawn is not None:
                        _check_prompts(b, groups, drawn)
                    acc, busy = self._accumulate(b, groups, acc, stats, micro_metrics)
                    train_busy += busy
                t0 = self.tracer.now()
                self._at_boundary = False
                self.c.state, acc, m = t.apply(self.c.state, acc)
                apply_metrics.append(m)
                if p.nonfinite == "stop":
                    self._check_finite(b, m)
                name = f"step {b}" if p.mini_batches == 1 else f"step {b}.{k}"
                self.tracer.add("trainer/optimizer", name, t0, self.tracer.now())
            sync_s = self._publish(b + 1)
            self._at_boundary, self._trained = True, b + 1
            self._tick("trainer")
            self.ckpts.log_consumed(b, prompt_ids)
            self._checkpoint(b + 1)
            if self.link is not None:  # no local driver frees the board: keep what g() needs
                self.board.discard_below(self.sched.generation_version(self._trained))
            # Fetch the previous step's device metrics only now, after this step's
            # work is dispatched.
            self._flush_pending()
            self._pending_metrics = apply_metrics
            batch_stats, n_samples = self._batch_stats(b, stats)
            samples_done += n_samples
            now = time.perf_counter()
            wall = max(now - t_step, 1e-9)
            n_inst = self.link.num_instances if self.link else len(self.c.service.engines)
            row = batch_stats | {
                "dropped_overlong": float(self.c.prompts.dropped_overlong),
                "truncated_overlong": float(self.c.prompts.truncated_overlong),
                "queue_depth": float(self.stream.depth()["ready_samples"]),
                "step_s": wall,
                "train_busy": train_busy / wall,
                # Fraction of this step's wall time the instances spent decoding or
                # prefilling (mean over instances).
                "gen_busy": (self._gen_busy_s() - gen_busy0) / (wall * n_inst),
                # Trainer blocked waiting for complete groups / reward threads blocked
                # on back-pressure, seconds within this step.
                "stream_wait_s": self.stream.metrics.consumer_wait_s - waits0.consumer_wait_s,
                "stream_backpressure_s": (
                    self.stream.metrics.producer_wait_s - waits0.producer_wait_s
                ),
                "weight_sync_s": sync_s,
                "samples_per_s": samples_done / (now - start),
                "micro_batches": float(len(micro_metrics)),
                "optimizer_steps": float(len(apply_metrics)),
                "reward_errors": float(self.reward_pool.num_errors),
                "watchdog_alerts": float(len(self.watchdog_alerts)),
            }
            with self._busy_lock:
                span = self._spans.pop(b, [0.0, 0.0])
            row |= self.live.end_of_step(b, span[1] - span[0], train_busy)
            self._refresh_ranker()
            self._write_decisions()
            steps.append(row)
            versions.append(list(stats["versions"]))
            progress.update(
                b + 1, reward=row["reward"], acc=row["accuracy"], sps=row["samples_per_s"]
            )
        self._flush_pending()
        return steps, versions

    def _micro_groups(self, b: int, k: int, parked: dict) -> Iterator[list[list[Scored]]]:
        """The groups of each micro-batch of mini-batch k of batch b, taken lazily (each
        once the previous micro-batch is accumulated)."""
        p = self.cfg.pipeline
        if self.group is not None:
            # Several training processes: this process's fixed slice of each micro-batch,
            # so all of them make the same calls (distributed/shards.py).
            own = self.group.own
            for j in range(own.micro_batches()):
                want = own.local_groups(k, j, self.group.index)
                if p.deterministic:
                    yield self._take_indexed(b, want, parked)
                else:
                    yield self._take_groups(b, len(want), len(want), parked)
            return
        per_mini = p.prompts_per_step // p.mini_batches
        remaining = per_mini
        while remaining:
            if p.deterministic:
                first = k * per_mini + per_mini - remaining
                count = min(p.micro_batch_groups, remaining)
                groups = self._take_indexed(b, list(range(first, first + count)), parked)
            else:
                groups = self._take_groups(
                    b,
                    self.sched.min_groups(p, remaining),
                    min(p.micro_batch_groups, remaining),
                    parked,
                )
            remaining -= len(groups)
            yield groups

    def _accumulate(
        self, b: int, groups: list[list[Scored]], acc: Any, stats: dict, micro_metrics: list
    ) -> tuple[Any, float]:
        """One micro-batch's gradients into `acc`; returns (acc, busy seconds)."""
        t, one = self.c.trainer, self._one
        t0 = self.tracer.now()
        dev = self._micro_batch(b, groups, stats)
        if dev is None:
            return acc, 0.0
        acc, m = t.accumulate(self.c.state, acc, dev, one)
        # Deliberate sync point: the trace span must cover the compute, and it bounds
        # the micro-batches queued on the device.
        jax.block_until_ready(acc)
        t1 = self.tracer.now()
        tokens = sum(len(s.sample.prompt) + len(s.sample.response) for g in groups for s in g)
        self.tracer.add(
            "trainer/micro-batch", "accumulate", t0, t1, groups=len(groups), tokens=tokens
        )
        micro_metrics.append(m)
        self._tick("trainer")
        return acc, t1 - t0

    def _batch_stats(self, b: int, stats: dict[str, list]) -> tuple[dict[str, float], int]:
        """The step's sample statistics (over every training process's share) and the
        number of samples trained."""
        means = {  # metric -> per-sample list in `stats`
            "reward": "reward",
            "accuracy": "correct",
            "format_ok": "format_ok",
            "response_len": "length",
            "truncated": "truncated",
        }
        sums = [float(np.sum(stats[k])) for k in means.values()]
        sums += [float(np.sum([b - v for v in stats["versions"]])), float(self.gate.dropped)]
        sums.append(float(len(stats["reward"])))
        longest = max(stats["length"], default=0)
        if self.group is not None:
            sums, longest = self.group.sum(sums), self.group.max([longest])[0]
        *totals, staleness, dropped, n = sums
        mean = lambda x: x / n if n else float("nan")
        out = {k: mean(x) for k, x in zip(means, totals, strict=True)}
        out |= {
            "response_len_max": float(longest),
            "staleness": mean(staleness),
            "dropped_stale": dropped,
        }
        return out, int(n)

    def _refresh_ranker(self) -> None:
        """Online ranker refresh on its own thread (one at a time; skipped while the
        previous one still runs, its samples wait for the next)."""
        if self._ranker_thread is not None and self._ranker_thread.is_alive():
            return
        batch = self.live.take_refresh_batch()
        if batch:
            self._ranker_thread = threading.Thread(
                target=self.live.refresh, args=(batch,), name="ranker-refresh", daemon=True
            )
            self._ranker_thread.start()

    def _write_decisions(self) -> None:
        """Appends new dispatch / elastic decisions to scheduling.jsonl."""
        new = self.live.decisions[self._decisions_written :]
        if not new:
            return
        self._decisions_written += len(new)
        with open(os.path.join(self.workdir, "scheduling.jsonl"), "a", encoding="utf-8") as f:
            for d in new:
                f.write(json.dumps(d, default=float) + "\n")

    def _flush_pending(self) -> None:
        """Fetches the last step's device metrics and writes its row (one step late, so
        the fetch never stalls the device)."""
        if self._pending_metrics and self.rows:
            self.rows[-1].update(_fetch(self._pending_metrics))
            self.writer.write(self.start + len(self.rows) - 1, self.rows[-1])
        self._pending_metrics = []

    def _checkpoint(self, k: int, force: bool = False) -> None:
        """Checkpoint k at the boundary after batch k-1 (when due, or forced)."""
        if not self.ckpts.due(k, force):
            return
        t0 = self.tracer.now()
        try:
            self.ckpts.save(k, self.board, force=force)
        except Exception as e:
            raise PipelineError("checkpoint writer", e) from e
        self.tracer.add("checkpoint/save", f"step {k}", t0, self.tracer.now())

    def _check_finite(self, b: int, metrics: dict) -> None:
        if float(host(metrics["nonfinite"])) > 0:
            raise NonFiniteError(
                f"step {b}: non-finite loss or gradients (pipeline.nonfinite='stop'); the "
                "update was not applied"
            )

    def _wait_final_eval(self) -> None:
        """Waits for the greedy eval of the final weights (version = steps), which the
        generation side runs once W_steps is published."""
        version = self.cfg.pipeline.steps
        if self.cfg.eval.num_problems == 0 or not self.c.eval_prompts:
            return
        with self._lock:
            ok = self._lock.wait_for(
                lambda: version in self.eval_metrics or self._error is not None, self.timeout
            )
        self._raise_if_failed()
        if not ok:
            raise TimeoutError(f"final evaluation did not finish within {self.timeout:.0f} s")

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        c, p = self.c, self.cfg.pipeline
        try:
            self.resume = self.ckpts.restore()
        except BaseException:
            self._shutdown([])
            raise
        if self.resume is None:
            self.board.publish(0, c.initial_weights)
        else:
            k = self.start = self._trained = self.resume.batch
            for v in sorted(self.resume.gen_weights):
                self.board.publish(v, self.resume.gen_weights[v])
            if k not in self.resume.gen_weights:
                published, _ = c.weight_sync.transfer(c.state.params, k)
                self.board.publish(k, published)
        threads = [threading.Thread(target=self._watchdog, name="watchdog", daemon=True)]
        if self.link is None:
            self.driver = GenerationDriver(
                self.cfg,
                c.service,
                self.live,
                c.eval_prompts,
                weights=self._weights,
                draw=self.ckpts.draw,
                emit=self.on_sample,
                on_error=self.fail,
                start=self.start,
                # A resumed run's service holds the build's W_0: always load its version.
                loaded_version=0 if self.resume is None else -1,
                expected_ids=self.resume.expected_ids if self.resume is not None else None,
            )
        signals = None
        if self.cfg.checkpoint.on_signal and threading.current_thread() is threading.main_thread():
            signals = ckpt_lib.install_shutdown_handler(lambda signum: self._shutdown_req.set())
        progress = Progress(p.steps, enabled=self.cfg.log.progress, initial=self.start)
        start = time.perf_counter()
        stopped = False
        try:
            for th in threads:
                th.start()
            if self.driver is not None:
                threads += self.driver.start_threads()
            else:
                self.link.attach(self.on_sample, self._trace_chunk, self.tracer.add_wall, self.fail)
            try:
                self._train(progress)
            except StreamError as e:
                if not self._shutdown_req.is_set():
                    self._best_effort_checkpoint()
                    self._raise_if_failed()
                    raise PipelineError("sample stream", e) from e
                stopped = True
                logging.warning("stopping on signal after step %d", self._trained)
                self._flush_pending()
                self._best_effort_checkpoint(raise_errors=True)
            except BaseException as e:
                self.fail(e.component if isinstance(e, PipelineError) else "trainer", e)
                self._best_effort_checkpoint()
                raise
            if self.c.weight_sync.in_flight:
                self.c.weight_sync.result(self.timeout)
            if not stopped:
                if self.ckpts.enabled:
                    self._checkpoint(self._trained, force=True)  # the end of the run
                self._wait_final_eval()
            try:
                self.ckpts.close()  # bounded wait for the last write
            except Exception as e:
                raise PipelineError("checkpoint writer", e) from e
            self.outcome = "stopped" if stopped else "ok"
            return RunResult(
                state=c.state,
                steps=self.rows,
                evals=dict(self.eval_metrics),
                trained_versions=self.versions,
                wall_s=time.perf_counter() - start,
                samples=sum(len(v) for v in self.versions),
                start_batch=self.start,
                stopped=stopped,
                checkpoints=list(self.ckpts.saved),
            )
        finally:
            if signals is not None:
                signals.uninstall()
            self._shutdown(threads)
            progress.close()

    def _best_effort_checkpoint(self, raise_errors: bool = False) -> None:
        """On a failure or a stop: save the last step boundary if the state is at one
        (not mid-way through a batch's mini-batch steps) and it is not saved yet."""
        k = self._trained
        if self.ckpts.ckpt is None or not self._at_boundary or k == 0 or k in self.ckpts.saved:
            return
        try:
            self._checkpoint(k, force=True)
            self.ckpts.close()
            logging.warning("saved checkpoint %d before stopping", k)
        except Exception as e:
            if raise_errors:
                raise
            logging.error("best-effort checkpoint %d failed: %r", k, e)

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        self._stop.set()
        if self.driver is not None:
            self.driver.stop()
        self.stream.close()
        self.board.fail(RuntimeError("run finished"))
        stalled = []
        for th in threads:
            th.join(self.timeout)
            if th.is_alive():
                stalled.append(th.name)
        try:
            if self.c.weight_sync.in_flight:
                self.c.weight_sync.result(self.timeout)
        except BaseException as e:  # noqa: BLE001 - already failing or finished
            logging.warning("weight sync at shutdown: %r", e)
        if self.link is not None:
            if self.outcome == "failed" and self._error is not None:
                self.outcome = f"failed: {self._error[0]}: {self._error[1]!r}"
            try:
                self.link.close(self.outcome, self.timeout)
            except BaseException as e:  # noqa: BLE001 - the run's own outcome wins
                logging.warning("closing the generation link: %r", e)
        self.reward_pool.close(cancel_pending=True)
        if self._ranker_thread is not None:
            self._ranker_thread.join(self.timeout)
            if self._ranker_thread.is_alive():
                stalled.append(self._ranker_thread.name)
        try:
            self.ckpts.close()
        except BaseException as e:  # noqa: BLE001 - already failing or finished
            logging.warning("checkpoint writer at shutdown: %r", e)
        self.tracer.save(f"{self.workdir}/trace.json")
        self.writer.close()
        if self.sample_log is not None:
            self.sample_log.close()
        if stalled:
            raise TimeoutError(f"pipeline threads did not stop: {stalled}")


def _check_prompts(batch: int, groups: list[list[Scored]], drawn: list[str]) -> None:
    """Several processes: every group's prompt is the one this process drew for its index
    (the seeded prompt pipelines of all processes stay in step)."""
    for g in groups:
        meta = g[0].sample.metadata
        if meta["prompt_id"] != drawn[meta["group"]]:
            raise RuntimeError(
                f"batch {batch} group {meta['group']}: generated for prompt {meta['prompt_id']}, "
                f"the trainer drew {drawn[meta['group']]} (prompt pipelines out of step)"
            )


def _fetch(metrics: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Device metrics of a step's optimizer steps, fetched and averaged over them."""
    values = host(metrics)
    out = {k: float(np.mean([m[k] for m in values])) for k in values[0]}
    if "nonfinite" in out:  # updates skipped for NaN/Inf: a count, not a mean
        out["nonfinite"] = float(np.sum([m["nonfinite"] for m in values]))
    return out


def run(
    cfg: ExperimentConfig,
    workdir: str,
    devices: list | None = None,
    reward_fn: RewardFn | None = None,
) -> RunResult:
    """Builds the components, runs the schedule of `cfg.pipeline.mode`, releases everything.

    Args:
      cfg: the experiment.
      workdir: metrics.jsonl, tensorboard/ and trace.json go here.
      devices: devices to split into the role meshes (default `jax.devices()`).
      reward_fn: replaces the task's reward (tests, custom rewards).
    """
    return run_components(cfg, build(cfg, devices), workdir, reward_fn=reward_fn)


def run_components(
    cfg: ExperimentConfig,
    components: Components,
    workdir: str,
    *,
    reward_fn: RewardFn | None = None,
    link: GenerationLink | None = None,
) -> RunResult:
    """Runs built components (closing them at the end); with `link`, generation runs in
    other processes (`components.service` is None) and samples arrive through it."""
    if reward_fn is not None:
        components.reward_fn = reward_fn
    try:
        result = _Run(cfg, components, workdir, link).run()
    finally:
        components.close(cfg.pipeline.timeout_s)
    if cfg.log.final_params:
        params = result.state.params
        mesh = components.trainer.mesh
        if mesh.is_multi_process:  # FSDP over several processes: every one gathers
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            params = host(jax.jit(lambda x: x, out_shardings=replicated)(params))
        save_params(os.path.join(workdir, FINAL_PARAMS), params)
    logging.info(
        "run finished: %d steps, %d samples in %.1f s; evals %s",
        len(result.steps),
        result.samples,
        result.wall_s,
        result.evals,
    )
    return result


FINAL_PARAMS = "final_params.npz"


def save_params(path: str, params: Any) -> None:
    """Host copies of `params` in an .npz, one array per leaf keyed by its key path
    (`log.final_params`: compare runs across processes bit for bit)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    host = jax.device_get([leaf for _, leaf in flat])
    arrays = {jax.tree_util.keystr(p): np.asarray(a) for (p, _), a in zip(flat, host, strict=True)}
    with open(path, "wb") as f:
        np.savez(f, **arrays)
