"""The bad-input corpus (tools/bench_bad_inputs.py): every case a clear error.

Configs, datasets, checkpoints and model files go through the real entry point
and must end with exit status 2 and one `error:` line naming the field or file,
without a traceback or a hang; hostile model output through the sandboxed
scorer must come back scored (or as a named timeout) and write nothing; hostile
or broken network peers must end in their named error and leak nothing; hostile or
broken HTTP clients of the endpoint get a clear 4xx and leave it serving.
"""

import importlib.util
import os
import pathlib
import sys
import tempfile

import forked_launches
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_bad_inputs",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "bench_bad_inputs.py"),
)
corpus = sys.modules["bench_bad_inputs"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(corpus)


def test_the_corpus_is_broad():
    kinds = {case.kind for case in corpus.CASES}
    assert len(corpus.CASES) >= 50 and kinds == {"launch", "reward", "network", "endpoint"}
    assert len({case.name for case in corpus.CASES}) == len(corpus.CASES)


# Every launch case takes launch's one error path (a process that starts, reads its
# inputs and ends with one `error:` line): a sample of them runs by default, the rest under
# `-m extended`. The rule messages are checked in-process by tests/config_test.py, the
# datasets' by tests/jsonl_dataset_test.py and tests/data_test.py, the checkpoints' by
# tests/checkpoint_test.py and tests/policy_test.py, the model files' by
# tests/loader_test.py; the sample keeps one of each kind of file through the real entry
# point. Model output, network peers and (in-process, tests/endpoint_test.py) HTTP
# clients all run.
_DEFAULT_LAUNCH_CASES = {
    "unknown field",
    "unknown flag",
    "missing config file",
    "config file with a syntax error",
    "advantage",
    "staleness 0",
    "min groups > prompts",
    "all instances reserved",
    "JSONL row not JSON",
    "a workdir whose only checkpoint is garbage",
    "model file truncated",
    "HF config.json not JSON",
}


def _marks(case):
    if case.kind == "endpoint" or (
        case.kind == "launch" and case.name not in _DEFAULT_LAUNCH_CASES
    ):
        return pytest.param(case, marks=pytest.mark.extended, id=case.name)
    return pytest.param(case, id=case.name)


def test_the_default_sample_names_real_cases():
    assert {case.name for case in corpus.CASES} >= _DEFAULT_LAUNCH_CASES


# The default sample's launches are forks of one Python (tests/forked_launches.py), with
# the corpus's arguments and environment (`launch_args`, `launch_env`), bounded by its
# 120 s each, and judged by `corpus.judge_launch`. The extended cases still run as
# spawned `python -m` processes (`corpus.run_case`), and tests/launch_test.py ends real
# `python -m streamrl_jax.launch` processes with status 2.


@pytest.fixture(scope="module")
def default_launches():
    """{case name: (outcome, detail)} of the default sample's launch cases."""
    # As the entry point's own restart leaves it (tests/launch_test.py).
    env = dict(corpus.launch_env(), GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    timeout_s = 120.0
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as tmp:
        cases = {
            case.name: case
            for case in corpus.CASES
            if case.kind == "launch" and case.name in _DEFAULT_LAUNCH_CASES
        }
        runs = {}
        for name, case in cases.items():
            root = tempfile.mkdtemp(prefix="case-", dir=tmp)
            out, err = os.path.join(root, "stdout"), os.path.join(root, "stderr")
            runs[name] = (corpus.launch_args(case, root), env, out, err)
        statuses = forked_launches.run(runs, timeout_s=timeout_s, cwd=corpus.REPO, env=env)
        return {
            name: corpus.judge_launch(
                cases[name], statuses[name], pathlib.Path(err).read_text(), timeout_s
            )
            for name, (_, _, _, err) in runs.items()
        }


@pytest.mark.parametrize("case", [_marks(case) for case in corpus.CASES])
def test_a_bad_input_is_a_clear_error(case, request):
    if case.kind == "launch" and case.name in _DEFAULT_LAUNCH_CASES:
        outcome, detail = request.getfixturevalue("default_launches")[case.name]
    else:
        outcome, detail = corpus.run_case(case, timeout_s=120.0)
    assert outcome == "clear", detail
