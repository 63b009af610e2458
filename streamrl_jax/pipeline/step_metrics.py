"""Step metrics: what each training step writes to metrics.jsonl / TensorBoard.

* `GenerationMeter`: the generation side as the trainer sees it. Every decode
  chunk (local engines, or `ChunkReport`s from generation processes) adds busy
  seconds per instance and a trace span; every training sample widens its
  batch's generation span (first admission to last completion: the elastic
  rule's T_gen).
* `StepWork` / `StepClock`: what one step gathers while it trains (per-sample
  statistics, micro-batches, device metrics, busy seconds, prompts) and its clocks
  (wall, CPU, the trainer thread's compiling, the stream's waits), read into the
  step's row at its end.
* `StepMeter`: one row per trained step. Sample statistics (reward, accuracy,
  format, lengths, truncation, staleness, stale drops) are summed over every
  training process's share; pipeline figures (step time, train/gen busy
  fractions, stream waits, weight-sync seconds, throughput) come from the loop;
  the rollout adds its own (`Rollout.finish`); device metrics of the optimizer
  steps (loss terms, norms, lr, ...) are fetched one step late, so the fetch never
  stalls the device.
* `RunResult`: what a finished run hands back (its rows, evaluations, state).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from streamrl_jax.generation.types import ChunkReport, Sample
from streamrl_jax.metrics import MetricsWriter, Tracer, compile_seconds
from streamrl_jax.pipeline.shards import TrainerShare, host
from streamrl_jax.stream.sample_stream import StreamMetrics
from streamrl_jax.trainer.state import TrainState

# metric -> the per-sample list in a step's `stats` it is the mean of
SAMPLE_MEANS = {
    "reward": "reward",
    "accuracy": "correct",
    "format_ok": "format_ok",
    "response_len": "length",
    "truncated": "truncated",  # cut at generation.max_new_tokens (no end of sequence)
    "overlong_penalty": "overlong_penalty",  # mean soft overlong penalty (0 when off)
    "mixed_versions": "spans",  # samples whose tokens span versions (in-flight updates)
}


class GenerationMeter:
    """Generation busy time per instance and generation span per batch (thread-safe)."""

    def __init__(self, tracer: Tracer, tick: Callable[[str], None]):
        self._tracer, self._tick = tracer, tick
        self._lock = threading.Lock()
        # (t0, t1) wall intervals of recent chunks, all instances, for `busy_between`
        self._intervals: collections.deque[tuple[float, float]] = collections.deque(maxlen=1 << 18)
        self._spans: dict[int, list[float]] = {}  # batch -> [first admit, last finish]
        self._kv = [0, 0]  # episodes' turns since `pop_kv`: extended in place, re-prefilled

    def chunk(self, r: ChunkReport) -> None:
        """One decode chunk of an instance (the engines' `on_chunk`; wall times)."""
        with self._lock:
            self._intervals.append((r.t0, r.t1))
            self._kv[0] += r.extended
            self._kv[1] += r.reprefilled
        self._tick("generation")
        self._tracer.add_wall(
            f"generation/instance {r.instance}",
            "decode",
            r.t0,
            r.t1,
            tokens=r.tokens,
            running=r.running,
            steps=r.steps,
            prefilled=r.prefilled,
        )

    def sample(self, sample: Sample) -> None:
        """Widens the generation span of the sample's batch."""
        b, t = sample.tag.batch, sample.timings
        with self._lock:
            span = self._spans.setdefault(b, [t.admit, t.finish])
            span[0], span[1] = min(span[0], t.admit), max(span[1], t.finish)

    def busy_between(self, start: float, end: float) -> float:
        """Busy seconds inside the wall window [start, end], summed over instances: each
        chunk counts only its overlap with the window (a chunk that began before it, e.g.
        one that compiled a new shape, counts from `start`). Windows must not go back in
        time: chunks that ended before `start` are dropped."""
        with self._lock:
            while self._intervals and self._intervals[0][1] < start:
                self._intervals.popleft()
            return sum(max(0.0, min(t1, end) - max(t0, start)) for t0, t1 in self._intervals)

    def pop_kv(self) -> dict[str, float]:
        """Episodes' next turns since the last call: appended to their kept KV in place
        (`kv_extended`) or re-prefilled whole (`kv_reprefilled`: their slot was given up)."""
        with self._lock:
            (extended, reprefilled), self._kv = self._kv, [0, 0]
        return {"kv_extended": float(extended), "kv_reprefilled": float(reprefilled)}

    def pop_span(self, batch: int) -> float:
        """The batch's generation span in seconds (0 if none was seen)."""
        with self._lock:
            first, last = self._spans.pop(batch, [0.0, 0.0])
        return last - first


@dataclasses.dataclass
class StepWork:
    """What one step gathers while it trains."""

    stats: dict[str, list] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    micro: int = 0  # micro-batches accumulated
    applied: int = 0  # of them, those an optimizer step has taken
    device: list[dict[str, jax.Array]] = dataclasses.field(default_factory=list)  # per apply
    busy_s: float = 0.0  # seconds of accumulate compute
    publish_s: float = 0.0  # the trainer thread's seconds publishing the step's weights
    sync_compile_s: float = 0.0  # of them, compiling
    prompt_ids: list[str] = dataclasses.field(default_factory=list)  # trained groups' prompts
    # the learner's targets' per-micro-batch device figures, by target (`Learner.row`)
    totals: dict[str, list] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepClock:
    """A step's clocks at its start; `figures` reads them at its end."""

    perf: float  # time.perf_counter()
    wall: float  # time.time(): chunk reports carry wall times
    cpu: float  # time.process_time()
    compile: float  # the trainer thread's compile seconds
    waits: StreamMetrics  # the sample stream's counters

    @classmethod
    def start(cls, stream_metrics: StreamMetrics) -> StepClock:
        return cls(
            perf=time.perf_counter(),
            wall=time.time(),
            cpu=time.process_time(),
            compile=compile_seconds(this_thread=True),
            waits=dataclasses.replace(stream_metrics),
        )

    def figures(self, stream_metrics: StreamMetrics) -> dict[str, float]:
        """The step's time figures so far."""
        m = stream_metrics
        return {
            "step_s": max(time.perf_counter() - self.perf, 1e-9),
            # CPU seconds of this process (every thread: trainer, scoring, ingest, weight
            # sync) within the step: a process pinned to one core cannot do a step's
            # work faster (tools/bench_pipeline.py --processes).
            "process_cpu_s": time.process_time() - self.cpu,
            # The trainer's own tracing and compiling within the step (new micro-batch
            # shapes): not steady state (tools/bench_pipeline.py).
            "compile_s": compile_seconds(this_thread=True) - self.compile,
            # Trainer blocked waiting for complete groups / reward threads blocked on
            # back-pressure, seconds within this step.
            "stream_wait_s": m.consumer_wait_s - self.waits.consumer_wait_s,
            "stream_backpressure_s": m.producer_wait_s - self.waits.producer_wait_s,
        }


def step_breakdown(
    times: dict[str, float], train_s: float, sync_s: float, gen_busy: float
) -> dict[str, float]:
    """Where a step's wall time went, on the trainer's side (`time/*`, summing to
    `step_s`): training compute (`train_s`, the micro-batches' accumulate, less the
    compiles in it), waiting for samples (the stream: generation-bound), publishing the
    weights (`sync_s`: the trainer thread's, less its compiles), compiling (the trainer
    thread's, wherever in the step), and the rest (the optimizer's apply, packing,
    metrics); and beside them the generation's busy seconds in the same window
    (`gen_busy` of it, per instance: they overlap the trainer's when the stages run at
    once)."""
    step, compile_s, wait = times["step_s"], times["compile_s"], times["stream_wait_s"]
    train = max(train_s - compile_s, 0.0)
    parts = {
        "time/train_s": train,
        "time/wait_s": wait,
        "time/sync_s": sync_s,
        "time/compile_s": compile_s,
    }
    parts["time/other_s"] = max(step - sum(parts.values()), 0.0)
    parts["time/generate_s"] = gen_busy * step
    return parts


def sample_stats(
    batch: int, stats: dict[str, list], dropped: int, trainers: TrainerShare
) -> tuple[dict[str, float], int]:
    """The step's sample statistics over every training process's share, and the
    number of samples trained.

    Args:
      batch: the step b (staleness = b - version, averaged).
      stats: per-sample lists (reward, correct, format_ok, length, truncated, versions:
        the oldest token's version, spans).
      dropped: stale samples dropped so far (the version gate's count).
      trainers: the training processes to sum over.
    """
    sums = [float(np.sum(stats[k])) for k in SAMPLE_MEANS.values()]
    sums += [float(np.sum([batch - v for v in stats["versions"]])), float(dropped)]
    sums.append(float(len(stats["reward"])))
    longest = max(stats["length"], default=0)
    lag = max([batch - v for v in stats["versions"]], default=0)
    sums, (longest, lag) = trainers.sum(sums), trainers.max([longest, lag])
    *totals, staleness, dropped_total, n = sums
    mean = lambda x: x / n if n else float("nan")
    out = {k: mean(x) for k, x in zip(SAMPLE_MEANS, totals, strict=True)}
    out |= {
        "response_len_max": float(longest),
        "staleness": mean(staleness),  # = the mean lag: step - oldest token version
        "lag_max": float(lag),
        "dropped_stale": dropped_total,
    }
    return out, int(n)


def fetch(metrics: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Device metrics of a step's optimizer steps, fetched and averaged over them."""
    values = host(metrics)
    out = {k: float(np.mean([m[k] for m in values])) for k in values[0]}
    if "nonfinite" in out:  # updates skipped for NaN/Inf: a count, not a mean
        out["nonfinite"] = float(np.sum([m["nonfinite"] for m in values]))
    return out


class StepMeter:
    """The rows of the trained steps; device metrics written one step late."""

    def __init__(self, writer: MetricsWriter, start: int):
        self.writer, self.start = writer, start
        self.rows: list[dict[str, float]] = []  # per trained step (from `start`)
        self.versions: list[list[int]] = []  # per step, every trained sample's version
        # The last row's device metrics, fetched and the row written at the next `add`
        # or `flush`; None: no row waits ([]: a row without any, e.g. no update).
        self._pending: list[dict[str, jax.Array]] | None = None

    def add(self, row: dict[str, float], versions: list[int], device: list[dict]) -> None:
        """Records a step; its `device` metrics are fetched when the next step is added
        (or at `flush`), after that step's work is dispatched. A step that applied no
        update (nothing accumulated) has none: its row is written all the same."""
        self.flush()
        self.rows.append(row)
        self.versions.append(versions)
        self._pending = device

    def flush(self) -> None:
        """Fetches the pending device metrics and writes the last row."""
        if self._pending is None:
            return
        if self._pending:
            self.rows[-1].update(fetch(self._pending))
        self.writer.write(self.start + len(self.rows) - 1, self.rows[-1])
        self._pending = None

    @property
    def samples(self) -> int:
        return sum(len(v) for v in self.versions)


@dataclasses.dataclass
class RunResult:
    """What a finished run hands back (tests and benchmarks read it)."""

    state: TrainState  # final TrainState (on the training mesh)
    steps: list[dict[str, float]]  # per-step host metrics
    evals: dict[int, dict[str, float]]  # policy version -> eval metrics
    trained_versions: list[list[int]]  # per step, the policy version of every trained sample
    wall_s: float
    samples: int
    start_batch: int = 0  # first batch of this process (> 0 when resumed from a checkpoint)
    stopped: bool = False  # ended early by SIGINT/SIGTERM (after checkpointing)
    checkpoints: list[int] = dataclasses.field(default_factory=list)  # steps saved
    # the final states of the learner's trained targets by checkpoint entry ("critic")
    target_states: dict[str, TrainState] = dataclasses.field(default_factory=dict)
