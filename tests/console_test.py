"""The console and the log file: what a person sees, and what the file keeps.

Routing changes the process's logging for good, so it is checked in a subprocess
(a few lines of Python that log as a run does); the summary and the closing lines
are plain functions of the config and the result.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from streamrl_jax import config as config_lib
from streamrl_jax import console

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOGGING_RUN = textwrap.dedent(
    """
    import logging, sys, warnings
    from absl import app, flags, logging as absl_logging

    def main(argv):  # under absl's app.run, as launch runs
        from streamrl_jax import console
        out = console.start(argv[1], process=None, verbose=flags.FLAGS["verbosity"].present)
        out.say(["summary line"])
        absl_logging.info("an info line")
        absl_logging.warning("a warning line")
        warnings.warn("a python warning")
        import jax
        jax.devices()  # the backend probe (no JAX_PLATFORMS: every registered platform)
        try:
            raise RuntimeError("a failure")
        except RuntimeError:
            out.failed()  # launch re-raises: Python prints the traceback on the console

    app.run(main)
    """
)


def _log_like_a_run(workdir, *flags_):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # a GPU machine: probe, do not reserve
    run = subprocess.run(
        [sys.executable, "-c", _LOGGING_RUN, *flags_, str(workdir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


def test_the_console_holds_warnings_the_file_everything(tmp_path):
    console_text = _log_like_a_run(tmp_path)
    log = (tmp_path / console.LOG_FILE).read_text()
    assert "summary line" in console_text and "a warning line" in console_text
    assert "a python warning" in console_text
    assert "an info line" not in console_text
    assert console_text.count("summary line") == 1  # said once, not again as a log record
    assert log.startswith("==== ") and "-c" in log.splitlines()[0]  # the header: the command
    for line in ("summary line", "an info line", "a warning line", "a python warning"):
        assert line in log
    assert "RuntimeError: a failure" in log and "a failure" not in console_text
    # JAX's TPU probe (an INFO line on machines without libtpu) reaches neither.
    assert "Unable to initialize backend" not in console_text + log

    # --verbosity: INFO on the console too; the file gets the second run appended.
    console_text = _log_like_a_run(tmp_path, "--verbosity=0")
    assert "an info line" in console_text and "a warning line" in console_text
    assert console_text.count("summary line") == 1
    lines = (tmp_path / console.LOG_FILE).read_text().splitlines()
    assert sum(line.startswith("==== ") for line in lines) == 2
    assert sum(line.endswith("] an info line") for line in lines) == 2


def test_one_process_of_several_has_its_own_file():
    assert console.log_path("/w", None) == "/w/log.txt"
    assert console.log_path("/w", "p1-training") == "/w/log.p1-training.txt"


def test_config_lines_are_override_spelling():
    cfg = config_lib.from_config_dict(config_lib.defaults())
    lines = console.config_lines(cfg)
    assert f"pipeline.mode={cfg.pipeline.mode!r}" in lines
    assert f"mesh.instance_slots={cfg.mesh.instance_slots!r}" in lines
    assert len(lines) == len(set(lines)) and all("=" in line for line in lines)
    assert not any("Section(" in line for line in lines)  # sections are walked, not printed


@pytest.mark.parametrize("checkpoints", [0, 5])
def test_summary_names_every_output(checkpoints):
    d = config_lib.defaults()
    d.checkpoint.every = checkpoints
    cfg = config_lib.from_config_dict(d)
    text = "\n".join(
        console.summary(cfg, "/w", log_file="/w/log.txt", compile_cache="/c", processes=None)
    )
    for part in ("/w/log.txt", "/w/metrics.jsonl", "/w/tensorboard", "/w/trace.json", "/c"):
        assert part in text
    assert cfg.pipeline.mode in text and f"{cfg.pipeline.steps} steps" in text
    assert ("/w/checkpoints" in text) == bool(checkpoints)
    off = console.summary(cfg, "/w", log_file="/w/log.txt", compile_cache=None)
    assert "compile cache off" in " ".join(off.pop().split())


def test_closing_lines():
    evals = {0: {"accuracy": 0.25}, 20: {"accuracy": 0.5}}
    lines = console.closing(start=0, end=20, wall_s=125.0, samples=640, evals=evals, stopped=False)
    assert lines[0].startswith("done: step 20,") and "2 min 5 s" in lines[0]
    assert lines[1] == "  held-out accuracy: 0.250 (step 0), 0.500 (step 20)"
    stopped = console.closing(start=5, end=7, wall_s=1.0, samples=64, evals={}, stopped=True)
    assert stopped == [
        "stopped on a signal at step 7 (resumed at step 5), 64 samples in 0 min 1 s "
        "(64.00 samples/s)"
    ]
