"""Many `python -m streamrl_jax.launch` cases that end before a run starts (a refused flag,
config, file or environment), run as forks of one Python: it imports what the entry point
imports (JAX, absl, the config, pipeline, model and task modules; no backend started)
once, then forks a child per case that runs `streamrl_jax.launch` as `python -m` does
(runpy, run_name="__main__": its flags parsed from that child's argv, in the case's
environment), its stdout and stderr in files, bounded by `timeout_s` as a process group of
its own. A spawned `python -m` paid the Python and JAX start-up again a case (3-13 s on 2
loaded cores).

A child ends as Python ends a program (a `SystemExit`'s status, a message or traceback
printed on stderr), its output flushed, and then leaves at once (`os._exit`): a Python
with JAX and the pipeline loaded takes 0.85 s to tear itself down, which is most of a
case (measured: tests/launch_test.py's 17 cases, 20.8 s -> 5.9 s). Real processes end
the same refusals in tests/launch_test.py (under the launcher) and in the extended cases
of tests/bad_inputs_test.py.
"""

import json
import subprocess
import sys

_ENTRY = """
import json, os, runpy, signal, sys, time, traceback
import jax, absl.app, absl.flags, absl.logging, ml_collections.config_flags, reasoning_gym
import streamrl_jax.config, streamrl_jax.console, streamrl_jax.errors, streamrl_jax.pipeline
import streamrl_jax.distributed.roles, streamrl_jax.model.loader, streamrl_jax.endpoint
import threading
from jax._src import xla_bridge
assert not xla_bridge._backends and threading.active_count() == 1  # safe to fork


def case(args, env, out, err):  # `python -m streamrl_jax.launch ARGS` in ENV; its status
    f = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, 1); os.close(f)
    if err == out:
        os.dup2(1, 2)
    else:
        f = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, 2); os.close(f)
    os.setsid()  # its own group: a hung case is killed whole
    os.environ.clear(); os.environ.update(env)
    sys.argv = ["-m", *args]  # runpy puts the module's path first, as `python -m`
    try:
        runpy.run_module("streamrl_jax.launch", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:  # as Python's own exit reads it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


cases, timeout_s = json.loads(sys.stdin.read())
statuses = {}
for name, (args, env, out, err) in cases.items():
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = case(args, env, out, err)
        import logging
        logging.shutdown(); sys.stdout.flush(); sys.stderr.flush()
        os._exit(status)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        statuses[name] = None  # a hang
    else:
        statuses[name] = os.waitstatus_to_exitcode(done[1])
print("STATUSES", json.dumps(statuses))
"""


def run(
    cases: dict[str, tuple[list[str], dict[str, str], str, str]],
    *,
    timeout_s: float,
    cwd: str,
    env: dict[str, str],
) -> dict[str, int | None]:
    """{case: exit status, None for a case that ran past `timeout_s`} of `cases`, each
    (launch arguments, environment, stdout path, stderr path: the same path for one file
    of both). `env` is the forking Python's: GLIBC_TUNABLES as the entry point's own
    restart leaves it (`launch.reexec_with_malloc_hugepages`), or a child would exec the
    forking Python's command line again."""
    proc = subprocess.run(
        [sys.executable, "-c", _ENTRY],
        input=json.dumps([cases, timeout_s]),
        capture_output=True,
        text=True,
        timeout=60 + timeout_s * len(cases),
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("STATUSES ", 1)[1])
