"""What a user sees of a run: JSONL + TensorBoard scalars, a progress bar, a pipeline trace.

* `MetricsWriter`: one JSON object per line in `metrics.jsonl` (step, wall
  time, every scalar) and the same scalars to TensorBoard; only process 0
  writes.
* `Tracer`: spans per track (generation instance, reward, trainer
  micro-batch, optimizer step, weight sync) written as a Chrome / Perfetto
  trace (`trace.json`, open in ui.perfetto.dev or chrome://tracing), so the
  overlap of stages and the bubbles between them can be seen. The simulator
  writes the same format. `read_trace` reads such a file back as `Span`s: the
  one reader for tools and tests.
* `Progress`: the progress line: step/total, reward, accuracy, samples/s, step
  time and the last held-out accuracy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import jax
from tqdm import tqdm

_WRITER_PROCESS = 0  # the process that writes metrics, the trace and the progress bar


def set_writer_process(process_index: int) -> None:
    """Several processes: the training process writes, whatever its index
    (pipeline/processes/)."""
    global _WRITER_PROCESS
    _WRITER_PROCESS = process_index


def _is_writer() -> bool:
    return jax.process_index() == _WRITER_PROCESS


def _scalar(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else out  # NaN/Inf are written; they are findings


def _summary_writer() -> type:
    """tensorboardX's `SummaryWriter`, imported without torch: tensorboardX imports torch
    where it is installed (the test extra installs it) only to take torch tensors, 1.6 s
    of every run's start-up; this writer hands it Python floats. During that one import
    (the process's first writer, ~0.3 s) `import torch` fails in this process; the
    pipeline's own threads import no torch."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails
        try:
            import tensorboardX  # noqa: F401
        finally:
            if sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter


class MetricsWriter:
    """Appends scalar dicts to `<workdir>/metrics.jsonl` and TensorBoard."""

    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self.workdir = workdir
        self.enabled = _is_writer()
        self._lock = threading.Lock()
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._file = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            self._tb = _summary_writer()(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, scalars: Mapping[str, Any], *, prefix: str = "") -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in scalars.items():
            v = _scalar(value)
            if v is not None:
                row[prefix + key] = v
        with self._lock:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            if self._tb is not None:
                for key, v in row.items():
                    if key not in ("step", "time"):
                        self._tb.add_scalar(key, v, step)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None


_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile: dict[Any, float] = {}  # thread id (and None: every thread) -> seconds
_compile_lock = threading.Lock()
_compile_registered = [False]


def compile_seconds(this_thread: bool = False) -> float:
    """Seconds this process has spent tracing, lowering and compiling jitted functions
    since the first call (JAX's monitoring events), on every thread or only on the
    calling one. The trainer loop's step difference on its own thread is the step's
    `compile_s`: mid-run compilations of new shapes are not steady state."""
    with _compile_lock:
        if not _compile_registered[0]:

            def listener(event: str, duration: float, **kwargs: Any) -> None:
                if event in _COMPILE_EVENTS:
                    with _compile_lock:
                        for key in (None, threading.get_ident()):
                            _compile[key] = _compile.get(key, 0.0) + duration

            jax.monitoring.register_event_duration_secs_listener(listener)
            _compile_registered[0] = True
        return _compile.get(threading.get_ident() if this_thread else None, 0.0)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Tracer:
    """Thread-safe recorder of timeline spans, written as Chrome trace JSON.

    A track is "group/name" (e.g. "generation/instance 0", "trainer/micro-batch");
    the group becomes the trace's process and the name its thread.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._wall_minus_perf = time.time() - self._t0
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._ids: dict[str, tuple[int, int]] = {}

    def now(self) -> float:
        return time.perf_counter()

    def _track(self, track: str) -> tuple[int, int]:
        group, _, name = track.partition("/")
        if track not in self._ids:
            pids = {t.partition("/")[0]: pid for t, (pid, _) in self._ids.items()}
            pid = pids.get(group, len(pids) + 1)
            tid = 1 + sum(1 for t in self._ids if t.partition("/")[0] == group)
            self._ids[track] = (pid, tid)
            if group not in pids:
                self._events.append(
                    {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": group}}
                )
            self._events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
        return self._ids[track]

    def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """Records a span given `perf_counter` start and end times."""
        if not self.enabled:
            return
        with self._lock:
            pid, tid = self._track(track)
            self._events.append(
                {
                    "ph": "X",
                    "name": name,
                    "pid": pid,
                    "tid": tid,
                    "ts": (start - self._t0) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6,
                    "args": args,
                }
            )

    def add_wall(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """Records a span given `time.time()` start and end times."""
        off = self._wall_minus_perf
        self.add(track, name, start - off, end - off, **args)

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(track, name, start, time.perf_counter(), **args)

    def save(self, path: str) -> None:
        if not self.enabled or not _is_writer():
            return
        with self._lock:
            data = {"traceEvents": list(self._events), "displayTimeUnit": "ms"}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)


@dataclasses.dataclass(frozen=True)
class Span:
    """One span of a trace file (`Tracer.save`'s, or the simulator's: the same format).

    Attributes:
      track: "group/name" as recorded, e.g. "generation/instance 0".
      name: what the span was, e.g. "accumulate", "step 3".
      start: seconds from the trace's origin.
      dur: seconds.
      args: the span's recorded arguments, e.g. {"tokens": 5}.
    """

    track: str
    name: str
    start: float
    dur: float
    args: dict[str, Any]

    @property
    def group(self) -> str:
        """The track's group ("generation", "trainer", "weight_sync", ...)."""
        return self.track.partition("/")[0]

    @property
    def end(self) -> float:
        return self.start + self.dur


def read_trace(path: str) -> list[Span]:
    """The spans of a Chrome trace written by `Tracer.save`, in the order recorded.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not such a trace (names the file and what is wrong).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON trace file ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: no 'traceEvents' list (not a Chrome trace file)")
    try:
        meta = [e for e in events if e.get("ph") == "M"]
        groups = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
        threads = {
            (e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"
        }
        spans = []
        for e in (e for e in events if e.get("ph") == "X"):
            key = (e["pid"], e["tid"])
            if e["pid"] not in groups or key not in threads:
                raise ValueError(
                    f"{path}: span {e['name']!r} is on a track without a name "
                    f"(pid {e['pid']}, tid {e['tid']})"
                )
            thread = threads[key]
            track = f"{groups[e['pid']]}/{thread}" if thread else groups[e["pid"]]
            start, dur = e["ts"] / 1e6, e["dur"] / 1e6
            spans.append(Span(track, e["name"], start, dur, dict(e.get("args", {}))))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: a malformed trace event ({type(e).__name__}: {e})") from None
    return spans


def progress_figures(row: Mapping[str, float], last_eval: Mapping[str, float] | None) -> str:
    """A step's key figures in words: reward, accuracy, each agent's return (a multi-agent
    run), samples/s, step time, and the last held-out accuracy when there is one
    (`last_eval`: its `step` and `accuracy`)."""
    out = []
    if "reward" in row:
        out.append(f"reward {row['reward']:.3f}")
    if "accuracy" in row:
        out.append(f"acc {row['accuracy']:.3f}")
    # a multi-agent run: each role's return (pipeline/rollouts/multi_agent.py)
    for key in sorted(k for k in row if k.startswith("role/") and k.endswith("/return")):
        out.append(f"{key.split('/')[1]} {row[key]:.3f}")
    if "samples_per_s" in row:
        out.append(f"{row['samples_per_s']:.2f} samples/s")
    if "step_s" in row:
        out.append(f"{row['step_s']:.1f} s/step")
    if last_eval and "accuracy" in last_eval:
        out.append(f"eval acc {last_eval['accuracy']:.3f} (step {int(last_eval['step'])})")
    return "  ".join(out)


def _terminal(stream: TextIO) -> bool:
    """A terminal with a width, where a bar redrawn in place shows (a pseudo-terminal of
    zero columns, as `script` or some CI runners open, shows an empty bar)."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError):  # no file descriptor: believe isatty
        return True


class Progress:
    """The run's progress line, on the writer process only: step/total and the step's
    key figures (`progress_figures`). On a terminal, one line redrawn in place (a tqdm
    bar); otherwise (a pipe, a file, `launch/local.py`'s children) one line per step."""

    def __init__(
        self, total: int, *, enabled: bool = True, initial: int = 0, stream: TextIO | None = None
    ):
        """Args:
        total: the run's last step.
        enabled: False: nothing is shown (`log.progress`).
        initial: the step the run starts at (a resumed run's checkpoint step).
        stream: where the line goes (default standard error).
        """
        self.total = total
        self._stream = stream or sys.stderr
        self._enabled = enabled and _is_writer()
        self._t0 = time.perf_counter()
        self._bar = tqdm(
            total=total,
            initial=initial,
            file=self._stream,
            disable=not (self._enabled and _terminal(self._stream)),
            unit="step",
            bar_format="step {n_fmt}/{total_fmt} |{bar:12}| {elapsed}<{remaining}{postfix}",
            dynamic_ncols=True,
        )

    def update(
        self, step: int, row: Mapping[str, float], last_eval: Mapping[str, float] | None = None
    ) -> None:
        """Step `step` (1-based) is done; `row` is its metrics row, `last_eval` the
        newest held-out evaluation (its metrics and `step`; None: none yet)."""
        if not self._enabled:
            return
        figures = progress_figures(row, last_eval)
        if not self._bar.disable:
            self._bar.set_postfix_str(figures, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        elapsed = tqdm.format_interval(time.perf_counter() - self._t0)
        self._stream.write(f"step {step}/{self.total}  {figures}  [{elapsed}]\n")
        self._stream.flush()

    def close(self) -> None:
        self._bar.close()
