"""The in-flight mode as a schedule: stream_async with in-flight weight updates and
partial rollout (docs/pipeline.md), over simulated stage times.

Round r (the generation behind training step r) holds batch r's new samples and the
continuations of the samples paused in round r - 1; every segment is at most
`budget` tokens. Round r is released when W_{g(r)} (g(r) = r - s) is on the
generation side, i.e. at the end of the weight transfer after step g(r) - 1, and,
unlike the four modes, without waiting for earlier rounds to drain: an instance
admits released segments into free slots at every chunk boundary (the engine's
continuous batching across versions). A continuation is admitted with a prefill of
prompt + its response so far (the engine re-prefills). Round r closes when all its
segments and round r - 1 are done; step r then trains the groups whose last member
finished in round r (the trainer waits for the closure, as `GroupTaker` does), one
optimizer step if any, and the transfer of W_{r+1} follows.

Each instance is simulated chunk by chunk (`chunk` decode steps per host round
trip, admissions and retirements only at chunk boundaries, prefills serialised
before the chunk), with the same decode and prefill cost model as the other modes.
Groups: `group_size` consecutive samples of a batch (1 for independent samples).
Busy: the generation instances' share of the run's wall time spent in prefills and
chunks (over the whole run, not the steady-state window); bubbles: only that idle
share is reported (`pipeline`), the other causes are not separated here.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from streamrl_podplan.simulation.generation import InstanceSpec
from streamrl_podplan.simulation.pipeline import SimResult
from streamrl_podplan.simulation.stages import CostSource


@dataclasses.dataclass
class _Segment:
    sample: int
    start: int  # response tokens the sample already has
    end: int  # response tokens after this segment
    release: float
    round: int


class _Instance:
    """One engine: slots, a queue of released segments, a clock."""

    def __init__(self, spec: InstanceSpec, chunk: int, prompt: np.ndarray):
        self.spec, self.chunk, self.prompt = spec, chunk, prompt
        self.t = 0.0
        self.queue: list[_Segment] = []
        self.running: list[list] = []  # [segment, tokens generated in it]
        self.busy_s = 0.0  # prefills and chunks

    def outstanding(self, r: int) -> bool:
        return any(s.round <= r for s in self.queue) or any(x[0].round <= r for x in self.running)

    def chunk_step(self, done: list[tuple[_Segment, float]]) -> None:
        """Admit released segments, run one chunk, retire the segments that ended."""
        free = self.spec.slots - len(self.running)
        ready = sorted((s for s in self.queue if s.release <= self.t), key=lambda s: s.release)
        t0 = self.t
        for s in ready[:free]:
            self.queue.remove(s)
            self.t += self.spec.cost.prefill_time(float(self.prompt[s.sample] + s.start))
            self.running.append([s, 0])
        if not self.running:
            self.t = max(self.t, min(s.release for s in self.queue))
            return
        steps = min(self.chunk, max(x[0].end - x[0].start - x[1] for x in self.running))
        ctx = sum(float(self.prompt[x[0].sample] + x[0].start + x[1]) for x in self.running)
        dt = self.spec.cost.segment_time(len(self.running), ctx, steps)
        self.t += dt
        self.busy_s += self.t - t0
        still = []
        for x in self.running:
            x[1] += steps
            if x[1] >= x[0].end - x[0].start:
                done.append((x[0], self.t))
            else:
                still.append(x)
        self.running = still


def run_inflight(
    *,
    costs: CostSource,
    batches: list[tuple[np.ndarray, np.ndarray]],
    gen_devices: int,
    train_devices: int,
    tp: int,
    budget: int,
    staleness: int = 1,
    warmup: int = 1,
    group_size: int = 1,
    chunk: int = 1,
) -> SimResult:
    """Schedules `batches` (prompt, response lengths) in the in-flight mode."""
    if budget < 1 or chunk < 1 or group_size < 1:
        raise ValueError(f"run_inflight: budget {budget}, chunk {chunk}, group_size {group_size}")
    spec = costs.instance()
    prompt = np.concatenate([p for p, _ in batches]).astype(np.int64)
    resp = np.concatenate([r for _, r in batches]).astype(np.int64)
    first = np.cumsum([0] + [len(r) for _, r in batches])
    n_b, n_inst = len(batches), max(1, gen_devices // tp)
    insts = [_Instance(spec, chunk, prompt) for _ in range(n_inst)]
    sync_s, opt_s = costs.weight_sync_seconds(train_devices), costs.optimizer_seconds(train_devices)
    train_end, sync_end, closed = np.zeros(n_b), np.zeros(n_b), np.zeros(n_b)
    release = {}  # round -> time W_{g(round)} is on the generation side
    held: dict[int, list[tuple[int, int, float]]] = collections.defaultdict(list)
    members: dict[int, int] = collections.defaultdict(int)  # group -> members finished
    completed: dict[int, list[int]] = collections.defaultdict(list)  # round -> groups
    finish = np.zeros(len(resp))
    last: dict[int, float] = collections.defaultdict(float)  # round -> its last segment's end
    rr = [0]

    def ready_at(r: int) -> float | None:
        v = r - staleness  # g(r); W_v lands at sync_end[v - 1]
        if v < 1:
            return 0.0
        return float(sync_end[v - 1]) if v - 1 < done_steps[0] else None

    def enqueue(r: int, i: int, k0: int, t: float) -> None:
        seg = _Segment(i, k0, min(k0 + budget, int(resp[i])), max(release[r], t), r)
        insts[rr[0] % n_inst].queue.append(seg)
        rr[0] += 1

    def open_rounds(upto: int) -> None:
        for r in range(upto + 1):
            if r in release or r >= n_b:
                continue
            t = ready_at(r)
            if t is None:
                return
            release[r] = t
            for i in range(first[r], first[r + 1]):
                enqueue(r, i, 0, t)
            for i, k0, t_pause in held.pop(r, []):
                enqueue(r, i, k0, t_pause)

    done_steps = [0]
    for r in range(n_b):
        open_rounds(r + staleness)
        if r not in release:
            raise RuntimeError(f"run_inflight: round {r} never released")
        for inst in insts:
            while inst.outstanding(r):
                ended: list[tuple[_Segment, float]] = []
                inst.chunk_step(ended)
                for seg, t in ended:
                    last[seg.round] = max(last[seg.round], t)
                    if seg.end < resp[seg.sample]:  # paused: continues next round
                        nxt = seg.round + 1
                        if nxt in release:
                            enqueue(nxt, seg.sample, seg.end, t)
                        elif nxt < n_b:
                            held[nxt].append((seg.sample, seg.end, t))
                        continue
                    finish[seg.sample] = t
                    g = seg.sample // group_size
                    members[g] += 1
                    if members[g] == min(group_size, len(resp) - g * group_size):
                        completed[seg.round].append(g)
        closed[r] = max(closed[r - 1] if r else 0.0, last[r])
        free = train_end[r - 1] if r else 0.0
        start = max(free, closed[r])
        ids = _samples(completed[r], group_size, len(resp))
        if ids:
            cost = costs.train_seconds(prompt[ids], resp[ids], train_devices)
            train_end[r] = start + float(np.sum(cost)) + opt_s
        else:
            train_end[r] = start
        sync_end[r] = train_end[r] + sync_s
        done_steps[0] = r + 1
    t0 = train_end[warmup - 1] if warmup else 0.0
    t1 = train_end[-1]
    trained = sum(len(_samples(completed[r], group_size, len(resp))) for r in range(warmup, n_b))
    wall = max(t1 - t0, 1e-12)
    gen_busy = sum(x.busy_s for x in insts) / (n_inst * max(t1, 1e-12))
    return SimResult(
        mode="inflight",
        samples_per_s=trained / wall,
        iteration_s=wall / max(n_b - warmup, 1),
        gen_devices=gen_devices,
        train_devices=train_devices,
        n_instances=n_inst,
        busy={"generation": gen_busy, "training": float("nan")},
        bubbles={"pipeline": 1.0 - gen_busy, "skewness": 0.0, "weight_sync": 0.0},
        spans=[],
        batches=[],
    )


def _samples(groups: list[int], group_size: int, n: int) -> list[int]:
    return [i for g in groups for i in range(g * group_size, min((g + 1) * group_size, n))]
