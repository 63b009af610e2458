"""The environments of the child processes tests start: a support module that imports
nothing heavy, so the test modules whose functions children import (shard_sync_test's
`make_params`, distributed_transport_test's `make_samples`) can use it without starting
support's trainer and engine modules in every child (5.7 s -> 2.9 s of a child's start-up
CPU, measured)."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launched_env() -> dict[str, str]:
    """The environment of the processes a test launches (`python -m streamrl_jax.launch`
    under a launcher): this one's without the multi-process variables (the launcher sets
    them), CPU only, and the suite's compile cache (`conftest.py`), whose programs the
    in-process tests have compiled, under the package's own cache settings
    (`compile_cache.SETTINGS`): every program is written, however fast it compiled, so a
    launched process reads the small programs its siblings and earlier launches compiled
    (with a 0.5 s floor each process compiled ~60 of them again: a warm quickstart:tiny
    process at the tests' XLA flags took 18.2 CPU-s against 12.4 s, measured)."""
    cache = os.environ.get("STREAMRL_TEST_JAX_CACHE", os.path.join(ROOT, ".pytest_cache", "jax"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMRL_", "SLURM_"))}
    return dict(
        env,
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        JAX_COMPILATION_CACHE_DIR=cache,
    )


def checkout_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child Python that imports this checkout's
    packages (`streamrl_jax`, `streamrl_bench`) and the test modules (tests/) ahead of
    any installed copy: on its PYTHONPATH, the ordinary way a child finds them."""
    path = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **overrides)


def start_serve(workdir, name: str, token: str, flags: list[str], **env: str):
    """`python -m streamrl_jax.serve` with `flags` on any free loopback port, the bearer
    token `token`, its log in `workdir/NAME.log`, `env` added to its environment:
    (process, its ready file, its log)."""
    ready = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "streamrl_jax.serve", "--port=0", f"--ready_file={ready}", *flags]
    env = dict(launched_env(), STREAMRL_ENDPOINT_TOKEN=token, **env)
    log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, ready, log


def stop_serve(proc, log, timeout: float = 60.0) -> int:
    """A server `start_serve` started, stopped as an operator does (SIGTERM): its exit
    code, its log closed."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    finally:
        log.close()


def served_url(proc, ready, timeout: float = 180.0) -> str:
    """The base URL (`.../v1`) a server `start_serve` started listens on, once it does."""
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the server did not listen in time"
        time.sleep(0.2)
    return json.loads(ready.read_text())["url"]
