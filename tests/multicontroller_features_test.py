"""The pod program's rollouts across processes (docs/multicontroller.md, "Dynamic
sampling, the curriculum and agents across processes", "Partial rollout across
processes"): each against the same command in one process, on real processes on
localhost, with the launch helpers of `launched_runs.py` (one module's, so the
one-process references a worker ran are shared). The agent job's and several learners'
are multicontroller_agents_test.py and multicontroller_learners_test.py (one file each,
so the suite's two workers share them).

Every case launches 2-4 processes and a one-process reference (30-90 s each on 2 shared
cores). By default: the curriculum over dynamic sampling on 2 generation + 1 training
processes under a judge that is the generation service's tenant, losing generation
process 0 mid-run (dynamic sampling's, the tenant judge's and a lost generation
process's default case too), and partial rollout under a judge
(pipeline/scoring.py) killed at a checkpoint and resumed on 2 + 1 (the default kill and
resume across processes, and the judge's run across processes); the other topologies of
each are `-m extended`.
"""

import collections
import os
import signal

import numpy as np
import pytest
from launched_runs import (
    _CKPT,
    _EXT,
    _ONE_PROCESS_DIR,
    _assert_params_match,
    _assert_resumed_like_one_process,
    _envs,
    _kill_the_trainer_at,
    _launched,
    _like_one_process,
    _lose_generation_0,
    _one_process,
    _start,
    _wait_for_line,
)

from streamrl_jax import pipeline as run_lib
from streamrl_jax.metrics import read_jsonl

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)

_DYNAMIC = {
    "pipeline.rollout": "dynamic_sampling",
    "generation.max_new_tokens": 1,
    "pipeline.steps": 3,
}


# The topologies of a rollout whose default case is another test's: 2 generation + 1
# training process (bit for bit), 1 + 1, and 2 + 2 (each trainer its own groups).
_EXTENDED_TOPOLOGIES = [
    pytest.param(3, 2, marks=_EXT),
    pytest.param(2, 1, marks=_EXT),
    pytest.param(4, 2, marks=_EXT),
]


# dynamic sampling's default case is the curriculum's (over dynamic sampling)
@pytest.mark.parametrize("processes, generation", _EXTENDED_TOPOLOGIES)
def test_dynamic_sampling_across_processes_gives_the_one_process_parameters(
    processes, generation, tmp_path, tmp_path_factory
):
    # DAPO dynamic sampling (the quickstart's rollout) across processes: one-token
    # responses under the vowel reward make some groups uniform, so they are skipped and
    # refilled. Each generation process judges the groups it made and publishes its
    # verdicts; every process decides the same refill rounds from all of them (the
    # trainers draw the same prompts); the run ends with the one-process run's skips,
    # draws, rewards and consumed prompts, and its parameters: bit for bit with one
    # training process, within the two-trainer tolerance with two (stream_async,
    # deterministic).
    keys = ("reward", "groups_skipped", "dynamic_draws", "dynamic_short", "samples")
    rows = _like_one_process(processes, generation, _DYNAMIC, keys, tmp_path, tmp_path_factory)
    assert sum(r["groups_skipped"] for r in rows) > 0  # the refills ran


# Dynamic sampling under a judge (the tiny random one, min_mass 0, at half weight):
# whether a group is informative depends on the verdicts, which only the training side
# computes, so the training processes judge the groups and publish the verdicts
# (RolloutContext.trainers_judge). Two candidates per token (top_k 2) keep one-token
# groups often identical (the same verdicts: skipped) and often not.
_JUDGED = {"judge.model": "tiny", "judge.min_mass": 0.0, "judge.coef": 0.5, "generation.top_k": 2}


# the default case: the curriculum's run that loses a generation process (under a judge)
@pytest.mark.parametrize(
    "processes, generation, scoring",
    [
        pytest.param(2, 1, 0, marks=_EXT),  # 1 + 1
        pytest.param(4, 2, 0, marks=_EXT),  # 2 + 2: each trainer publishes its own groups'
        pytest.param(3, 1, 1, marks=_EXT),  # 1 + 1 + 1: the judge in a scoring process
    ],
)
def test_dynamic_sampling_under_a_judge_across_processes_gives_the_one_process_parameters(
    processes, generation, scoring, tmp_path, tmp_path_factory
):
    keys = ("reward", "groups_skipped", "dynamic_draws", "dynamic_short", "samples")
    settings = {**_DYNAMIC, **_JUDGED}
    rows = _like_one_process(
        processes, generation, settings, keys, tmp_path, tmp_path_factory, scoring=scoring
    )
    assert sum(r["groups_skipped"] for r in rows) > 0  # the refills ran


_CURRICULUM = {
    "pipeline.rollout": "curriculum+dynamic_sampling",
    "generation.max_new_tokens": 1,
    "pipeline.curriculum_decay": 0.3,
    "pipeline.steps": 4,
    "data.train_size": 12,  # epochs of three steps or fewer: prompts come back, weighed
}


# The curriculum's default case is the run below that loses a generation process.
@pytest.mark.parametrize(
    "processes, generation",
    [
        pytest.param(3, 2, marks=_EXT),  # 2 generation + 1 training process: bit for bit
        pytest.param(4, 2, marks=_EXT),  # 2 + 2: each trainer publishes its own outcomes
    ],
)
def test_the_curriculum_across_processes_gives_the_one_process_parameters(
    processes, generation, tmp_path, tmp_path_factory
):
    # The curriculum over dynamic sampling across processes: one-token responses under
    # the vowel reward make groups uniform (skipped, weighed down) or varied. Each
    # training process publishes its step's outcomes; every process that draws (the
    # generation processes, and the trainers through the rollout) reads them before the
    # draws that depend on them, so all pass over the same prompts: the one-process
    # run's parameters, passes, skips and consumed prompts.
    # (curriculum_down, the weights as the newest draw saw them, depends on how far
    # generation ran ahead of the step, even in one process)
    keys = ("samples", "groups_skipped", "dynamic_draws", "curriculum_passed")
    rows = _like_one_process(processes, generation, _CURRICULUM, keys, tmp_path, tmp_path_factory)
    assert sum(r["curriculum_passed"] for r in rows) > 0  # prompts passed over
    assert sum(r["groups_skipped"] for r in rows) > 0  # dynamic sampling's refills ran


def test_the_curriculum_across_processes_survives_a_lost_generation_process(
    tmp_path, tmp_path_factory
):
    # The curriculum over dynamic sampling under a judge on 2 generation + 1 training
    # processes (the curriculum's, dynamic sampling's, dynamic sampling under a judge's
    # and the judge as the generation service's tenant's default case across processes,
    # and the default case of a lost generation process: one launch for the five; under
    # the judge the trainer decides which groups
    # are informative and publishes the verdicts). Generation process 0
    # (the one JAX would host the coordination service on) is SIGKILLed as soon as the
    # trainer has sent W_0, before its first batch is in. The trainer and generation
    # process 1 go on: process 1 generates process 0's groups too (those of batches it
    # already drew, again), the trainer keeps the first copy of each sample, and every
    # process still reads each step's published outcomes before the draws that depend on
    # them. The run ends with the one-process run's parameters bit for bit (a sample
    # depends only on weights, prompt and seed, whichever process makes it), its passes,
    # skips, refill draws and samples step by step, its consumed prompts, and the lost
    # process's held-out prompts scored too. (A loss while process 1 settles a batch,
    # waiting for the verdicts of exactly the groups it must make again, once stalled
    # here: test_a_lost_processs_groups_are_generated_again_while_a_batch_settles.)
    # The judge here is the generation service's tenant (judge.placement="generation",
    # pipeline/tenant.py): each generation process serves the judge its instances hold,
    # the trainer's scoring stage sends its forwards to them in turn, passing the lost
    # one; the one-process run holds it on a scoring mesh of its own (the same bits).
    settings = {**_CURRICULUM, **_JUDGED, "eval.num_problems": 4}
    want = _one_process("stream_async", tmp_path_factory, **settings)
    one = _ONE_PROCESS_DIR[("stream_async", *sorted(settings.items()))]
    workdir = tmp_path / "run"
    mode = {"pipeline.mode": "stream_async", "judge.placement": "generation"}
    trainer = _lose_generation_0(workdir, tmp_path, "weights v0", **mode, **settings)
    assert "judge of generation process 1 at" in trainer, trainer[-3000:]
    assert "generation-1: the judge served at" in (tmp_path / "p1.log").read_text()
    _assert_params_match(np.load(workdir / run_lib.FINAL_PARAMS), want, exact=True)
    rows = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "reward" in r]
    ref = [r for r in read_jsonl(str(one / "metrics.jsonl")) if "reward" in r]
    for k in ("samples", "groups_skipped", "dynamic_draws", "curriculum_passed"):
        assert [r[k] for r in rows] == [r[k] for r in ref], k
    assert sum(r["curriculum_passed"] for r in rows) > 0  # prompts passed over
    assert sum(r["groups_skipped"] for r in rows) > 0  # dynamic sampling's refills ran
    assert [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "eval/accuracy" in r]
    # The consumed log is the one-process run's, and (the curriculum's one end-to-end
    # run, so its accounting is checked here too) lists every prompt the pipeline dealt
    # once per epoch, passed over or not.
    consumed = read_jsonl(str(workdir / "consumed.jsonl"))
    assert consumed == read_jsonl(str(one / "consumed.jsonl"))
    counts = collections.Counter(p for r in consumed for p in r["prompt_ids"])
    epochs = sum(counts.values()) // _CURRICULUM["data.train_size"]
    assert len(counts) == _CURRICULUM["data.train_size"], counts  # a whole epoch dealt
    assert max(counts.values()) > 1, counts  # and part of the next
    assert all(epochs <= n <= epochs + 1 for n in counts.values()), counts


_PARTIAL = {
    "pipeline.rollout": "partial",
    "pipeline.partial_budget_tokens": 6,
    "pipeline.max_lag": 3,
    "pipeline.steps": 4,
    "eval.num_problems": 0,
}


# partial rollout's default case is the killed-and-resumed run below (its parameters are
# the one-process run's too)
@pytest.mark.parametrize("processes, generation", _EXTENDED_TOPOLOGIES)
def test_partial_rollout_across_processes_gives_the_one_process_parameters(
    processes, generation, tmp_path, tmp_path_factory
):
    # Partial rollout across processes: rounds of 6 tokens, so the tiny model's 16-token
    # samples take 3 rounds. Each generation process runs the rounds of its own groups
    # (their paused samples continue there under newer weights) and reports each round's
    # closure to every trainer; a step trains the groups every process's report says the
    # round completed (each trainer its own). The run ends with the one-process run's
    # parameters (bit for bit with one training process, within the two-trainer
    # tolerance with two), its per-step samples, rewards and consumed prompts.
    keys = ("reward", "samples", "optimizer_steps", "carried_paused", "dropped_lag")
    rows = _like_one_process(processes, generation, _PARTIAL, keys, tmp_path, tmp_path_factory)
    # continued under newer weights
    assert max(r["mixed_versions"] for r in rows if r["samples"]) > 0


# A tiny random judge (its score tokens get little mass: min_mass 0), folded in at half
# weight; forwards of up to 16 samples that wait up to a second to fill, so samples often
# sit in the stage across step boundaries.
_JUDGE = {
    "judge.model": "tiny",
    "judge.min_mass": 0.0,
    "judge.coef": 0.5,
    "judge.batch": 16,
    "judge.max_wait_s": 1.0,
}


def test_partial_rollout_across_processes_resumes_a_killed_run_exactly(tmp_path, tmp_path_factory):
    # 2 generation + 1 training + 1 scoring process, partial rollout under a judge scored
    # as a stage of the stream (pipeline/scoring.py: the training process's stage sends
    # its forwards to the scoring process, which holds the judge:
    # pipeline/processes/scoring.py), a checkpoint every step: each generation process
    # writes its share of the work carried into round k (paused samples, finished
    # members of incomplete groups) before it reports round k - 1 (processes/carried.py).
    # * The scoring process is SIGKILLed once the trainer has sent W_1 (a forward may be
    #   in flight) and started again with the same command and id: it loads the judge
    #   again and publishes a new address; the trainer sends it what was unanswered
    #   (distributed/judge_channel.py).
    # * The trainer is SIGKILLed once checkpoint 3 is on disk (the generation and
    #   scoring processes then fail naming it: the default case of a killed trainer),
    #   with samples of later batches usually waiting in the scoring stage (the
    #   checkpoint logs how many; how many is timing). The same command resumes, the
    #   generation processes take their carried work back, what waited in the stage is
    #   generated and judged again.
    # The run ends with the uninterrupted one-process run's parameters bit for bit, every
    # step's prompts consumed and rewards as there: the verdicts do not depend on which
    # process computes them, nor on the losses. (Partial rollout, the judge and its
    # process share one launch: each launch costs its processes' start-up, most of such
    # a test.)
    run = {**_PARTIAL, **_JUDGE, "pipeline.steps": 5}
    settings = {**run, **_CKPT}
    want = _one_process("stream_async", tmp_path_factory, **settings)
    one = _ONE_PROCESS_DIR[("stream_async", *sorted(settings.items()))]
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    envs = _envs(4, 2, scoring=1)
    mode = {"pipeline.mode": "stream_async"}
    procs = [
        _start(env, workdir, logs / f"p{i}.log", **mode, **settings) for i, env in enumerate(envs)
    ]
    try:
        _wait_for_line(logs / "p2.log", "weights v1", procs)
        os.killpg(procs[3].pid, signal.SIGKILL)
        procs[3].wait(timeout=30)
        _wait_for_line(logs / "p2.log", "lost a scoring process", procs[:3])
        procs[3] = _start(envs[3], workdir, logs / "p3-again.log", **mode, **settings)
    except BaseException:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise
    _kill_the_trainer_at(3, procs, workdir, logs, waits=(0, 1, 3))
    again = (logs / "p3-again.log").read_text()
    assert "scoring-0: judge tiny served at" in again and "(restarted)" in again, again[-3000:]
    for i, log in ((0, "p0.log"), (1, "p1.log")):
        text = (logs / log).read_text()  # each fails, naming the trainer
        assert procs[i].returncode != 0 and "lost training" in text, text[-4000:]
    # The scoring process too, unless JAX's coordination client (the service died with
    # the trainer) aborted it first: both come within a second of the kill, in either
    # order (seen once in a full suite run: SIGABRT before the channel's loss).
    text = (logs / "p3-again.log").read_text()
    jax_abort = "JAX distributed service detected fatal errors" in text
    assert procs[3].returncode != 0 and ("lost training" in text or jax_abort), text[-4000:]
    assert sorted(os.listdir(workdir / "carried" / "3")) == [
        "generation-0.json",
        "generation-1.json",
    ]
    log = _launched(4, 2, workdir, scoring=1, **run)
    _assert_resumed_like_one_process(workdir, want, exact=True, log=log)
    assert "restored" in log and "carried into round" in log, log[-4000:]
    rows = read_jsonl(str(workdir / "consumed.jsonl"))
    assert rows == read_jsonl(str(one / "consumed.jsonl"))
    got = {r["step"]: r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "reward" in r}
    ref = [r for r in read_jsonl(str(one / "metrics.jsonl")) if "reward" in r]
    assert [got[r["step"]]["reward"] for r in ref] == pytest.approx(
        [r["reward"] for r in ref], rel=0, abs=0, nan_ok=True
    )
    # every trained sample was judged (and some judged were carried past the run's end)
    assert sum(r["judge/judged"] for r in ref) >= sum(r["samples"] for r in ref) > 0
