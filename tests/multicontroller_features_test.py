"""The pod program's features across processes (docs/multicontroller.md, "Dynamic
sampling, the curriculum and agents across processes", "Partial rollout across
processes", "Several learners across processes"): each against the same command in one
process, on real processes on localhost, with the launch helpers of `launched_runs.py`
(one module's, so the one-process references a worker ran are shared).

Every case launches 2-4 processes and a one-process reference (30-90 s each on 2 shared
cores). By default: the curriculum over dynamic sampling on 2 generation + 1 training
processes (dynamic sampling's default case too), partial rollout killed at a checkpoint
and resumed on 2 + 1 (the default kill and resume across processes), the agent job with
the supervised target on 1 + 2, and two learners on 1 + 2 (a training process each);
the other topologies of each are `-m extended`.
"""

import os
import sys

import numpy as np
import pytest
from launched_runs import (
    _CKPT,
    _EXT,
    _ONE_PROCESS_DIR,
    REPO,
    _agent_cmd,
    _assert_params_match,
    _assert_resumed_like_one_process,
    _kill_the_trainer_at,
    _launched,
    _like_one_process,
    _one_process,
    _run,
    _spawn,
)

from streamrl_jax import pipeline as run_lib
from streamrl_jax.metrics import read_jsonl

_DYNAMIC = {
    "pipeline.rollout": "dynamic_sampling",
    "generation.max_new_tokens": 1,
    "pipeline.steps": 3,
}


@pytest.mark.parametrize(
    "processes, generation",
    [
        # dynamic sampling's default case is the curriculum's (over dynamic sampling)
        pytest.param(3, 2, marks=_EXT),  # 2 generation + 1 training process: bit for bit
        pytest.param(2, 1, marks=_EXT),
        pytest.param(4, 2, marks=_EXT),  # 2 + 2: each trainer its own informative groups
    ],
)
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


_CURRICULUM = {
    "pipeline.rollout": "curriculum+dynamic_sampling",
    "generation.max_new_tokens": 1,
    "pipeline.curriculum_decay": 0.3,
    "pipeline.steps": 4,
    "data.train_size": 12,  # epochs of three steps or fewer: prompts come back, weighed
}


@pytest.mark.parametrize(
    "processes, generation",
    [
        (3, 2),  # 2 generation + 1 training process: bit for bit
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


_PARTIAL = {
    "pipeline.rollout": "partial",
    "pipeline.partial_budget_tokens": 6,
    "pipeline.max_lag": 3,
    "pipeline.steps": 4,
    "eval.num_problems": 0,
}


@pytest.mark.parametrize(
    "processes, generation",
    [
        # partial rollout's default case is the killed-and-resumed run below (its
        # parameters are the one-process run's too)
        pytest.param(3, 2, marks=_EXT),  # 2 generation + 1 training process: bit for bit
        pytest.param(2, 1, marks=_EXT),
        pytest.param(4, 2, marks=_EXT),  # 2 + 2: each trainer its own groups of a round
    ],
)
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


def test_partial_rollout_across_processes_resumes_a_killed_run_exactly(tmp_path, tmp_path_factory):
    # 2 generation + 1 training processes, partial rollout, a checkpoint every step: each
    # generation process writes its share of the work carried into round k (paused
    # samples, finished members of incomplete groups) before it reports round k - 1
    # (processes/carried.py). The trainer is SIGKILLed once checkpoint 3 is on disk (the
    # generation processes then fail naming it: the default case of a killed trainer);
    # the same command resumes, the
    # generation processes take their carried work back, and the run ends with the
    # uninterrupted one-process run's parameters bit for bit, every step's prompts
    # consumed as there.
    run = {**_PARTIAL, "pipeline.steps": 5}
    settings = {**run, **_CKPT}
    want = _one_process("stream_async", tmp_path_factory, **settings)
    one = _ONE_PROCESS_DIR[("stream_async", *sorted(settings.items()))]
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    procs = _spawn(3, 2, workdir, logs, **{"pipeline.mode": "stream_async"}, **settings)
    _kill_the_trainer_at(3, procs, workdir, logs)
    for i in (0, 1):  # both generation processes fail, naming the trainer
        text = (logs / f"p{i}.log").read_text()
        assert procs[i].returncode != 0 and "lost training" in text, text[-4000:]
    assert sorted(os.listdir(workdir / "carried" / "3")) == [
        "generation-0.json",
        "generation-1.json",
    ]
    log = _launched(3, 2, workdir, **run)
    _assert_resumed_like_one_process(workdir, want, exact=True, log=log)
    assert "restored" in log and "carried into round" in log, log[-4000:]
    rows = read_jsonl(str(workdir / "consumed.jsonl"))
    assert rows == read_jsonl(str(one / "consumed.jsonl"))


@pytest.mark.parametrize(
    "processes, generation",
    [pytest.param(3, 2, marks=_EXT), pytest.param(4, 2, marks=_EXT)],  # default: below
)
def test_agents_across_processes_give_the_one_process_parameters(processes, generation, tmp_path):
    # The agent job (configs/agent.py:tiny: scaffolds play the calculator environment
    # through the OpenAI endpoint, with the official openai client) across processes:
    # each generation process serves its own endpoint (loopback, its own token) to the
    # scaffolds of the episodes it owns; the run ends with the one-process run's
    # parameters (bit for bit with one training process) and its episodes' turns and
    # returns.
    agents = {"pipeline.rollout": "agents+full", "pipeline.mode": "stream_async"}
    rows, ref = _agent_job_like_one_process(processes, generation, agents, tmp_path)
    for key in ("reward", "episode_turns", "samples"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-6), key


def _agent_job_like_one_process(processes, generation, flags, tmp_path):
    """`configs/agent.py:tiny` with `flags` (and 2 held-out problems) in one process and
    in `processes` (`generation` generating): the parameters alike (bit for bit with one
    training process, within the two-trainer tolerance with more). Returns both runs'
    metrics rows (these processes', then the one process's)."""
    flags = {"eval.num_problems": 2, **flags}
    one, many = tmp_path / "one", tmp_path / "many"
    run = _run(_agent_cmd(one, flags))
    assert run.returncode == 0, run.stderr[-6000:]
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", str(processes)]
    cmd = [*launcher, "-g", str(generation), "--timeout_s", "240", "--", *_agent_cmd(many, flags)]
    run = _run(cmd)
    assert run.returncode == 0, run.stdout[-6000:]
    want, got = np.load(one / run_lib.FINAL_PARAMS), np.load(many / run_lib.FINAL_PARAMS)
    _assert_params_match(got, want, exact=processes - generation == 1)
    return [[r for r in read_jsonl(str(d / "metrics.jsonl")) if "reward" in r] for d in (many, one)]


@pytest.mark.parametrize(
    "processes, generation",
    [pytest.param(3, 2, marks=_EXT), pytest.param(4, 2, marks=_EXT)],  # default: below
)
def test_the_supervised_target_across_processes_gives_the_one_process_parameters(
    processes, generation, tmp_path
):
    # The supervised target (algorithm.sft_coef: the calculator environment's
    # demonstrations with every RL micro-batch, learner/supervised.py) across processes:
    # every training process draws the same demonstration batch and feeds its slice
    # (learner.Rows); the run ends with the one-process run's parameters (bit for bit with
    # one training process, within the two-trainer tolerance with two) and its sft_nll.
    sft = {"algorithm.sft_coef": 1.0, "algorithm.sft_batch": 4, "pipeline.mode": "stream_async"}
    sft |= {"environment.name": "calculator", "eval.num_problems": 0}
    rows, ref = _agent_job_like_one_process(processes, generation, sft, tmp_path)
    assert rows and [r["sft_nll"] for r in rows] == pytest.approx([r["sft_nll"] for r in ref])


def test_agents_and_the_supervised_target_across_three_processes(tmp_path):
    # The default case of both (the agent config across 3 processes): 1 generation + 2
    # training processes; scaffolds play through the generation process's endpoint, and
    # each training process feeds its slice of the demonstrations. The one-process run's
    # parameters within the two-trainer tolerance, its episodes' turns and its sft_nll.
    both = {"pipeline.rollout": "agents+full", "pipeline.mode": "stream_async"}
    both |= {"algorithm.sft_coef": 1.0, "algorithm.sft_batch": 4, "eval.num_problems": 0}
    rows, ref = _agent_job_like_one_process(3, 1, both, tmp_path)
    for key in ("episode_turns", "samples", "sft_nll"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-5), key


def test_learners_across_processes_give_the_one_process_parameters(tmp_path):
    # Several learners across processes (configs/learners.py:tiny: a GRPO learner with
    # dynamic sampling in stream_async and a PPO learner with a critic in stream_sync,
    # each a rank-8 LoRA adapter on one frozen base) on 1 generation + 2 training
    # processes: the generation process serves both learners' drivers from one service
    # with an adapter slot each, each learner trains on a training process of its own,
    # and each sends its adapters alone after its first version. Every learner ends with
    # the one-process run's parameters bit for bit, its rewards and consumed prompts.
    flags = {"eval.num_problems": 0}
    one, many = tmp_path / "one", tmp_path / "many"
    run = _run(_agent_cmd(one, flags, config="learners.py"))
    assert run.returncode == 0, run.stderr[-6000:]
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", "3", "-g", "1"]
    cmd = [*launcher, "--timeout_s", "240", "--", *_agent_cmd(many, flags, config="learners.py")]
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
