"""`python -m streamrl_jax.launch`: a user's mistake is one line naming it, exit status 2.

Each case runs the real entry point in a subprocess (flags are parsed there, at
import) and checks the whole of stderr: no traceback, one `error:` line that
names the field, flag or file.
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "unknown field": (["--config.pipeline.foo=1"], "no config field pipeline.foo (pipeline has:"),
    "unknown section": (["--config.pipelin.steps=1"], "no config field pipelin.steps"),
    "bad type": (["--config.pipeline.steps=abc"], "--config.pipeline.steps=abc"),
    "unknown flag": (["--bogus"], "Unknown command line flag 'bogus'"),
    "missing config file": (["--config=/nonexistent/cfg.py"], "/nonexistent/cfg.py"),
    "unknown variant": (["--config=configs/quickstart.py:bogus"], "unknown variant 'bogus'"),
    "registry name": (["--config.algorithm.advantage=bogus"], "algorithm.advantage='bogus'"),
    "numeric range": (["--config.eval.num_problems=-3"], "eval.num_problems must be >= 0"),
    "cross-field": (["--config.data.eval_seed=1"], "data.train_seed must differ"),
    "missing model file": (["--config.model.source=/nonexistent.gguf"], "/nonexistent.gguf"),
}
# A multi-process start (the STREAMRL_* environment) with a bad run key or environment.
_PROCESS = {
    "STREAMRL_NUM_PROCESSES": "2",
    "STREAMRL_PROCESS_ID": "1",
    "STREAMRL_COORDINATOR": "127.0.0.1:1",
}
ENV_CASES = {
    "short run key": (
        {**_PROCESS, "STREAMRL_AUTHKEY": "short"},
        "STREAMRL_AUTHKEY: the run secret has 5 bytes; at least 16",
    ),
    "no run key": ({**_PROCESS, "STREAMRL_AUTHKEY": ""}, "no run key"),
    "missing key file": (
        {**_PROCESS, "STREAMRL_AUTHKEY_FILE": "/nonexistent.key"},
        "STREAMRL_AUTHKEY_FILE=/nonexistent.key: cannot open the key file",
    ),
    "bad process id": ({**_PROCESS, "STREAMRL_PROCESS_ID": "x"}, "STREAMRL_PROCESS_ID='x'"),
}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(ENV_CASES))
def test_a_user_mistake_is_one_line_and_exit_status_2(case, tmp_path):
    args, message = CASES.get(case, ([], None))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("STREAMRL_AUTHKEY", None)
    env.pop("STREAMRL_AUTHKEY_FILE", None)
    if case in ENV_CASES:
        extra, message = ENV_CASES[case]
        env.update(extra)
    run = subprocess.run(
        [sys.executable, "-m", "streamrl_jax.launch", f"--workdir={tmp_path}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]


def test_launch_restarts_itself_with_malloc_hugepages_once():
    code = (
        "import os; from streamrl_jax import launch; "
        "print(os.environ.get('GLIBC_TUNABLES')); launch.reexec_with_malloc_hugepages()"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["None", "glibc.malloc.hugetlb=1"], out.stderr[-2000:]
    env["STREAMRL_MALLOC_HUGEPAGES"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["None"], out.stderr[-2000:]
