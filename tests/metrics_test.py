"""Metrics writer, and the trace: recorder and reader."""

import time

import pytest

from streamrl_jax.metrics import MetricsWriter, Tracer, read_jsonl, read_trace


def test_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=True)
    w.write(1, {"reward": 0.5, "note": "text is skipped", "acc": 1})
    w.write(2, {"reward": 0.75}, prefix="eval/")
    w.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward"] == 0.5 and rows[0]["acc"] == 1.0 and "note" not in rows[0]
    assert rows[1]["eval/reward"] == 0.75
    assert list((tmp_path / "tensorboard").iterdir())


def test_trace_round_trips_through_the_chrome_format(tmp_path):
    t = Tracer()
    t0 = t.now()
    t.add("generation/instance 0", "decode", t0, t0 + 0.01, tokens=5)
    t.add("generation/instance 1", "decode", t.now(), t.now() + 0.01)
    with t.span("trainer/micro-batch", "accumulate"):
        pass
    t.add("reward", "score", t.now(), t.now())  # a track without a group/name split
    t.add_wall("generation/instance 0", "chunk", time.time() - 0.5, time.time() - 0.25)
    t.save(str(tmp_path / "trace.json"))
    spans = read_trace(str(tmp_path / "trace.json"))  # a group is a process, a track its thread
    wall = spans.pop()
    assert 0.2 < wall.dur < 0.3 and wall.start < spans[0].start  # converted to the perf clock
    assert [s.track for s in spans] == [
        "generation/instance 0",
        "generation/instance 1",
        "trainer/micro-batch",
        "reward",
    ]
    assert [s.group for s in spans] == ["generation", "generation", "trainer", "reward"]
    assert spans[0].name == "decode" and spans[0].args == {"tokens": 5}
    assert spans[0].dur == pytest.approx(0.01) and spans[0].end == spans[0].start + spans[0].dur
    assert all(s.dur >= 0 for s in spans)


@pytest.mark.parametrize(
    "text, error",
    [
        ("{", "not a JSON trace file"),
        ('{"events": []}', "no 'traceEvents' list"),
        ('{"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 1}]}',
         "span 'a' is on a track without a name"),
        ('{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}]}',
         "a malformed trace event"),
    ],
)  # fmt: skip
def test_read_trace_names_the_file_and_the_fault(tmp_path, text, error):
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: {error}"):
        read_trace(str(path))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_trace(str(tmp_path / "missing.json"))


def test_generation_busy_counts_only_the_window():
    from streamrl_jax.pipeline.step_metrics import GenerationMeter

    meter = GenerationMeter(Tracer(enabled=False), tick=lambda name: None)
    meter.chunk(0, 0.0, 10.0, tokens=1, running=1)  # e.g. a chunk that compiled a shape
    meter.chunk(1, 9.0, 11.0, tokens=1, running=1)
    meter.chunk(0, 12.0, 13.0, tokens=1, running=1)
    # window [8, 12.5]: 2 s of the first chunk, all 2 of the second, 0.5 of the third
    assert meter.busy_between(8.0, 12.5) == 4.5
    assert meter.busy_between(11.5, 20.0) == 1.0  # older chunks dropped, not counted
