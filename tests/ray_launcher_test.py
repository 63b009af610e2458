"""`launch/ray_cluster.py`: the multi-controller program as Ray actors, on localhost.

Each case runs the launcher as a subprocess; without `--address` it starts its own Ray
on this machine (127.0.0.1) and stops it at the end. The 1 + 1 run is the real
`python -m streamrl_jax.launch` on `quickstart:tiny` (two steps, the multi-controller
tests' dense stand-in reward). The rejoin case runs a small program of 2 generation + 1
training processes that joins the JAX program through `roles.initialize` (the
coordination service on the training process, recoverable): generation process 0 kills
its own child process (its actor lives), generation process 1 kills its actor's worker
(Ray sees the actor die; the kernel kills its child), and both must come back with the
same process id through `--restart_generation`, each logging roles' rejoin line, before
the training process lets the run end. The same with the real pipeline, whose trainer
takes the restarted process back into its roster, is `extended`.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tomllib

import pytest
from child_env import checkout_env, launched_env
from support import launch_command

pytestmark = pytest.mark.processes  # the suite spreads these files out (conftest.py)

pytest.importorskip("ray")

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCHER = [sys.executable, str(REPO / "launch" / "ray_cluster.py")]


def _env() -> dict[str, str]:
    # The multi-controller tests' environment (their compiled programs); no usage reports
    # from a test's Ray.
    # (Its PYTHONPATH: a test's own program imports this checkout's package.)
    checkout = checkout_env()["PYTHONPATH"]
    return dict(launched_env(), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=checkout)


def _launch(flags: list[str], command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCHER, *flags, "--", *command],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=_env(),
    )


def _pipeline(workdir, **overrides) -> list[str]:
    flags = {"data.reward": "vowels", "eval.num_problems": 0, **overrides}
    # --verbosity=0: every process's INFO lines on its console, which the tests read
    return launch_command(
        workdir, ["--verbosity=0", *[f"--config.{k}={v}" for k, v in flags.items()]]
    )


def test_one_generation_and_one_training_process_run_end_to_end(tmp_path):
    run = _launch(["-n", "2", "-g", "1", "--timeout_s", "240"], _pipeline(tmp_path / "run"))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"^\[launch\] ray: 2 processes .* coordinator 127\.0\.0\.1:\d+$", out, re.M)
    assert re.search(r"^\[p0 gen\] .*process 0/2: generation", out, re.M), out[-6000:]
    assert re.search(r"^\[p1 train\] .*process 1/2: training", out, re.M), out[-6000:]
    assert re.search(r"^\[p1 train\] done: step 2,", out, re.M), out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "reward" in r] == [0, 1]


_REJOINING = """
import os, signal, time
import jax
jax.config.update("jax_num_cpu_devices", 1)
from streamrl_jax.distributed import roles

r = roles.initialize(roles.DistributedConfig.from_env())
me = r.process_id
print(f"ROLE {me} {r.role} rejoined={r.rejoined} actor={os.getppid()}", flush=True)
if r.role == "training":
    roles.publish(roles.RUN_STARTED_KEY, "{}")  # the run is under way from here on
    for k in r.generation_processes:
        roles.lookup(f"back/{k}", 90)
    print("ALL BACK", flush=True)
    roles.publish("done", "1")
else:
    roles.lookup(roles.RUN_STARTED_KEY, 60)
    if not r.rejoined:  # the first time: die mid-run
        time.sleep(1)  # the driver polls its output first (a dead actor's unpolled lines are lost)
        victim = os.getpid() if me == 0 else os.getppid()  # the child; the actor's worker
        os.kill(victim, signal.SIGKILL)
        time.sleep(60)
    roles.publish(f"back/{me}", "1")
    roles.lookup("done", 90)
roles.shutdown(20)
"""


@pytest.mark.extended  # the suite's budget: restarts run in multicontroller_test -m extended
def test_a_killed_generation_process_or_actor_is_restarted_and_rejoins(tmp_path):
    script, pids = tmp_path / "rejoining.py", tmp_path / "pids.json"
    script.write_text(_REJOINING)
    flags = ["-n", "3", "-g", "2", "--restart_generation", "2", "--restart_delay_s", "1"]
    flags += ["--timeout_s", "150", "--pids_file", str(pids)]
    run = _launch(flags, [sys.executable, str(script)])
    out = run.stdout
    assert run.returncode == 0, out[-6000:] + run.stderr[-3000:]
    assert "[launch] generation process 0 failed (rc -9); restarting it" in out, out[-6000:]
    assert "[launch] generation process 1 failed (its actor died" in out, out[-6000:]
    for i in (0, 1):  # the same process id, rejoining the program under way
        assert f"[p{i} gen] WARNING:absl:process {i}: rejoining a run under way" in out
    roles = re.findall(r"^\[p(\d) \w+\] ROLE \d (\w+) rejoined=(\w+) actor=(\d+)$", out, re.M)
    actors = {(i, rejoined): int(actor) for i, _, rejoined, actor in roles}
    assert sorted((i, role, rejoined) for i, role, rejoined, _ in roles) == [
        ("0", "generation", "False"),
        ("0", "generation", "True"),
        ("1", "generation", "False"),
        ("1", "generation", "True"),
        ("2", "training", "False"),
    ]
    assert actors["0", "False"] == actors["0", "True"]  # its actor lived: started again there
    assert actors["1", "False"] != actors["1", "True"]  # a new actor in its bundle
    assert json.loads(pids.read_text())["1"][3] == actors["1", "True"]
    assert "[p2 train] ALL BACK" in out


def test_a_failed_training_process_stops_the_others_with_its_code(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(
        textwrap.dedent("""
        import os, time
        if os.environ["STREAMRL_PROCESS_ID"] == "1":
            raise SystemExit(3)
        time.sleep(100)
        """)
    )
    # 1 generation + 1 training process (one actor fewer to start than 2 + 1): the
    # training process fails; the generation process, restartable, is stopped, not
    # restarted.
    flags = ["-n", "2", "-g", "1", "--restart_generation", "1", "--grace_s", "1"]
    run = _launch([*flags, "--timeout_s", "90"], [sys.executable, str(script)])
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[launch] process 1 failed (rc 3); stopping the others" in run.stdout
    assert "restarting" not in run.stdout


def test_without_ray_the_launcher_is_one_line_naming_the_pinned_install():
    path = REPO / "launch" / "ray_cluster.py"
    pin = re.search(r'^RAY_PIN = "([\d.]+)"', path.read_text(), re.M).group(1)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"ray[default]=={pin}" in extras["optional-dependencies"]["ray"]
    assert f"ray=={pin}" in extras["optional-dependencies"]["test"]  # the tests run in CI
    # `import ray` fails; launch/ on the path, as for the script (`python -c` in launch/)
    no_ray = "import runpy, sys; sys.modules['ray'] = None; "
    as_script = (
        f"sys.argv = [{str(path)!r}, '-n', '2']; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    as_module = "import ray_cluster"
    want = f'launch/ray_cluster.py needs Ray: pip install "ray[default]=={pin}"'
    for code, status in ((as_script, 2), (as_module, 1)):
        run = subprocess.run(
            [sys.executable, "-c", no_ray + code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=path.parent,
        )
        assert run.returncode == status, run.stderr
        lines = run.stderr.strip().splitlines()
        if status == 2:
            assert len(lines) == 1 and lines[0].startswith(f"error: {want}"), run.stderr
        else:  # imported: one ImportError, its message the same line
            assert lines[-1].startswith(f"ImportError: {want}"), run.stderr
            assert "During handling" not in run.stderr, run.stderr


# Long enough that the run is still under way when the restarted process has rejoined
# (tests/multicontroller_test.py's REJOIN_STEPS).
REJOIN_STEPS = 160


@pytest.mark.extended
def test_a_killed_generation_actor_rejoins_the_pipeline_through_ray(tmp_path):
    # 2 generation + 1 training process of the real pipeline, stream_async: once the
    # trainer has sent W_1, generation process 1's actor is SIGKILLed (its child dies
    # with it); the launcher starts the process again in a new actor in the same bundle,
    # the trainer's roster takes it back, and the run ends 0.
    pids = tmp_path / "pids.json"
    flags = ["-n", "3", "-g", "2", "--restart_generation", "1", "--timeout_s", "400"]
    command = _pipeline(tmp_path / "run", **{"pipeline.steps": REJOIN_STEPS})
    launcher = subprocess.Popen(
        [*LAUNCHER, *flags, "--pids_file", str(pids), "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=_env(),
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("[p2 train]") and "weights v1" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)[-6000:]
            time.sleep(0.2)
        actor = json.loads(pids.read_text())["1"][3]
        os.kill(actor, signal.SIGKILL)
        launcher.wait(timeout=420)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGINT)  # it stops its actors and its Ray
            launcher.wait(60)
    reader.join(10)
    out = "".join(lines)
    assert launcher.returncode == 0, out[-6000:]
    assert "[launch] generation process 1 failed (its actor died" in out, out[-6000:]
    assert re.search(r"^\[p2 train\] .*generation-1 rejoined \(roster epoch 2\)", out, re.M)
    assert re.search(r"^\[p1 gen\] .*generation-1: rejoined the run at batch", out, re.M)
    assert json.loads(pids.read_text())["1"][3] != actor
