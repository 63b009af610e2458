"""The agent job across processes (docs/multicontroller.md, "Dynamic sampling, the
curriculum and agents across processes"; docs/endpoint.md; docs/trainer.md, the
supervised target): `configs/agent.py:tiny` against the same command in one process, on
real processes on localhost (launch helpers: `launched_runs.py`).

Every case launches 2-4 processes and a one-process run (~70 s on 2 shared cores). By
default: the agent job with the supervised target on 1 generation + 2 training
processes, and multi-agent episodes (`configs/multi_agent.py:tiny`) on 1 + 1; the other
topologies of each are `-m extended`.
"""

import sys

import numpy as np
import pytest
from launched_runs import _EXT, REPO, _agent_cmd, _assert_params_match, _run

from streamrl_jax import pipeline as run_lib
from streamrl_jax.metrics import read_jsonl

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)


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


def _agent_job_like_one_process(processes, generation, flags, tmp_path, config="agent.py"):
    """`configs/<config>:tiny` (the agent job's by default) with `flags` (and 2 held-out
    problems) in one process and in `processes` (`generation` generating): the
    parameters alike (bit for bit with one training process, within the two-trainer
    tolerance with more). Returns both runs' metrics rows (these processes', then the
    one process's)."""
    flags = {"eval.num_problems": 2, **flags}
    one, many = tmp_path / "one", tmp_path / "many"
    run = _run(_agent_cmd(one, flags, config))
    assert run.returncode == 0, run.stderr[-6000:]
    launcher = [sys.executable, str(REPO / "launch" / "local.py"), "-n", str(processes)]
    job = _agent_cmd(many, flags, config)
    cmd = [*launcher, "-g", str(generation), "--timeout_s", "240", "--", *job]
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


def test_multi_agent_episodes_across_processes_give_the_one_process_parameters(tmp_path):
    # configs/multi_agent.py:tiny (a solver and a verifier, the run's one policy in both
    # roles: pipeline/rollouts/multi_agent.py) on 1 generation + 1 training process: the
    # generation process plays every role's turns in its own conversation and hands on a
    # sample per role; the run ends with the one-process run's parameters bit for bit and
    # its per-role returns and turns. (The tests' vowel reward scores the solver's answers,
    # so the roles' returns vary.)
    flags = {"pipeline.mode": "stream_async"}
    rows, ref = _agent_job_like_one_process(2, 1, flags, tmp_path, config="multi_agent.py")
    keys = ("samples", "role/solver/return", "role/verifier/return", "role/solver/turns")
    for key in keys:
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-6), key
    assert any(r["role/solver/return"] > 0 for r in rows)
    assert all(r["samples"] == 8 and r["multi_agent/unacted"] == 0 for r in rows)
    held_out = [
        r for r in read_jsonl(str(tmp_path / "many" / "metrics.jsonl")) if "eval/accuracy" in r
    ]
    assert held_out  # the solver's held-out episodes, played with the verifier
