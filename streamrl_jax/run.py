"""Runs an experiment: the four modes of DESIGN.md §3 as schedules over one set of components.

Three activities, each on its own thread:

* **generation driver**: for batch b, waits for W_{g(b)} on the weight board,
  swaps it into the generation service when the version changes (only once
  every earlier request has finished, so no sample mixes versions), and
  submits the batch's `prompts_per_step x group_size` requests (plus the
  held-out evaluation prompts when one is due);
* **collector**: takes each finished sample from the service the moment it
  completes, scores it on the reward pool and puts it in the grouping sample
  stream (evaluation samples are scored and kept apart);
* **trainer** (the calling thread): takes complete groups of batch b —
  streaming modes as soon as `min_groups` are ready, batch modes once all
  are — checks their versions, computes advantages, accumulates gradients per
  micro-batch, applies one optimizer step at the batch boundary and publishes
  W_{b+1} (in the background in stream_async, so the copy overlaps the next
  step).

Any thread's exception fails the stream and the board, so every other wait
wakes at once; the run ends with `PipelineError` naming the component, all
threads joined with timeouts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from absl import logging

from streamrl_jax.build import Components, build
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import make_requests
from streamrl_jax.generation.service import StreamClosed
from streamrl_jax.generation.types import GenerationRequest, Sample, SamplingParams
from streamrl_jax.metrics import MetricsWriter, Progress, Tracer
from streamrl_jax.rewards.base import RewardFn, RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.schedule import Schedule, VersionGate, WeightBoard
from streamrl_jax.stream.batcher import Scored, pack_groups
from streamrl_jax.stream.sample_stream import SampleStream, StreamError


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


class _Run:
    def __init__(self, cfg: ExperimentConfig, c: Components, workdir: str):
        self.cfg, self.c, self.workdir = cfg, c, workdir
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
        self._error: tuple[str, BaseException] | None = None
        self._lock = threading.Condition()
        self._submitted = self._collected = 0  # requests sent to / returned by the service
        self._evals: dict[int, list[Scored]] = defaultdict(list)
        self._eval_versions: set[int] = set()  # versions whose eval was submitted
        self.eval_metrics: dict[int, dict[str, float]] = {}
        self.sampling = SamplingParams(
            temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k,
            top_p=cfg.generation.top_p,
        )
        self.reward_pool = RewardPool(self._traced_reward, num_workers=2, on_error="raise")
        self._busy_lock = threading.Lock()
        self._gen_busy: dict[int, float] = defaultdict(float)  # instance -> busy seconds
        for engine in c.service.engines:
            engine.on_chunk = self._trace_chunk

    def _gen_busy_s(self) -> float:
        with self._busy_lock:
            return sum(self._gen_busy.values())

    def _trace_chunk(self, instance: int, t0: float, t1: float, tokens: int, running: int) -> None:
        with self._busy_lock:
            self._gen_busy[instance] += t1 - t0
        self.tracer.add_wall(
            f"generation/instance {instance}", "decode", t0, t1, tokens=tokens, running=running
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

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            component, exc = self._error
            raise PipelineError(component, exc) from exc

    # ------------------------------------------------------------------ generation driver
    def _eval_requests(self, version: int) -> list[GenerationRequest]:
        g = self.cfg.generation
        return [
            GenerationRequest(
                request_id=f"eval/{version}/{i}",
                prompt=p.tokens,
                max_new_tokens=g.max_new_tokens,
                sampling=SamplingParams.greedy(),
                metadata=dict(p.problem.metadata, eval_version=version),
            )
            for i, p in enumerate(self.c.eval_prompts)
        ]

    def _eval_due(self, batch: int, version: int) -> bool:
        """Eval at batch 0 and every `eval.every` batches, once per policy version (in
        stream_async several batches share a version)."""
        every = self.cfg.eval.every
        due = batch == 0 or (every > 0 and batch % every == 0)
        if not due or self.cfg.eval.num_problems == 0 or version in self._eval_versions:
            return False
        self._eval_versions.add(version)
        return True

    def _wait_generation_idle(self) -> None:
        with self._lock:
            ok = self._lock.wait_for(
                lambda: self._collected >= self._submitted or self._error is not None,
                timeout=self.timeout,
            )
        self._raise_if_failed()
        if not ok:
            raise TimeoutError(
                f"generation service: {self._submitted - self._collected} requests unfinished "
                f"after {self.timeout:.0f} s"
            )

    def _submit(self, requests: list[GenerationRequest]) -> None:
        with self._lock:
            self._submitted += len(requests)
        self.c.service.submit(requests)

    def _driver(self) -> None:
        try:
            p, version = self.cfg.pipeline, 0
            for b in range(p.steps):
                needed = self.sched.generation_version(b)
                if needed != version:
                    self._wait_generation_idle()
                    published = self.board.wait_for(needed, self.timeout)
                    self.c.service.update_weights([w.params for w in published], needed)
                    self.board.discard_below(needed)
                    version = needed
                if self._stop.is_set():
                    return
                requests = make_requests(
                    self.c.prompts.next_prompts(p.prompts_per_step),
                    batch=b,
                    group_size=p.group_size,
                    max_new_tokens=self.cfg.generation.max_new_tokens,
                    sampling=self.sampling,
                    run_seed=self.cfg.seed,
                    length_replay=self.cfg.generation.length_replay,
                )
                if self._eval_due(b, version):
                    requests += self._eval_requests(version)
                self._submit(requests)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer
            self.fail("generation driver", e)

    # ------------------------------------------------------------------ collector
    def _collector(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sample = self.c.service.get(timeout=0.1)
                except TimeoutError:
                    continue
                except StreamClosed:
                    return
                text = self.c.tokenizer.decode(sample.response)
                if "eval_version" in sample.metadata:
                    self._collect_eval(sample, text)
                else:
                    future = self.reward_pool.submit(text, sample.metadata)
                    future.add_done_callback(lambda f, s=sample, t=text: self._scored(s, t, f))
                with self._lock:
                    self._collected += 1
                    self._lock.notify_all()
        except BaseException as e:  # noqa: BLE001
            self.fail("generation service", e)

    def _scored(self, sample: Sample, text: str, future: Any) -> None:
        try:
            reward = future.result()
            self.stream.put(Scored(sample, text, reward), timeout=self.timeout)
        except StreamError:
            pass  # the stream already carries the first failure
        except BaseException as e:  # noqa: BLE001
            self.fail("reward function", e)

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
        if batch is None:
            return None
        dev = t.place_batch(batch)
        if self.c.ref_params is not None:
            dev = dev.replace(ref_logp=t.logprobs(self.c.ref_params, dev))
        return dev

    def _publish(self, version: int) -> float:
        """Sends W_version to generation; background in stream_async. Returns sync seconds."""
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
        steps, versions = [], []
        start, samples_done = time.perf_counter(), 0
        pending_metrics: list = []
        one = t.scalar(1.0)
        per_mini = p.prompts_per_step // p.mini_batches
        for b in range(p.steps):
            t_step = time.perf_counter()
            gen_busy0, waits0 = self._gen_busy_s(), dataclasses.replace(self.stream.metrics)
            stats: dict[str, list] = defaultdict(list)
            micro_metrics, apply_metrics, train_busy = [], [], 0.0
            # PPO mini-batches: `mini_batches` optimizer steps per global batch, each
            # over the next `per_mini` complete groups in arrival order; W_{b+1} is
            # published once, after the last (DESIGN.md §2: versions count batches).
            for k in range(p.mini_batches):
                remaining = per_mini
                while remaining:
                    groups = self._take_groups(
                        b,
                        self.sched.min_groups(p, remaining),
                        min(p.micro_batch_groups, remaining),
                        parked,
                    )
                    remaining -= len(groups)
                    t0 = self.tracer.now()
                    dev = self._micro_batch(b, groups, stats)
                    if dev is None:
                        continue
                    acc, m = t.accumulate(self.c.state, acc, dev, one)
                    # Deliberate sync point: the trace span must cover the compute, and it
                    # bounds the micro-batches queued on the device.
                    jax.block_until_ready(acc)
                    t1 = self.tracer.now()
                    self.tracer.add("trainer/micro-batch", "accumulate", t0, t1, groups=len(groups))
                    micro_metrics.append(m)
                    train_busy += t1 - t0
                t0 = self.tracer.now()
                self.c.state, acc, m = t.apply(self.c.state, acc)
                apply_metrics.append(m)
                name = f"step {b}" if p.mini_batches == 1 else f"step {b}.{k}"
                self.tracer.add("trainer/optimizer", name, t0, self.tracer.now())
            sync_s = self._publish(b + 1)
            # Fetch the previous step's device metrics only now, after this step's
            # work is dispatched.
            if pending_metrics:
                steps[-1].update(_fetch(pending_metrics))
                self.writer.write(len(steps) - 1, steps[-1])
            pending_metrics = apply_metrics
            samples_done += len(stats["reward"])
            now = time.perf_counter()
            wall = max(now - t_step, 1e-9)
            n_inst = len(self.c.service.engines)
            row = {
                "reward": _mean(stats["reward"]),
                "accuracy": _mean(stats["correct"]),
                "format_ok": _mean(stats["format_ok"]),
                "response_len": _mean(stats["length"]),
                "response_len_max": float(max(stats["length"], default=0)),
                "truncated": _mean(stats["truncated"]),
                "staleness": _mean([b - v for v in stats["versions"]]),
                "dropped_stale": float(self.gate.dropped),
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
            }
            steps.append(row)
            versions.append(list(stats["versions"]))
            progress.update(
                b + 1, reward=row["reward"], acc=row["accuracy"], sps=row["samples_per_s"]
            )
        if pending_metrics:
            steps[-1].update(_fetch(pending_metrics))
            self.writer.write(len(steps) - 1, steps[-1])
        return steps, versions

    def _final_eval(self) -> None:
        """Greedy eval of the final weights (version = steps)."""
        version = self.cfg.pipeline.steps
        if not self.c.eval_prompts or version in self._eval_versions:
            return
        self._eval_versions.add(version)
        self._wait_generation_idle()
        published = self.board.wait_for(version, self.timeout)
        self.c.service.update_weights([w.params for w in published], version)
        self._submit(self._eval_requests(version))
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
        self.board.publish(0, c.initial_weights)
        threads = [
            threading.Thread(target=self._driver, name="generation-driver", daemon=True),
            threading.Thread(target=self._collector, name="collector", daemon=True),
        ]
        progress = Progress(p.steps, enabled=self.cfg.log.progress)
        start = time.perf_counter()
        try:
            for th in threads:
                th.start()
            try:
                steps, versions = self._train(progress)
            except StreamError as e:
                self._raise_if_failed()
                raise PipelineError("sample stream", e) from e
            except BaseException as e:
                self.fail("trainer", e)
                raise
            if self.c.weight_sync.in_flight:
                self.c.weight_sync.result(self.timeout)
            if self.cfg.eval.num_problems > 0:
                self._final_eval()
            wall = time.perf_counter() - start
            return RunResult(
                state=c.state,
                steps=steps,
                evals=dict(self.eval_metrics),
                trained_versions=versions,
                wall_s=wall,
                samples=sum(len(v) for v in versions),
            )
        finally:
            self._shutdown(threads)
            progress.close()

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        self._stop.set()
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
        self.reward_pool.close(cancel_pending=True)
        self.tracer.save(f"{self.workdir}/trace.json")
        self.writer.close()
        if stalled:
            raise TimeoutError(f"pipeline threads did not stop: {stalled}")


def _mean(xs: list) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def _fetch(metrics: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Device metrics of a step's optimizer steps, fetched and averaged over them."""
    host = jax.device_get(metrics)
    return {k: float(np.mean([m[k] for m in host])) for k in host[0]}


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
    components = build(cfg, devices)
    if reward_fn is not None:
        components.reward_fn = reward_fn
    try:
        result = _Run(cfg, components, workdir).run()
    finally:
        components.close(cfg.pipeline.timeout_s)
    logging.info(
        "run finished: %d steps, %d samples in %.1f s; evals %s",
        len(result.steps),
        result.samples,
        result.wall_s,
        result.evals,
    )
    return result
