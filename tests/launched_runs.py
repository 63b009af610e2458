"""Launching the pipeline's multi-process program in tests: the launch command on
`quickstart:tiny` (or `agent.py:tiny`), real processes under `launch/local.py` or started
one by one, the one-process reference of a config (one per worker and config), and the
comparison of parameters against it (bit for bit, or within the two-training-process
tolerance: multicontroller_test's docstring). Shared by multicontroller_test and
multicontroller_features_test."""

import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from child_env import launched_env

from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.distributed import local_program as local  # launch/local.py's program
from streamrl_jax.metrics import read_jsonl

REPO = pathlib.Path(__file__).resolve().parents[1]

_OVERRIDES = {
    "pipeline.deterministic": True,
    "data.reward": "vowels",
    "log.final_params": True,
}


def _config(config="quickstart.py", **overrides):
    spec = importlib.util.spec_from_file_location("qs", REPO / "configs" / config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config("tiny").to_dict()
    for dotted, value in {**_OVERRIDES, **overrides}.items():
        section, key = dotted.split(".")
        cd[section][key] = value
    return config_lib.from_config_dict(cd)


def _flags(**overrides) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**_OVERRIDES, **overrides}.items()]


def _launch_cmd(workdir, config="quickstart.py", **overrides) -> list[str]:
    """The launch command of `configs/<config>:tiny` with the tests' and `overrides`'
    settings."""
    return [
        sys.executable,
        "-m",
        "streamrl_jax.launch",
        f"--config={REPO / 'configs' / config}:tiny",
        f"--workdir={workdir}",
        "--verbosity=0",  # every process's INFO lines on its console: the tests read them
        *_flags(**overrides),
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=launched_env(), cwd=REPO
    )


_ONE_PROCESS, _ONE_PROCESS_DIR = {}, {}


def _one_process(mode, tmp_path_factory, **overrides):
    """The same launch command in one process (its own 2 CPU devices: XLA:CPU's results
    depend on the process's device count, so the reference must not run in pytest's
    8-device process)."""
    key = (mode, *sorted(overrides.items()))
    if key not in _ONE_PROCESS:
        workdir = tmp_path_factory.mktemp(f"one-{mode}")
        run = _run(_launch_cmd(workdir, **{"pipeline.mode": mode}, **overrides))
        assert run.returncode == 0, run.stderr[-6000:]
        _ONE_PROCESS[key] = np.load(workdir / run_lib.FINAL_PARAMS)
        _ONE_PROCESS_DIR[key] = workdir
    return _ONE_PROCESS[key]


_EXT = pytest.mark.extended
# Two training processes against one (module docstring): every element within ATOL, all
# but 1 in OFF_FRACTION of them within 1e-6.
ATOL, OFF_FRACTION = 2e-4, 20_000


def _assert_params_match(got, want, exact: bool) -> None:
    off = 0
    for key in want.files:
        if exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:  # another reduction order
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=ATOL, err_msg=key)
            off += int((np.abs(got[key] - want[key]) > 1e-6).sum())
    size = sum(want[k].size for k in want.files)
    assert off <= size // OFF_FRACTION, f"{off} of {size} elements off by more than 1e-6"


def _like_one_process(processes, generation, settings, keys, tmp_path, tmp_path_factory, scoring=0):
    """Runs `settings` (stream_async) in `processes` processes, `generation` of them
    generating (and the last `scoring` scoring), and checks it against the same command
    in one process: the parameters
    (bit for bit with one training process, within the two-trainer tolerance with
    more), the metrics rows' `keys` per step (the trainers' float32 sums: in another
    order with several) and every step's consumed prompts (with several trainers each
    lists the prompts it trained and every one consumed without training). Returns the
    metrics rows."""
    workdir = tmp_path / "run"
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", str(processes)]
    cmd = _launch_cmd(workdir, **{"pipeline.mode": "stream_async"}, **settings)
    counts = ["-g", str(generation), "-s", str(scoring)]
    run = _run([*launcher, *counts, "--timeout_s", "240", "--", *cmd])
    assert run.returncode == 0, run.stdout[-6000:]
    training = processes - generation - scoring
    want = _one_process("stream_async", tmp_path_factory, **settings)
    _assert_params_match(np.load(workdir / run_lib.FINAL_PARAMS), want, exact=training == 1)
    one = _ONE_PROCESS_DIR[("stream_async", *sorted(settings.items()))]
    rows = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "reward" in r]
    ref = [r for r in read_jsonl(str(one / "metrics.jsonl")) if "reward" in r]
    for k in keys:  # (the reward of a step that trained nothing: nan)
        want_k = pytest.approx([r[k] for r in ref], rel=1e-6, nan_ok=True)
        assert [r[k] for r in rows] == want_k, k
    logs = [workdir] + [workdir / f"training-{i}" for i in range(1, training)]
    got: dict[int, set[str]] = {}
    for log in logs:
        for row in read_jsonl(str(log / "consumed.jsonl")):
            got.setdefault(row["step"], set()).update(row["prompt_ids"])
    assert got == {r["step"]: set(r["prompt_ids"]) for r in read_jsonl(str(one / "consumed.jsonl"))}
    return rows


def _spawn(
    processes, generation, workdir, logs, config="quickstart.py", scoring=0, **overrides
) -> list[subprocess.Popen]:
    """The program's processes started one by one (`generation` generate, the last
    `scoring` score), process i's output in `logs/p<i>.log`."""
    envs = _envs(processes, generation, scoring)
    return [
        _start(env, workdir, logs / f"p{i}.log", config, **overrides) for i, env in enumerate(envs)
    ]


def _envs(processes, generation, scoring=0) -> list[dict[str, str]]:
    """Each process's STREAMRL_* variables (a free coordinator port, the tests' run key):
    `_start` with one of them starts that process (again: a restarted one)."""
    coordinator = f"127.0.0.1:{local.free_port()}"
    key = "test-key-" + "0" * 24
    return [
        local.child_env(i, processes, generation, coordinator, key, scoring)
        for i in range(processes)
    ]


def _start(child_env, workdir, log, config="quickstart.py", **overrides) -> subprocess.Popen:
    """One process of the program (`child_env`: its STREAMRL_* variables); starting it
    again with the same `child_env` is what a restarted process does."""
    overrides = {"pipeline.steps": 40, "eval.num_problems": 0, **overrides}
    with open(log, "w") as out:
        return subprocess.Popen(
            _launch_cmd(workdir, config, **overrides),
            env=dict(launched_env(), **child_env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )


_CKPT = {"checkpoint.every": 1}


def _launched(processes, generation, workdir, scoring=0, **overrides):
    """The launch command in `processes` processes (`launch/local.py`; the last `scoring`
    score) or in one."""
    cmd = _launch_cmd(workdir, **{"pipeline.mode": "stream_async"}, **_CKPT, **overrides)
    if processes > 1:
        launcher = [sys.executable, str(REPO / "launch" / "local.py"), "--timeout_s", "240"]
        counts = ["-n", str(processes), "-g", str(generation), "-s", str(scoring)]
        cmd = [*launcher, *counts, "--", *cmd]
    run = _run(cmd)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run.stdout + run.stderr


def _assert_resumed_like_one_process(workdir, want, exact, log):
    assert "resumed from checkpoint" in log, log[-4000:]
    got = np.load(workdir / run_lib.FINAL_PARAMS)
    assert sorted(got.files) == sorted(want.files)
    _assert_params_match(got, want, exact)


def _kill_the_trainer_at(k, procs, workdir, logs, victim=2, waits=(0, 1), checkpoints=None):
    """SIGKILLs `procs[victim]` (by default the trainer of 2 generation + 1 training
    processes, logs in `logs`) once checkpoint k is in `checkpoints` (`workdir`'s by
    default) and waits for the processes `waits` to end; the run is left unfinished.
    Returns `procs`."""
    checkpoints = checkpoints or workdir / "checkpoints"
    log = logs / f"p{victim}.log"
    try:
        deadline = time.monotonic() + 180
        while not (checkpoints / str(k)).is_dir():
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            assert all(p.poll() is None for p in procs), log.read_text()[-4000:]
            time.sleep(0.05)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        for i in waits:
            procs[i].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert not (workdir / run_lib.FINAL_PARAMS).exists()
    return procs


def _lose_generation_0(workdir, logs, after: str, **overrides) -> str:
    """2 generation + 1 training process: generation process 0 (the one JAX would host
    the coordination service on) is SIGKILLed once `after` is in the trainer's log; the
    trainer and generation process 1 must exit 0, the trainer going on with process 1 and
    process 1 reading roster epoch 1. Returns the trainer's log."""
    procs = _spawn(3, 2, workdir, logs, **overrides)
    try:
        _wait_for_line(logs / "p2.log", after, procs)
        os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs[1:]:
            p.wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = {i: (logs / f"p{i}.log").read_text() for i in (1, 2)}
    assert procs[2].returncode == 0 and procs[1].returncode == 0, text[2][-4000:] + text[1][-3000:]
    lost = r"lost peer: .*generation-0.*going on with generation processes \[1\]"
    assert re.search(lost, text[2]), text[2][-4000:]
    assert "generation-1: roster epoch 1, generation processes [0] lost" in text[1]
    return text[2]


def _wait_for_line(log, text, procs, timeout=180.0) -> None:
    """Until `text` is in `log` (bounded; every process in `procs` still running)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        assert all(p.poll() is None for p in procs), log.read_text()[-4000:]
        time.sleep(0.05)


def _agent_cmd(workdir, flags, config="agent.py"):
    """The launch command of `configs/<config>:tiny` (the agent job's by default) with
    `flags`."""
    return _launch_cmd(workdir, config, **flags)
