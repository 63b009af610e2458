"""Chrome / Perfetto trace of a simulated run, in the real pipeline's trace format.

`streamrl_jax.metrics.Tracer` writes tracks named "group/name": the group becomes the
process (pid, with a "process_name" metadata event) and the name its thread (tid, with a
"thread_name" event); spans are "X" complete events with ts and dur in microseconds. The
simulator uses the same convention and the same group names, so a simulated and a
measured trace open side by side in ui.perfetto.dev:

* generation/instance k   one span per instance per batch ("generate b3")
* trainer/micro-batch     streamed micro-batches and the optimizer step
* weight_sync/transfer    trainer -> generation weight pushes
* colocated/switch        colocated stage switches
* instance k/slot j       (optional, per_sample=True) one span per sample, per KV slot

This module is pure JSON building; it does not import the device-side metrics module,
whose `read_trace` reads either trace back (tests/simulation_trace_test.py).
"""

from __future__ import annotations

import heapq
import json
import os
from typing import Any

from streamrl_podplan.simulation.pipeline import SimResult

_LANE_TRACK = {
    "trainer": "trainer/micro-batch",
    "transfer": "weight_sync/transfer",
    "switch": "colocated/switch",
}


class _Builder:
    def __init__(self):
        self.events: list[dict[str, Any]] = []
        self.ids: dict[str, tuple[int, int]] = {}
        self.pids: dict[str, int] = {}

    def track(self, track: str) -> tuple[int, int]:
        if track in self.ids:
            return self.ids[track]
        group, _, name = track.partition("/")
        if group not in self.pids:
            self.pids[group] = len(self.pids) + 1
            self.events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": self.pids[group],
                    "args": {"name": group},
                }
            )
        pid = self.pids[group]
        tid = 1 + sum(1 for t in self.ids if t.partition("/")[0] == group)
        self.ids[track] = (pid, tid)
        self.events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        return pid, tid

    def add(self, track: str, name: str, start_s: float, dur_s: float, **args: Any) -> None:
        pid, tid = self.track(track)
        self.events.append(
            {
                "ph": "X",
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": start_s * 1e6,
                "dur": max(dur_s, 0.0) * 1e6,
                "args": args,
            }
        )


def _slots(admit, done, members):
    """Assigns each sample of one instance to a KV slot (interval colouring by admit time)."""
    free: list[int] = []
    busy: list[tuple[float, int]] = []
    out, n_slots = {}, 0
    for i in sorted(members, key=lambda i: (admit[i], i)):
        while busy and busy[0][0] <= admit[i]:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, n_slots = n_slots, n_slots + 1
        out[i] = slot
        heapq.heappush(busy, (done[i], slot))
    return out


def to_chrome_trace(result: SimResult, *, per_sample: bool = False) -> dict[str, Any]:
    """The run as {"traceEvents": [...], "displayTimeUnit": "ms"}."""
    b = _Builder()
    for span in result.spans:
        if span.lane.startswith("gen/"):
            k = int(span.lane.split("/")[1])
            b.add(f"generation/instance {k}", span.name, span.start, span.dur, batch=span.batch)
        else:
            b.add(_LANE_TRACK[span.lane], span.name, span.start, span.dur, batch=span.batch)
    if per_sample:
        for batch, (g0, gr) in enumerate(result.batches):
            for k in range(len(gr.instance_end)):
                members = [i for i in range(len(gr.done)) if gr.instance[i] == k]
                slots = _slots(gr.admit, gr.done, members)
                for i in members:
                    b.add(
                        f"instance {k}/slot {slots[i]}",
                        f"sample {i}",
                        g0 + gr.admit[i],
                        gr.done[i] - gr.admit[i],
                        batch=batch,
                    )
    return {"traceEvents": b.events, "displayTimeUnit": "ms"}


def save(result: SimResult, path: str, *, per_sample: bool = False) -> None:
    """Writes the trace JSON to `path` (directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(result, per_sample=per_sample), f)
