"""Tests for simulation/trace.py: Chrome trace format, same conventions as metrics.Tracer."""

import numpy as np

from streamrl_jax.metrics import read_trace
from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import hardware, simulator, trace
from streamrl_podplan.simulation.scenario import Scenario


def _result(mode="stream_sync"):
    sc = Scenario(
        mode=mode,
        model=hardware.get_model("smollm2-360m"),
        hw=hardware.get_hardware("h100"),
        devices=4,
        trace=lengths.paper_trace(2_000),
        global_batch=32,
        iterations=3,
        warmup=1,
        split_granularity=1,
    )
    return simulator.simulate(sc)


def test_the_pipelines_trace_reader_reads_it(tmp_path):
    # `metrics.read_trace` refuses a span whose process or thread has no name event.
    res = _result()
    path = tmp_path / "t" / "trace.json"
    trace.save(res, str(path), per_sample=True)
    spans = read_trace(str(path))
    assert spans and all(s.dur >= 0 and s.start >= 0 for s in spans)
    assert {"generation", "trainer", "weight_sync"} <= {s.group for s in spans}
    # One span per sample per batch on the slot lanes.
    n_samples = sum(len(gr.done) for _, gr in res.batches)
    assert sum(s.name.startswith("sample ") for s in spans) == n_samples
    assert sum(s.track.startswith("generation/") for s in spans) == sum(
        s.lane.startswith("gen/") for s in res.spans
    )


def test_trace_spans_match_result_in_microseconds():
    res = _result("colocated")
    xs = [e for e in trace.to_chrome_trace(res)["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.spans)
    end = max(e["ts"] + e["dur"] for e in xs)
    assert np.isclose(end, max(s.start + s.dur for s in res.spans) * 1e6)


def test_slots_never_overlap():
    admit = np.array([0.0, 0.0, 1.0, 2.0])
    done = np.array([1.0, 3.0, 2.0, 4.0])
    slots = trace._slots(admit, done, [0, 1, 2, 3])
    assert len(set(slots.values())) == 2
    for s in set(slots.values()):
        iv = sorted((admit[i], done[i]) for i in slots if slots[i] == s)
        assert all(a[1] <= b[0] for a, b in zip(iv, iv[1:], strict=False))
