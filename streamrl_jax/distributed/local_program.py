"""N processes of one command on this machine as one multi-controller program.

What `launch/local.py` (the command line) and the main job's stage processes
(`python -m streamrl_jax.launch --processes=stages`, docs/multicontroller.md) share:

* each child's environment (`child_env`): STREAMRL_COORDINATOR (127.0.0.1:<free port>),
  STREAMRL_NUM_PROCESSES, STREAMRL_PROCESS_ID, STREAMRL_GENERATION_PROCESSES,
  STREAMRL_SCORING_PROCESSES, STREAMRL_HOST=127.0.0.1 (`streamrl_jax.distributed.roles`
  reads them) and STREAMRL_AUTHKEY, a fresh random run secret unless the user set
  STREAMRL_AUTHKEY or STREAMRL_AUTHKEY_FILE (in the environment, which other users cannot
  read, never on a command line);
* `supervise`: the children's output relayed line by line (each child's own prefix),
  a failed child stops the others (SIGTERM to its process group, SIGKILL after the
  grace period) and the program exits with its code (128 + signal for a signal), a
  generation or scoring child may be restarted (it rejoins the run), a timeout bounds
  the whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    i: int,
    n: int,
    generation: int,
    coordinator: str,
    host: str = "127.0.0.1",
    scoring: int = 0,
) -> dict[str, str]:
    """The variables that make a child process `i` of the program, on top of its own
    environment (`streamrl_jax.distributed.roles` reads them); `launch/ray_cluster.py`
    gives its children the same."""
    return {
        "STREAMRL_COORDINATOR": coordinator,
        "STREAMRL_NUM_PROCESSES": str(n),
        "STREAMRL_PROCESS_ID": str(i),
        "STREAMRL_GENERATION_PROCESSES": str(generation),
        "STREAMRL_SCORING_PROCESSES": str(scoring),
        "STREAMRL_HOST": host,
        "PYTHONUNBUFFERED": "1",
    }


def role_name(i: int, n: int, generation: int, scoring: int = 0) -> str:
    """Process i's role as the launchers print it: gen, train or score."""
    return "gen" if i < generation else "score" if i >= n - scoring else "train"


def run_secret() -> str | None:
    """A fresh run secret, or None where the user set one (`STREAMRL_AUTHKEY` or
    `STREAMRL_AUTHKEY_FILE`), which the children then inherit."""
    if os.environ.get("STREAMRL_AUTHKEY") or os.environ.get("STREAMRL_AUTHKEY_FILE"):
        return None
    return secrets.token_hex(32)


def child_env(
    i: int, n: int, generation: int, coordinator: str, authkey: str | None, scoring: int = 0
) -> dict[str, str]:
    env = dict(os.environ)
    if authkey is not None:
        env["STREAMRL_AUTHKEY"] = authkey
    env.update(process_env(i, n, generation, coordinator, scoring=scoring))
    return env


def exit_code(rc: int) -> int:
    """A child's exit status as a shell reports it (128 + signal for a signal)."""
    return 128 - rc if rc < 0 else rc


def stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every live child's process group, SIGKILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def _pump(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    for line in iter(proc.stdout.readline, b""):
        with lock:
            sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
            sys.stdout.flush()


def supervise(
    commands: Sequence[Sequence[str]],
    generation: int,
    *,
    prefixes: Sequence[str],
    affinity: Sequence[Sequence[int] | None] | None = None,
    grace_s: float = 3.0,
    timeout_s: float = 0.0,
    restart_generation: int = 0,
    restart_delay_s: float = 2.0,
    pids_file: str = "",
    port: int = 0,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    scoring: int = 0,
    restart_scoring: int = 0,
) -> int:
    """Runs child i = `commands[i]` as process i of an n-process program (the first
    `generation` generate, the last `scoring` score) until every child exits; returns
    the program's exit status.

    Args:
      prefixes: each child's output prefix ("" relays its lines as they are).
      affinity: each child's CPUs (`os.sched_setaffinity` before it starts; None: all).
      grace_s: SIGTERM to SIGKILL when the others are stopped (a checkpoint on signal
        needs its seconds).
      timeout_s: bound on the whole run (exit 124); 0 = none.
      restart_generation: restart a generation child that fails while a training child
        still runs (the same command and environment: it rejoins), at most this often.
      restart_scoring: the same for a scoring child (`scoring`: the last children).
      pids_file: write {process id: [pid, role]} here once every child is started.
      port: the coordinator's port (0: a free one).
      say: where the supervisor's own lines go.
    """
    n = len(commands)
    coordinator = f"127.0.0.1:{port or free_port()}"
    authkey = run_secret()  # None: children inherit the key the user set
    lock = threading.Lock()
    pumps: list[threading.Thread] = []

    def start(i: int) -> subprocess.Popen:
        cpus = affinity[i] if affinity is not None else None
        proc = subprocess.Popen(
            list(commands[i]),
            env=child_env(i, n, generation, coordinator, authkey, scoring),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a stop reaches its children too
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        pump = threading.Thread(target=_pump, args=(proc, prefixes[i], lock), daemon=True)
        pump.start()
        pumps.append(pump)
        return proc

    def write_pids() -> None:
        if pids_file:
            pids = {i: [p.pid, role_name(i, n, generation, scoring)] for i, p in enumerate(procs)}
            with open(pids_file + ".tmp", "w", encoding="utf-8") as f:
                json.dump(pids, f)
            os.replace(pids_file + ".tmp", pids_file)

    procs = [start(i) for i in range(n)]
    write_pids()
    restarts = {"gen": restart_generation, "score": restart_scoring}

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    code = 0
    try:
        while [p.poll() for p in procs].count(None):  # poll every child: sets returncode
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
            training = any(p.poll() is None for p in procs[generation : n - scoring])
            role = role_name(failed[0][0], n, generation, scoring) if failed else ""
            if failed and restarts.get(role, 0) > 0 and training:
                i, rc = failed[0]
                restarts[role] -= 1
                what = {"gen": "generation", "score": "scoring"}[role]
                say(
                    f"[launch] {what} process {i} failed (rc {rc}); restarting it in "
                    f"{restart_delay_s:.0f} s ({restarts[role]} restart(s) left)"
                )
                time.sleep(restart_delay_s)
                procs[i] = start(i)
                write_pids()
                continue
            if failed:
                i, rc = failed[0]
                say(f"[launch] process {i} failed (rc {rc}); stopping the others")
                code = exit_code(rc)
                break
            if deadline is not None and time.monotonic() > deadline:
                say(f"[launch] timeout after {timeout_s:.0f} s; stopping")
                code = 124
                break
            time.sleep(0.1)
        else:
            failed = [p.returncode for p in procs if p.returncode]
            code = exit_code(failed[0]) if failed else 0
    except KeyboardInterrupt:
        say("[launch] interrupted; stopping")
        code = 130
    finally:
        stop(procs, grace_s)
        for pump in pumps:
            pump.join(2.0)
        signal.signal(signal.SIGTERM, previous)
    return code
