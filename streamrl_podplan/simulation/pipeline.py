"""The four pipeline modes as schedules over simulated stage times.

Version contract (DESIGN.md section 2): training step b consumes batch b and turns W_b into
W_{b+1}; batch b is generated with W_{g(b)}, g(b) = b except stream_async where
g(b) = max(0, b - staleness). Generation of batch b starts when the previous batch's
generation is done and W_{g(b)} is on the generation stage.

* colocated: all devices generate batch b (generate -> train switch), train it, then
  reshard the weights back (train -> generate switch).
* disaggregated_batch: the trainer waits for the whole batch.
* stream_sync: samples stream to the trainer as they complete; it starts a micro-batch once
  `min_microbatch_tokens` have arrived (or the batch is complete); the new weights are
  transferred after the last micro-batch and the optimizer step.
* stream_async: as stream_sync, but generation runs `staleness` versions behind, so the
  transfer and training overlap generation.

Bubbles are device-seconds in the steady-state window, by cause: *skewness* (an instance
idle while others still generate the same batch), *weight_sync* (waiting on a weight
transfer or a colocated stage switch), *pipeline* (a stage idle waiting on the other).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_podplan.simulation.generation import GenResult, simulate_batch
from streamrl_podplan.simulation.stages import CostSource

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Span:
    """One timed activity, for the trace and the bubble accounting (seconds)."""

    lane: str  # "gen/3", "trainer", "transfer", "switch"
    name: str
    start: float
    dur: float
    batch: int


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated mode.

    Attributes:
      mode: the simulated mode.
      samples_per_s: steady-state throughput (samples per second of wall time).
      iteration_s: mean steady-state seconds per training step.
      gen_devices: devices generating (all of them when colocated).
      train_devices: devices training (all of them when colocated).
      n_instances: generation instances.
      busy: {"generation", "training"} -> busy share of that stage's device-time.
      bubbles: {"pipeline", "skewness", "weight_sync"} -> share of all device-time.
      spans: trainer / transfer / switch spans, and one span per instance per batch.
      batches: per batch, (generation start, GenResult) for per-sample trace events.
    """

    mode: str
    samples_per_s: float
    iteration_s: float
    gen_devices: int
    train_devices: int
    n_instances: int
    busy: dict[str, float]
    bubbles: dict[str, float]
    spans: list[Span]
    batches: list[tuple[float, GenResult]]


def _train_microbatches(
    arrival: np.ndarray, cost: np.ndarray, tokens: np.ndarray, free_at: float, min_tokens: int
) -> list[Interval]:
    """Runs the trainer over samples in arrival order; returns micro-batch intervals."""
    order = np.argsort(arrival, kind="stable")
    arrival, cost, tokens = arrival[order], cost[order], tokens[order]
    cum_tokens = np.cumsum(tokens)
    out, i, n, t = [], 0, len(arrival), free_at
    while i < n:
        # Earliest index j whose arrival brings min_tokens since i (or the last sample).
        base = cum_tokens[i - 1] if i else 0
        j = int(np.searchsorted(cum_tokens, base + min_tokens, side="left"))
        j = min(max(j, i), n - 1)
        start = max(t, float(arrival[j]))
        # Everything that has arrived by `start` joins this micro-batch.
        k = max(j + 1, int(np.searchsorted(arrival, start, side="right")))
        t = start + float(cost[i:k].sum())
        out.append((start, t))
        i = k
    return out


def run_schedule(
    *,
    mode: str,
    costs: CostSource,
    batches: list[tuple[np.ndarray, np.ndarray]],
    plans: list[list[list[int]]],
    gen_devices: int,
    train_devices: int,
    tp: int,
    staleness: int = 1,
    warmup: int = 1,
    gen_lengths: list[np.ndarray] | None = None,
) -> SimResult:
    """Schedules `batches` (prompt, response lengths) under `mode` with given dispatch plans.

    `gen_lengths` (per batch) overrides the decode steps each sample occupies its
    slot for, when that differs from its trained response length (an engine that
    admits and retires only at chunk boundaries holds a slot to the chunk's end).
    """
    spec = costs.instance()
    colocated = mode == "colocated"
    sync_s = 0.0 if colocated else costs.weight_sync_seconds(train_devices)
    to_train, to_gen = costs.switch_seconds() if colocated else (0.0, 0.0)
    opt_s = costs.optimizer_seconds(train_devices)
    min_tokens = costs.min_microbatch_tokens(train_devices)
    n_b = len(batches)
    gen_start, gen_end, train_end, sync_end = (np.zeros(n_b) for _ in range(4))
    spans: list[Span] = []
    gens: list[tuple[float, GenResult]] = []
    for b, ((prompt, resp), plan) in enumerate(zip(batches, plans, strict=True)):
        gr = simulate_batch(spec, plan, prompt, resp if gen_lengths is None else gen_lengths[b])
        if colocated:
            gen_start[b] = train_end[b - 1] + to_gen if b else 0.0
        else:
            version = max(0, b - staleness) if mode == "stream_async" else b
            ready = sync_end[version - 1] if version else 0.0
            gen_start[b] = max(gen_end[b - 1] if b else 0.0, ready)
        gen_end[b] = gen_start[b] + gr.makespan
        gens.append((gen_start[b], gr))
        for k, end in enumerate(gr.instance_end):
            spans.append(Span(f"gen/{k}", f"generate b{b}", gen_start[b], end, b))
        tokens = (prompt + resp).astype(np.float64)
        cost = costs.train_seconds(prompt, resp, train_devices)
        if mode.startswith("stream"):
            arrival = gen_start[b] + gr.done
            free = train_end[b - 1] if b else 0.0
            mbs = _train_microbatches(arrival, cost, tokens, free, min_tokens)
        else:
            start = gen_end[b] + to_train
            if not colocated:
                start = max(start, train_end[b - 1] if b else 0.0)
            else:
                spans.append(Span("switch", "gen->train", gen_end[b], to_train, b))
            mbs = [(start, start + float(cost.sum()))]
        for s, e in mbs:
            spans.append(Span("trainer", f"train b{b}", s, e - s, b))
        train_end[b] = mbs[-1][1] + opt_s
        spans.append(Span("trainer", f"optimizer b{b}", mbs[-1][1], opt_s, b))
        if colocated:
            spans.append(Span("switch", "train->gen", train_end[b], to_gen, b))
        else:
            sync_end[b] = train_end[b] + sync_s
            spans.append(Span("transfer", f"W{b + 1} -> gen", train_end[b], sync_s, b))
    t0 = train_end[warmup - 1] if warmup else 0.0
    t1 = train_end[-1]
    iteration_s = (t1 - t0) / (n_b - warmup)
    samples = sum(len(r) for _, r in batches[warmup:])
    busy, bubbles = _account(
        mode, spans, gens, gen_start, gen_end, tp, gen_devices, train_devices, (t0, t1)
    )
    return SimResult(
        mode=mode,
        samples_per_s=samples / (t1 - t0),
        iteration_s=float(iteration_s),
        gen_devices=gen_devices,
        train_devices=train_devices,
        n_instances=gen_devices // tp,
        busy=busy,
        bubbles=bubbles,
        spans=spans,
        batches=gens,
    )


def _length(iv: list[Interval], window: Interval) -> float:
    lo, hi = window
    return float(sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in iv))


def _overlap(a: list[Interval], b: list[Interval], window: Interval) -> float:
    """Length of (union of a) ∩ (union of b) inside the window; a and b each disjoint."""
    return float(sum(_length([(max(s1, s2), min(e1, e2))], window) for s1, e1 in a for s2, e2 in b))


def _complement(iv: list[Interval], window: Interval) -> list[Interval]:
    out, t = [], window[0]
    for s, e in sorted(iv):
        if s > t:
            out.append((t, min(s, window[1])))
        t = max(t, e)
    if t < window[1]:
        out.append((t, window[1]))
    return [(s, e) for s, e in out if e > s]


def _account(mode, spans, gens, gen_start, gen_end, tp, gen_devices, train_devices, window):
    """Busy shares per stage and bubble shares by cause (see the module docstring)."""
    wall = window[1] - window[0]
    colocated = mode == "colocated"
    total = wall * (gen_devices if colocated else gen_devices + train_devices)
    waits = [(s.start, s.start + s.dur) for s in spans if s.lane in ("transfer", "switch")]
    train_busy = [(s.start, s.start + s.dur) for s in spans if s.lane == "trainer"]
    gen_busy_t = skew_t = gen_idle_sync = gen_idle_pipe = 0.0
    n_inst = gen_devices // tp
    for k in range(n_inst):
        busy = [(g0, g0 + gr.instance_end[k]) for g0, gr in gens]
        skew = [(g0 + gr.instance_end[k], g1) for (g0, gr), g1 in zip(gens, gen_end, strict=True)]
        gen_busy_t += tp * _length(busy, window)
        skew_t += tp * _length(skew, window)
        if not colocated:
            idle = _complement(busy + skew, window)
            w = _overlap(idle, waits, window)
            gen_idle_sync += tp * w
            gen_idle_pipe += tp * (_length(idle, window) - w)
    train_b = _length(train_busy, window)
    if colocated:
        switch = _length([(s.start, s.start + s.dur) for s in spans if s.lane == "switch"], window)
        bubbles = {"pipeline": 0.0, "skewness": skew_t, "weight_sync": gen_devices * switch}
        busy = {"generation": gen_busy_t / total, "training": train_b * gen_devices / total}
    else:
        idle = _complement(train_busy, window)
        w = _overlap(idle, waits, window) if mode != "stream_async" else 0.0
        bubbles = {
            "pipeline": gen_idle_pipe + train_devices * (_length(idle, window) - w),
            "skewness": skew_t,
            "weight_sync": gen_idle_sync + train_devices * w,
        }
        busy = {
            "generation": gen_busy_t / (gen_devices * wall),
            "training": train_b / wall,
        }
    return busy, {k: v / total for k, v in bubbles.items()}
