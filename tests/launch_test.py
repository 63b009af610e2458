"""`python -m streamrl_jax.launch`: a user's mistake is one line naming it, exit status 2;
a run's console is the summary, the progress line and the closing lines.

Each case runs the real entry point in a process of its own (flags are parsed there,
at import: forked children of one Python that imported the entry point's modules,
tests/forked_launches.py) and checks the whole of stderr: no traceback, one `error:` line that
names the field, flag or file. Settings that do not run across processes are
refused the same way on every process of a multi-controller program, before it
joins (`config.check`), so none waits for a coordinator. The entry run
(the `:tiny` config, two steps) checks what the console holds and what the log
file keeps.
"""

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import types

import forked_launches
import jax
import pytest
from child_env import launched_env
from support import launch_command

# launch/local.py's program: the children's environment
from streamrl_jax.distributed import local_program as local

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
    "compile cache": (["--compile_cache=/proc/none/jax"], "--compile_cache=/proc/none/jax: cannot"),
    "workdir": (["--workdir=/proc/none/run"], "--workdir=/proc/none/run: cannot write"),
    "stages refused": (
        ["--processes=stages", "--config.pipeline.mode=colocated"],
        "--processes=stages: pipeline.mode='colocated' shares one device set",
    ),
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


# The mistakes' runs of the entry point are forks of one Python (tests/forked_launches.py).
# The default refused multi-process setting's processes are forked there too; real
# `python -m streamrl_jax.launch` processes end with status 2 under the launcher in
# test_launch_local_ends_a_refused_setting_with_status_2 (and, side by side, in the
# extended cases of test_a_setting_refused_across_processes_is_one_line_on_every_process).


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    """{case: (exit status, stdout and stderr)} of every user-mistake case."""
    base = dict(os.environ, JAX_PLATFORMS="cpu")
    base.pop("STREAMRL_AUTHKEY", None)
    base.pop("STREAMRL_AUTHKEY_FILE", None)
    # As the entry point's own restart leaves it (test_launch_restarts_itself_...).
    base["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    cases = {}
    for case in sorted(CASES) + sorted(ENV_CASES):
        # The environment cases run quickstart:tiny, a config that works across processes
        # (one the processes refuse stops before the run key is read).
        args, _ = CASES.get(case, (["--config=configs/quickstart.py:tiny"], None))
        tmp = tmp_path_factory.mktemp("mistake")
        env = dict(base, XDG_CACHE_HOME=str(tmp / "cache"))
        env.update(ENV_CASES.get(case, ({}, None))[0])
        out = str(tmp / "output.txt")
        cases[case] = ([f"--workdir={tmp}", *args], env, out, out)
    # The default refused multi-process setting: every process of the program, each in
    # the environment launch/local.py gives it (they refuse before joining, so one at a
    # time is how they run too).
    for case in sorted(_DEFAULT_CASES):
        n, g, flags, _ = PROCESS_CASES[case]
        coordinator, tmp = f"127.0.0.1:{local.free_port()}", tmp_path_factory.mktemp("refused")
        for i in range(n):
            child = local.child_env(i, n, g, coordinator, "ab" * 32)
            env = dict(base, XDG_CACHE_HOME=str(tmp / "cache"), **child)
            args = [f"--workdir={tmp}", "--config=configs/quickstart.py:tiny", *flags]
            out = str(tmp / f"output-{i}.txt")
            cases[f"{case} [p{i}]"] = (args, env, out, out)
    statuses = forked_launches.run(cases, timeout_s=120, cwd=REPO, env=base)
    return {c: (statuses[c], pathlib.Path(out).read_text()) for c, (_, _, out, _) in cases.items()}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(ENV_CASES))
def test_a_user_mistake_is_one_line_and_exit_status_2(case, mistakes):
    message = CASES[case][1] if case in CASES else ENV_CASES[case][1]
    status, stderr = mistakes[case]
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    # Pinned to one core (taskset), "--processes=stages" also names that reason first.
    errors = [re.sub(r"this process may use \d+ core; ", "", e) for e in errors]
    assert len(errors) == 1 and message in errors[0], stderr[-3000:]


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


_PARTIAL = [
    "--config.pipeline.rollout=partial",
    "--config.pipeline.partial_budget_tokens=8",
    "--config.pipeline.max_lag=2",
]
# A refused multi-process setting (on quickstart:tiny, 4 prompts a step, micro-batches of
# 2 groups): (processes, generation processes, flags, what the one line names).
PROCESS_CASES = {
    "colocated": (2, 1, ["--config.pipeline.mode=colocated"], "pipeline.mode='colocated'"),
    "3 training processes": (4, 1, [], "3 training processes must divide pipeline.micro_batch"),
    "elastic, no generation process left": (
        2,
        1,
        ["--config.scheduling.elastic_reserved=1"],
        "scheduling.elastic_reserved=1: across processes",
    ),
}
_DEFAULT_CASES = {"elastic, no generation process left"}  # the others: -m extended


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "SLURM_"))}
    return dict(env, JAX_PLATFORMS="cpu")


@pytest.mark.parametrize(
    "case",
    [
        c if c in _DEFAULT_CASES else pytest.param(c, marks=pytest.mark.extended)
        for c in PROCESS_CASES
    ],
)
def test_a_setting_refused_across_processes_is_one_line_on_every_process(case, tmp_path, request):
    n, g, flags, message = PROCESS_CASES[case]
    if case in _DEFAULT_CASES:  # forked from the mistakes' Python (`mistakes`)
        runs = request.getfixturevalue("mistakes")
        results = [runs[f"{case} [p{i}]"] for i in range(n)]
    else:  # real processes, side by side
        results = _refusing_processes(n, g, flags, tmp_path)
    for i, (status, out) in enumerate(results):
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert status == 2, f"process {i}: {out[-3000:]}"
        assert "Traceback" not in out, f"process {i}: {out[-3000:]}"
        assert len(errors) == 1 and message in errors[0], f"process {i}: {out[-3000:]}"


def _refusing_processes(n, g, flags, tmp_path) -> list[tuple[int, str]]:
    """(exit status, output) of each of the `n` processes of a program started with
    `flags`, each a `python -m streamrl_jax.launch` of its own."""
    coordinator, authkey = f"127.0.0.1:{local.free_port()}", "ab" * 32
    procs = []
    for i in range(n):  # the environment launch/local.py gives each child
        child = local.child_env(i, n, g, coordinator, authkey)
        env = _clean_env() | {k: v for k, v in child.items() if os.environ.get(k) != v}
        procs.append(
            subprocess.Popen(
                launch_command(tmp_path, flags),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:  # a process that did not refuse: stop it and its children
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]


def test_launch_local_ends_a_refused_setting_with_status_2(tmp_path):
    # Through the launcher: it stops the others at the first child's exit, so a slower
    # child may be stopped before it prints its own (identical) line.
    n, g, flags, message = PROCESS_CASES["colocated"]
    run = subprocess.run(
        [sys.executable, "launch/local.py", "-n", str(n), "-g", str(g), "--timeout_s", "240"]
        + ["--", *launch_command(tmp_path, flags)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=_clean_env(),
    )
    assert run.returncode == 2, run.stdout[-3000:]
    assert "Traceback" not in run.stdout, run.stdout[-3000:]
    errors = [line for line in run.stdout.splitlines() if re.match(r"\[p\d+ \w+\] error:", line)]
    assert errors and all(message in line for line in errors), run.stdout[-3000:]
    children = [line.split("]")[0] for line in errors]
    assert len(set(children)) == len(children) and set(children) <= {"[p0 gen", "[p1 train"}


def test_the_console_is_a_summary_and_a_progress_line_the_log_file_keeps_the_rest(tmp_path):
    # The suite's compile cache (conftest.py): the tiny model's programs are the in-process
    # runs', and with pipeline.deterministic (one decode shape) those of
    # multicontroller_test's one-process reference run.
    workdir, cache = tmp_path / "run", jax.config.jax_compilation_cache_dir
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl_jax.launch",
            "--config=configs/quickstart.py:tiny",
            f"--workdir={workdir}",
            "--config.log.progress=True",  # :tiny turns it off
            "--config.pipeline.deterministic=True",
            f"--compile_cache={cache}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        # As a user runs it: no JAX_PLATFORMS. The test extra installs libtpu, so a search
        # that tried a TPU here would print libtpu's start-up errors (checked below).
        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    console = run.stdout + run.stderr
    for probe in ("host bounds", "worker hostname", "libtpu", "backend 'tpu'", "TPU"):
        assert probe not in console, console
    lines = console.splitlines()
    assert lines[0].startswith("streamrl_jax: model tiny, grpo, stream_async"), console
    for output in ("log.txt", "metrics.jsonl", "tensorboard", "trace.json"):
        assert str(workdir / output) in console, console
    assert f"compile cache {cache}" in console, console
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"], console
    assert all("reward " in line and " s/step" in line for line in steps), console
    assert any(line.startswith("done: step 2,") for line in lines), console
    assert "held-out accuracy: 0.000 (step 0)" in console  # the tiny model never answers
    # No INFO line (absl's "I1127 ..." or the console's "INFO ..."), no config dump.
    assert not [line for line in lines if re.match(r"I\d{4} |INFO ", line)], console
    assert "pipeline.mode" not in console and "ExperimentConfig" not in console
    log = (workdir / "log.txt").read_text()
    assert log.startswith("==== ") and "] config:" in log
    assert "pipeline.mode='stream_async'" in log and "data.train_size=200" in log
    assert re.search(r"^I\d{4} .*weight_sync: version 0,", log, re.M), log[-3000:]
    assert "step 1/2" not in log  # the progress line is the console's
    assert os.listdir(cache)  # the cache holds compiled programs
    assert "JAX platforms: cpu" in log and "backend 'tpu'" not in log


def test_jax_platforms_leave_out_a_tpu_that_is_not_attached(tmp_path, monkeypatch):
    from streamrl_jax import platforms

    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # the VFIO control node: no device group, no TPU
    monkeypatch.setattr(platforms, "TPU_NODES", (f"{dev}/accel[0-9]*", f"{dev}/vfio/[0-9]*"))
    gpus = (("cuda", "jax-cuda", f"{dev}/nvidia[0-9]*"), ("rocm", "jax-rocm", f"{dev}/kfd"))
    monkeypatch.setattr(platforms, "GPUS", gpus)
    assert platforms.jax_platforms({}) == "cpu"
    # A GPU's node without JAX's plugin for it (none is installed here): still the CPU only
    (dev / "nvidia0").touch()
    assert platforms.jax_platforms({}) == "cpu"
    # With its plugin (JAX's package name), the GPU first; ROCm's has no node here
    names = ("jax_cuda12_plugin", "jax-rocm7-plugin")
    plugins = [types.SimpleNamespace(metadata={"Name": n}) for n in names]
    monkeypatch.setattr(platforms.importlib.metadata, "distributions", lambda: plugins)
    assert platforms.jax_platforms({}) == "cuda,cpu"
    # What the user names, and an attached TPU, are JAX's to search
    assert platforms.jax_platforms({"JAX_PLATFORMS": "cpu"}) is None
    assert platforms.jax_platforms({"JAX_FORCE_TPU_INIT": "1"}) is None
    (dev / "vfio" / "0").touch()
    assert platforms.jax_platforms({}) is None
    (dev / "vfio" / "0").unlink()
    (dev / "accel0").touch()
    assert platforms.jax_platforms({}) is None


def test_a_compile_cache_from_the_environment_gets_jaxs_file_lock(tmp_path):
    # Processes that share JAX_COMPILATION_CACHE_DIR (a multi-process run, the suite's
    # workers and the processes they launch) read each other's entries: JAX writes them in
    # place, so its file lock (on with a size bound) must be on there too.
    code = (
        "import jax; from absl import flags; from streamrl_jax import launch; "
        "flags.FLAGS(['launch']); "
        "print(launch._compile_cache(True), jax.config.jax_compilation_cache_max_size)"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_MAX_SIZE"}
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
        cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == [str(tmp_path), str(1 << 30)]


def test_an_entry_without_an_access_time_is_given_one_so_later_writes_succeed(tmp_path):
    # A process whose cache has no size bound writes entries without JAX's access-time
    # file; with a bound, JAX reads every entry's before each write (to evict), so from
    # then on every write fails: `heal` (run by launch and serve) gives them one.
    from jax._src.lru_cache import LRUCache

    from streamrl_jax.distributed import compile_cache

    (tmp_path / "jit_f-0-cache").write_bytes(b"written without a size bound")
    cache = LRUCache(str(tmp_path), max_size=1 << 20)
    with pytest.raises(FileNotFoundError, match="jit_f-0-atime"):
        cache.put("jit_g-1", b"a program")
    assert compile_cache.heal(str(tmp_path)) == 1
    cache.put("jit_g-1", b"a program")
    assert cache.get("jit_g-1") == b"a program"
    assert compile_cache.heal(str(tmp_path)) == 0


def _tiny_config(**overrides):
    from streamrl_jax import config as config_lib

    spec = importlib.util.spec_from_file_location("q", os.path.join(REPO, "configs/quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("tiny")
    for key, value in overrides.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    return config_lib.from_config_dict(cfg.to_dict())


def test_stage_plan_runs_two_processes_only_where_they_run_and_pay():
    from streamrl_jax.errors import UserError
    from streamrl_jax.launch import stage_plan

    tiny, big = _tiny_config(), _tiny_config(**{"model.source": "smollm2"})
    assert stage_plan(big, "stages", [0, 1], accelerator=False) == (
        True,
        "generation on CPUs [0], training on CPUs [1]",
    )
    stages, why = stage_plan(big, "auto", [0, 1], accelerator=False)
    assert not stages and "2 cores (on 2 the stages measured slower" in why
    assert stage_plan(big, "auto", [0, 1, 2, 3], False)[0]
    assert stage_plan(big, "auto", list(range(16)), False)[1].endswith(
        "CPUs [8, 9, 10, 11, 12, 13, 14, 15]"
    )
    assert stage_plan(big, "one", [0, 1], False) == (False, "--processes=one")
    assert stage_plan(tiny, "stages", [0, 1], False)[0]  # asked for: the tiny model too
    for cfg, cpus, acc, why in (
        (tiny, [0, 1], False, "the tiny model"),
        (big, [0], False, "this process may use 1 core"),
        (big, [0, 1, 2, 3], True, "an accelerator is attached"),
        (
            _tiny_config(**{"model.source": "smollm2", "pipeline.mode": "colocated"}),
            [0, 1, 2, 3],
            False,
            "colocated",
        ),
    ):
        stages, reason = stage_plan(cfg, "auto", cpus, acc)
        assert not stages and why in reason, reason
        if why != "the tiny model":
            with pytest.raises(UserError, match=f"--processes=stages: .*{why}"):
                stage_plan(cfg, "stages", cpus, acc)


@pytest.mark.extended  # the suite's budget: the stage plan runs in the cases above it
def test_stage_processes_run_the_main_job_pinned_apart(tmp_path):
    # --processes=stages: this command as a 2-process program, each process pinned to its
    # half of the cores; the training process speaks, the run ends as one process's would.
    workdir = tmp_path / "run"
    run = subprocess.run(
        [*launch_command(workdir, ["--processes=stages"])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=launched_env(),
    )
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-4000:]
    assert "stages as 2 pinned processes: generation on CPUs" in console, console[-4000:]
    assert any(line.startswith("done: step 2,") for line in console.splitlines()), console
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [0, 1]
    cpus = {}
    for role in ("p0-generation", "p1-training"):
        log = (workdir / f"log.{role}.txt").read_text()
        cpus[role] = set(json.loads(re.search(r"CPUs this process may use: (\[[\d, ]*\])", log)[1]))
    assert cpus["p0-generation"] and cpus["p1-training"]
    assert not cpus["p0-generation"] & cpus["p1-training"]
    assert cpus["p0-generation"] | cpus["p1-training"] == set(os.sched_getaffinity(0))
