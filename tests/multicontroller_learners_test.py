"""Several learners across processes (docs/multicontroller.md, "Several learners across
processes"; docs/learners.md): `configs/learners.py:tiny` against the same command in
one process, on real processes on localhost (launch helpers: `launched_runs.py`).

Every case launches 3-4 processes and a one-process run (~40 s on 2 shared cores). By
default: two learners on 1 generation + 2 training processes (a training process each);
2 + 2 and a killed learner's resume are `-m extended`.
"""

import re
import sys

import numpy as np
import pytest
from launched_runs import (
    _EXT,
    REPO,
    _agent_cmd,
    _assert_params_match,
    _kill_the_trainer_at,
    _run,
    _spawn,
)

from streamrl_jax import pipeline as run_lib
from streamrl_jax.metrics import read_jsonl

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)


@pytest.mark.parametrize(
    "processes, generation",
    [(3, 1), pytest.param(4, 2, marks=_EXT)],  # 1 or 2 generation + a trainer per learner
)
def test_learners_across_processes_give_the_one_process_parameters(processes, generation, tmp_path):
    # Several learners across processes (configs/learners.py:tiny: a GRPO learner in
    # stream_async and a PPO learner with a critic in stream_sync, each a rank-8 LoRA
    # adapter on one frozen base) on 1 (or 2) generation + 2 training processes: every
    # generation process serves both learners' drivers from one service with an adapter
    # slot each, each learner trains on a training process of its own, and each sends
    # its adapters alone after its first version. Every learner ends with the
    # one-process run's parameters bit for bit, its rewards and consumed prompts.
    flags = {"eval.num_problems": 0}
    one, many = tmp_path / "one", tmp_path / "many"
    run = _run(_agent_cmd(one, flags, config="learners.py"))
    assert run.returncode == 0, run.stderr[-6000:]
    # The main command's summary names each learner and its directory; the closing lines
    # are each learner's; the log keeps each learner's settings.
    console = run.stdout + run.stderr
    assert "2 learners (LoRA rank 8) on one generation service" in console, console[-4000:]
    for name in ("grpo", "ppo"):
        assert f"checkpoints in {one / name}" in console, console[-4000:]
        assert re.search(rf"^learner {name}: done: step \d+,", console, re.M), console[-4000:]
    assert "learners[1].algorithm.advantage='gae'" in (one / "log.txt").read_text()
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", str(processes)]
    launcher += ["-g", str(generation), "--timeout_s", "240", "--"]
    cmd = [*launcher, *_agent_cmd(many, flags, config="learners.py")]
    run = _run(cmd)
    assert run.returncode == 0, run.stdout[-6000:]
    for name in ("grpo", "ppo"):
        want = np.load(one / name / run_lib.FINAL_PARAMS)
        got = np.load(many / name / run_lib.FINAL_PARAMS)
        assert sorted(got.files) == sorted(want.files), name
        _assert_params_match(got, want, exact=True)
        rows, ref = [
            [r for r in read_jsonl(str(d / name / "metrics.jsonl")) if "reward" in r]
            for d in (many, one)
        ]
        assert [r["reward"] for r in rows] == pytest.approx([r["reward"] for r in ref]), name
        consumed = [read_jsonl(str(d / name / "consumed.jsonl")) for d in (many, one)]
        assert consumed[0] == consumed[1], name


@_EXT
def test_a_killed_learner_and_the_others_resume_exactly(tmp_path):
    # configs/learners.py:tiny on 1 generation + 2 training processes, 4 steps, a
    # checkpoint every step. The PPO learner's trainer is SIGKILLed once its checkpoint 2
    # is on disk; the generation process fails naming it (the GRPO learner, in
    # stream_async, may have finished by then). The same command resumes each learner from
    # its own checkpoint (the finished one from its last), and both end with the
    # uninterrupted one-process run's parameters bit for bit, every prompt consumed once.
    flags = {"eval.num_problems": 0, "checkpoint.every": 1, "pipeline.steps": 4}
    one, many = tmp_path / "one", tmp_path / "many"
    run = _run(_agent_cmd(one, flags, config="learners.py"))
    assert run.returncode == 0, run.stderr[-6000:]
    procs = _spawn(3, 1, many, tmp_path, "learners.py", **flags)
    _kill_the_trainer_at(
        2, procs, many, tmp_path, waits=(0,), checkpoints=many / "ppo" / "checkpoints"
    )
    text = (tmp_path / "p0.log").read_text()
    assert procs[0].returncode != 0 and "lost training" in text, text[-4000:]
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", "3", "-g", "1"]
    launcher += ["--timeout_s", "240", "--"]
    run = _run([*launcher, *_agent_cmd(many, flags, config="learners.py")])
    assert run.returncode == 0, run.stdout[-6000:]
    assert "resumed from checkpoint" in run.stdout, run.stdout[-4000:]
    for name in ("grpo", "ppo"):
        want = np.load(one / name / run_lib.FINAL_PARAMS)
        _assert_params_match(np.load(many / name / run_lib.FINAL_PARAMS), want, exact=True)
        consumed = [read_jsonl(str(d / name / "consumed.jsonl")) for d in (many, one)]
        assert consumed[0] == consumed[1], name
