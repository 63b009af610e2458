"""Runs N processes of one command on this machine as one multi-controller program.

    python launch/local.py -n 2 --generation_processes 1 [--pin] -- \
        python -m my.entry --flag=value

Each child gets the environment `streamrl_jax.distributed.roles` reads:
STREAMRL_COORDINATOR (127.0.0.1:<free port>), STREAMRL_NUM_PROCESSES,
STREAMRL_PROCESS_ID, STREAMRL_GENERATION_PROCESSES, STREAMRL_HOST=127.0.0.1,
and STREAMRL_AUTHKEY (a fresh random run secret, unless STREAMRL_AUTHKEY or
STREAMRL_AUTHKEY_FILE is set already; in the environment, which other users
cannot read, never on a command line). Child
output is streamed line by line, prefixed `[p<id> <role>]`. `--pin` runs
child i under `taskset -c <cpu i mod #cpus>` (the honest CPU stand-in for
separate hardware, DESIGN.md §5).

If a child fails (non-zero exit or a signal), every other child gets SIGTERM
and, after `--grace_s`, SIGKILL (JAX catches SIGTERM); the launcher exits with
the first failing child's code (128 + signal for a signal). `--timeout_s`
bounds the whole run (exit 124). Children that exit 0 early are left be.
`--pids_file PATH` writes `{process id: [pid, role]}` once every child is started
(each child leads its own process group), e.g. for `tools/fault_drill.py --processes`.

`--restart_generation K`: a generation child that fails while a training child is
still running is started again (the same command and environment, so the same
process id: it rejoins the run, docs/multicontroller.md "Losing a process"), at most
K times over the run, `--restart_delay_s` after its failure; the others keep running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    i: int, n: int, generation: int, coordinator: str, host: str = "127.0.0.1"
) -> dict[str, str]:
    """The variables that make a child process `i` of the program, on top of its own
    environment (`streamrl_jax.distributed.roles` reads them); `launch/ray_cluster.py`
    gives its children the same."""
    return {
        "STREAMRL_COORDINATOR": coordinator,
        "STREAMRL_NUM_PROCESSES": str(n),
        "STREAMRL_PROCESS_ID": str(i),
        "STREAMRL_GENERATION_PROCESSES": str(generation),
        "STREAMRL_HOST": host,
        "PYTHONUNBUFFERED": "1",
    }


def run_secret() -> str | None:
    """A fresh run secret, or None where the user set one (`STREAMRL_AUTHKEY` or
    `STREAMRL_AUTHKEY_FILE`), which the children then inherit."""
    if os.environ.get("STREAMRL_AUTHKEY") or os.environ.get("STREAMRL_AUTHKEY_FILE"):
        return None
    return secrets.token_hex(32)


def child_env(
    i: int, n: int, generation: int, coordinator: str, authkey: str | None
) -> dict[str, str]:
    env = dict(os.environ)
    if authkey is not None:
        env["STREAMRL_AUTHKEY"] = authkey
    env.update(process_env(i, n, generation, coordinator))
    return env


def _pump(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    for line in iter(proc.stdout.readline, b""):
        with lock:
            sys.stdout.write(f"{prefix} {line.decode(errors='replace')}")
            sys.stdout.flush()


def exit_code(rc: int) -> int:
    """A child's exit status as a shell reports it (128 + signal for a signal)."""
    return 128 - rc if rc < 0 else rc


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every live child's process group, SIGKILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def program_parser(doc: str, pids: str) -> argparse.ArgumentParser:
    """The flags every launcher of the program takes (the process counts, the coordinator
    port, stopping, restarts, the pids file, the command after `--`); `doc`: the
    launcher's module docstring, `pids`: what its pids file holds for each process."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("-g", "--generation_processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument("--grace_s", type=float, default=3.0)
    parser.add_argument("--timeout_s", type=float, default=0.0, help="0: no limit")
    parser.add_argument(
        "--pids_file",
        default="",
        help=f"write {{process id: {pids}}} here as JSON (drills, supervisors)",
    )
    parser.add_argument(
        "--restart_generation",
        type=int,
        default=0,
        help="restart a failed generation process (it rejoins the run), at most this many times",
    )
    parser.add_argument("--restart_delay_s", type=float, default=2.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    return parser


def parse_program(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the command; a usage error (exit status 2) for impossible counts."""
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    n, g = args.num_processes, args.generation_processes
    if n < 2 or not 1 <= g <= n - 1:
        parser.error(f"need num_processes >= 2 and 1 <= generation_processes <= {n - 1}")
    return args, command


def main(argv: list[str] | None = None) -> int:
    parser = program_parser(__doc__, "[pid, role]")
    parser.add_argument("--pin", action="store_true", help="taskset each child to one core")
    args, command = parse_program(parser, argv)
    n, g = args.num_processes, args.generation_processes
    if args.pin and shutil.which("taskset") is None:
        parser.error("--pin needs taskset (util-linux)")

    coordinator = f"127.0.0.1:{args.port or free_port()}"
    authkey = run_secret()  # None: children inherit the key the user set
    cpus = sorted(os.sched_getaffinity(0))
    lock = threading.Lock()
    pumps: list[threading.Thread] = []

    def start(i: int) -> subprocess.Popen:
        role = "gen" if i < g else "train"
        cmd = list(command)
        if args.pin:
            cmd = ["taskset", "-c", str(cpus[i % len(cpus)]), *cmd]
        proc = subprocess.Popen(
            cmd,
            env=child_env(i, n, g, coordinator, authkey),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a stop reaches its children too
        )
        pump = threading.Thread(target=_pump, args=(proc, f"[p{i} {role}]", lock), daemon=True)
        pump.start()
        pumps.append(pump)
        return proc

    def write_pids() -> None:
        if args.pids_file:
            pids = {i: [p.pid, "gen" if i < g else "train"] for i, p in enumerate(procs)}
            with open(args.pids_file + ".tmp", "w", encoding="utf-8") as f:
                json.dump(pids, f)
            os.replace(args.pids_file + ".tmp", args.pids_file)

    procs = [start(i) for i in range(n)]
    write_pids()
    restarts = args.restart_generation

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    deadline = time.monotonic() + args.timeout_s if args.timeout_s > 0 else None
    code = 0
    try:
        while [p.poll() for p in procs].count(None):  # poll every child: sets returncode
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
            training = any(p.poll() is None for p in procs[g:])
            if failed and failed[0][0] < g and restarts > 0 and training:
                i, rc = failed[0]
                restarts -= 1
                print(
                    f"[launch] generation process {i} failed (rc {rc}); restarting it in "
                    f"{args.restart_delay_s:.0f} s ({restarts} restart(s) left)",
                    flush=True,
                )
                time.sleep(args.restart_delay_s)
                procs[i] = start(i)
                write_pids()
                continue
            if failed:
                i, rc = failed[0]
                print(f"[launch] process {i} failed (rc {rc}); stopping the others", flush=True)
                code = exit_code(rc)
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timeout after {args.timeout_s:.0f} s; stopping", flush=True)
                code = 124
                break
            time.sleep(0.1)
        else:
            failed = [p.returncode for p in procs if p.returncode]
            code = exit_code(failed[0]) if failed else 0
    except KeyboardInterrupt:
        print("[launch] interrupted; stopping", flush=True)
        code = 130
    finally:
        _stop(procs, args.grace_s)
        for pump in pumps:
            pump.join(2.0)
    return code


if __name__ == "__main__":
    sys.exit(main())
