"""The scoring stage across processes (pipeline/scoring.py): the judge runs in the
training process, where samples arrive from the generation processes; a run killed after a
checkpoint resumes to the uninterrupted one-process run's parameters bit for bit. Samples
of later batches are usually in the stage then (the checkpoint logs how many; how many is
timing, so the kill does not wait for it): they belonged to batches the checkpoint had not
trained, so the resumed run generates and judges them again, and trains each once."""

import pytest
from launched_runs import (
    _CKPT,
    _ONE_PROCESS_DIR,
    _assert_resumed_like_one_process,
    _kill_the_trainer_at,
    _launched,
    _one_process,
    _spawn,
)

from streamrl_jax.metrics import read_jsonl

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)

# A tiny random judge (its score tokens get little mass: min_mass 0), folded in at half
# weight; forwards of up to 16 samples that wait up to a second to fill, so samples sit
# in the stage across step boundaries.
_JUDGE = {
    "judge.model": "tiny",
    "judge.min_mass": 0.0,
    "judge.coef": 0.5,
    "judge.batch": 16,
    "judge.max_wait_s": 1.0,
    "eval.num_problems": 0,  # as the spawned processes (the held-out set shapes the train set)
}


def test_a_judged_run_across_processes_resumes_a_kill_like_one_process(tmp_path, tmp_path_factory):
    # 1 generation + 1 training process, a checkpoint every step. The trainer is SIGKILLed
    # once checkpoint 2 is written; the same command resumes and ends with the one-process
    # run's parameters and rows.
    run = {**_JUDGE, "pipeline.steps": 5}
    settings = {**run, **_CKPT}
    want = _one_process("stream_async", tmp_path_factory, **settings)
    one = _ONE_PROCESS_DIR[("stream_async", *sorted(settings.items()))]
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    procs = _spawn(2, 1, workdir, logs, **{"pipeline.mode": "stream_async"}, **settings)
    _kill_the_trainer_at(2, procs, workdir, logs, victim=1, waits=(0,))
    text = (logs / "p0.log").read_text()
    assert procs[0].returncode != 0 and "lost training" in text, text[-4000:]
    out = _launched(2, 1, workdir, **run)
    _assert_resumed_like_one_process(workdir, want, exact=True, log=out)
    rows = {r["step"]: r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "reward" in r}
    ref = [r for r in read_jsonl(str(one / "metrics.jsonl")) if "reward" in r]
    assert [rows[r["step"]]["reward"] for r in ref] == [r["reward"] for r in ref]
    assert sum(r["judge/judged"] for r in ref) >= 5 * 8  # every trained sample was judged
