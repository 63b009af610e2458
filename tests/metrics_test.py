"""Metrics writer, the trace (recorder and reader) and the progress line."""

import io
import time

import pytest

from streamrl_jax.metrics import MetricsWriter, Progress, Tracer, read_jsonl, read_trace

ROW = {"reward": 0.5, "accuracy": 0.25, "samples_per_s": 2.0, "step_s": 4.0, "loss": 0.1}


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
    from streamrl_jax.generation.types import ChunkReport
    from streamrl_jax.pipeline.step_metrics import GenerationMeter

    meter = GenerationMeter(Tracer(enabled=False), tick=lambda name: None)
    chunk = lambda i, t0, t1: ChunkReport(instance=str(i), t0=t0, t1=t1, tokens=1, running=1)
    meter.chunk(chunk(0, 0.0, 10.0))  # e.g. a chunk that compiled a shape
    meter.chunk(chunk(1, 9.0, 11.0))
    meter.chunk(chunk(0, 12.0, 13.0))
    # window [8, 12.5]: 2 s of the first chunk, all 2 of the second, 0.5 of the third
    assert meter.busy_between(8.0, 12.5) == 4.5
    assert meter.busy_between(11.5, 20.0) == 1.0  # older chunks dropped, not counted


def test_progress_off_a_terminal_is_one_line_per_step():
    out = io.StringIO()
    progress = Progress(3, stream=out)
    progress.update(1, ROW)
    progress.update(2, ROW | {"reward": -0.125}, {"step": 0, "accuracy": 0.125})
    progress.close()
    first, second = out.getvalue().splitlines()
    assert first.startswith("step 1/3  reward 0.500  acc 0.250  2.00 samples/s  4.0 s/step  [")
    assert "eval" not in first and "loss" not in first
    assert second.startswith("step 2/3  reward -0.125") and "eval acc 0.125 (step 0)" in second
    # a multi-agent run: each role's return, by name
    from streamrl_jax.metrics import progress_figures

    roles = ROW | {"role/verifier/return": 0.75, "role/solver/return": 0.5, "role/solver/turns": 2}
    line = progress_figures(roles, None)
    assert "acc 0.250  solver 0.500  verifier 0.750  2.00 samples/s" in line
    quiet = io.StringIO()
    Progress(3, enabled=False, stream=quiet).update(1, ROW)
    assert quiet.getvalue() == ""


def test_progress_on_a_terminal_redraws_one_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    progress = Progress(4, initial=1, stream=out)  # resumed at step 1
    progress.update(2, ROW, {"step": 0, "accuracy": 0.75})
    progress.close()
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("step 2/4 ") and "acc 0.250" in last and "eval acc 0.750" in last
    assert "\n" not in out.getvalue().rstrip("\n")  # redrawn in place, never a new line


def test_every_step_has_a_row_with_or_without_an_update(tmp_path):
    # A step that applied no update (dynamic sampling skipped every group, a partial
    # rollout round completed none) has no device metrics; its row is written anyway.
    import jax.numpy as jnp

    from streamrl_jax.pipeline.step_metrics import StepMeter

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    meter = StepMeter(writer, start=3)
    meter.add({"reward": 0.5}, [2], [{"loss": jnp.float32(1.0)}])
    meter.add({"reward": 0.0}, [], [])  # no update
    meter.add({"reward": 0.25}, [4], [{"loss": jnp.float32(2.0)}])
    meter.flush()
    writer.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [3, 4, 5]
    assert [r.get("loss") for r in rows] == [1.0, None, 2.0]
