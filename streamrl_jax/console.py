"""What a person sees of a run: a few console lines, and everything else in a log file.

At the default verbosity the console holds the start-up summary (`summary`), the
progress line (`metrics.Progress`), warnings and errors, and the closing lines
(`closing`). Every log record at the root logger's level (INFO unless `--verbosity`
says otherwise) goes to the run's log file in its workdir (`<workdir>/log.txt`; in a
multi-controller run one file per process, `log.p<id>-<role>.txt`), appended per run
after a header line; so do the summary and the config, one `section.field=value` a
line, the same spelling as a `--config.section.field=value` override.

`start` routes absl's handler (which carries every Python logger's records, JAX's and
orbax's included) to the file and adds a console handler at WARNING, or one that
shows what the file gets when the user asks (`launch --verbosity`). Console lines are
written through `tqdm.write`, so a warning never breaks the progress bar. Python
warnings (`warnings.warn`) are captured into the same two places.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from absl import flags
from absl import logging as absl_logging
from tqdm import tqdm

from streamrl_jax.config import ExperimentConfig

LOG_FILE = "log.txt"  # one process's log file in its workdir
# JAX's backend probe: the one INFO line of this logger is "Unable to initialize backend
# 'tpu'" on every machine without libtpu (its factory is registered always and fails
# quietly); a TPU that is present but unusable is a WARNING of the same logger.
_PROBE_LOGGER = "jax._src.xla_bridge"
# The file's own logger: what the console shows already (`Console.say`, a traceback)
_FILE_ONLY = "streamrl_jax.console"


def log_path(workdir: str, process: str | None = None) -> str:
    """The log file of a run in `workdir`: `log.txt`, or `log.<process>.txt` for one
    process of several (`process` names it, e.g. "p0-generation")."""
    return os.path.join(workdir, LOG_FILE if process is None else f"log.{process}.txt")


class _ConsoleHandler(logging.Handler):
    """Records at or above its level on the console, above any progress bar."""

    def __init__(self, level: int, stream: TextIO):
        super().__init__(level)
        self.stream = stream
        self.setFormatter(
            logging.Formatter(
                "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s", "%H:%M:%S"
            )
        )

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == _FILE_ONLY:  # on the console already
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


@dataclasses.dataclass(frozen=True)
class Console:
    """The run's two outputs, once `start` routed logging.

    Attributes:
      log_file: the path every log record goes to.
      stream: the console (standard error).
    """

    log_file: str
    stream: TextIO

    def say(self, lines: Sequence[str]) -> None:
        """Lines for the person at the console; the log file gets them at INFO."""
        for line in lines:
            tqdm.write(line, file=self.stream)
        logging.getLogger(_FILE_ONLY).info("%s", "\n".join(lines))

    def failed(self) -> None:
        """The exception being handled, its traceback into the log file (Python prints it
        on the console as the process ends)."""
        logging.getLogger(_FILE_ONLY).exception("the run failed")


def start(
    workdir: str, *, process: str | None, verbose: bool, stream: TextIO | None = None
) -> Console:
    """Routes this process's logging: the file gets every record the root logger passes
    (INFO and up, by absl's default verbosity), the console warnings and errors, or with
    `verbose` the same records as the file. absl's own `--logtostderr` and
    `--alsologtostderr` keep their meaning: then absl writes the console, not this.

    Args:
      workdir: the run's workdir (created if missing).
      process: names this process's file in a multi-controller run (None: one process).
      verbose: the console shows every record, not only warnings and errors.
      stream: the console (default standard error).
    """
    stream = stream or sys.stderr
    path = log_path(workdir, process)
    os.makedirs(workdir, exist_ok=True)
    # Line-buffered: the file is current when a run is killed.
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process's life
    now = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
    command = shlex.join(sys.orig_argv).replace("\n", "\\n")  # the header is one line
    log.write(f"==== {now} pid {os.getpid()} on {socket.gethostname()}: {command}\n")
    absl_logging.get_absl_handler().python_handler.setStream(log)
    root = logging.getLogger()
    if root.level > logging.DEBUG:  # -v 1 (DEBUG) keeps every line of the probe's logger
        logging.getLogger(_PROBE_LOGGER).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    if not (flags.FLAGS["logtostderr"].value or flags.FLAGS["alsologtostderr"].value):
        root.addHandler(_ConsoleHandler(logging.NOTSET if verbose else logging.WARNING, stream))
    return Console(log_file=path, stream=stream)


def config_lines(cfg: ExperimentConfig) -> list[str]:
    """Every field of `cfg`, `section.field=value` (the override spelling), one a line."""

    def walk(obj: object, prefix: str) -> list[str]:
        out = []
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                out += walk(value, f"{prefix}{field.name}.")
            elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
                for i, item in enumerate(value):  # learners[0].name=...
                    out += walk(item, f"{prefix}{field.name}[{i}].")
            else:
                out.append(f"{prefix}{field.name}={value!r}")
        return out

    return walk(cfg, "")


def summary(
    cfg: ExperimentConfig,
    workdir: str,
    *,
    log_file: str,
    compile_cache: str | None,
    processes: str | None = None,
) -> list[str]:
    """The start-up lines: what runs, on what, and where every output goes.

    Args:
      cfg: the experiment.
      workdir: the run's workdir.
      log_file: this process's log file.
      compile_cache: the persistent compilation cache directory (None: off).
      processes: a multi-controller run's process layout, in words (None: one process).
    """
    if cfg.learners:
        return _learners_summary(cfg, workdir, log_file=log_file, compile_cache=compile_cache)
    p, m = cfg.pipeline, cfg.mesh
    mode = _mode(p)
    slots = "+".join(str(s) for s in m.instance_slots)
    if p.mode == "colocated":
        mesh = f"generation and training share the devices; instance slots {slots}"
    else:
        mesh = (
            f"{_count(m.generate_devices, 'generation device')} (instance slots {slots}), "
            f"{_count(m.train_devices, 'training device')}"
        )
    outputs = [
        ("mesh", mesh + (f"; {processes}" if processes else "")),
        ("workdir", workdir),
        ("log", f"{log_file} (the config and INFO lines; --verbosity=0 shows INFO here)"),
        ("metrics", os.path.join(workdir, "metrics.jsonl")),
    ]
    if cfg.log.tensorboard:
        outputs.append(
            ("tensorboard", f"tensorboard --logdir {os.path.join(workdir, 'tensorboard')}")
        )
    if cfg.log.trace:
        trace = os.path.join(workdir, "trace.json")
        outputs.append(("trace", f"{trace} (written at the end; open in ui.perfetto.dev)"))
    if cfg.checkpoint.every:
        where = os.path.join(workdir, "checkpoints")
        n = cfg.checkpoint.every
        outputs.append(("checkpoints", f"{where} every " + ("step" if n == 1 else f"{n} steps")))
    cache = f"{compile_cache} (safe to delete)" if compile_cache else "off"
    outputs.append(("compile cache", cache))
    head = (
        f"streamrl_jax: model {cfg.model.source}, {cfg.algorithm.advantage}, {mode}, "
        f"{p.steps} steps of {p.prompts_per_step} prompts x {p.group_size} samples"
    )
    return [head] + [f"  {name:<14}{text}" for name, text in outputs]


def _mode(p: Any) -> str:
    return f"{p.mode} (staleness {p.staleness})" if p.mode == "stream_async" else p.mode


def _learners_summary(
    cfg: ExperimentConfig, workdir: str, *, log_file: str, compile_cache: str | None
) -> list[str]:
    """Several learners: one line each, and where each one's outputs go."""
    m = cfg.mesh
    slots = "+".join(str(s) for s in m.instance_slots)
    lines = [
        f"streamrl_jax: model {cfg.model.source}, {len(cfg.learners)} learners (LoRA rank "
        f"{cfg.learners[0].lora.rank}) on one generation service",
        f"  {'mesh':<14}{_count(m.generate_devices, 'generation device')} (instance slots "
        f"{slots}), {_count(m.train_devices, 'training device')}",
    ]
    for learner in cfg.learners:
        p = learner.pipeline
        lines.append(
            f"  {learner.name:<14}{learner.algorithm.advantage}, {_mode(p)}, {p.steps} steps of "
            f"{p.prompts_per_step} prompts x {p.group_size} samples; its metrics, samples and "
            f"checkpoints in {os.path.join(workdir, learner.name)}"
        )
    cache = f"{compile_cache} (safe to delete)" if compile_cache else "off"
    lines += [
        f"  {'log':<14}{log_file} (the config and INFO lines; --verbosity=0 shows INFO here)",
        f"  {'compile cache':<14}{cache}",
    ]
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def closing(
    *,
    start: int,
    end: int,
    wall_s: float,
    samples: int,
    evals: Mapping[int, Mapping[str, float]],
    stopped: bool,
) -> list[str]:
    """The lines a run ends with: how far it got, how fast, its held-out accuracy.

    Args:
      start: the step this run began at (> 0: resumed from a checkpoint).
      end: the step it ended at.
      wall_s: its wall time.
      samples: the samples it trained.
      evals: policy version -> held-out metrics (`accuracy`).
      stopped: a signal stopped it at `end`.
    """
    minutes, seconds = divmod(round(wall_s), 60)
    how = "stopped on a signal at" if stopped else "done:"
    resumed = f" (resumed at step {start})" if start else ""
    lines = [
        f"{how} step {end}{resumed}, {samples} samples in {minutes} min {seconds} s "
        f"({samples / max(wall_s, 1e-9):.2f} samples/s)"
    ]
    if evals:
        held_out = ", ".join(f"{evals[v]['accuracy']:.3f} (step {v})" for v in sorted(evals))
        lines.append(f"  held-out accuracy: {held_out}")
    return lines
