"""Runs N processes of one command on a Ray cluster as one multi-controller program.

    python launch/ray_cluster.py -n 2 -g 1 [--address auto] -- \
        python -m streamrl_jax.launch --config=configs/quickstart.py:tiny --workdir=/tmp/mc

Each process of the program is a Ray actor in its own bundle of one placement group
(`--strategy`, PACK by default; `--resources_per_process`, `{"CPU": 1}` by default, e.g.
`{"GPU": 8}`). The actor runs the command as a child process, in `--cwd` (default: this
directory; the same path must hold the code on every node), with the environment
`launch/local.py` gives (`local.process_env`): STREAMRL_COORDINATOR (the node of the first
training process, which serves the coordination service, and a free port there),
STREAMRL_NUM_PROCESSES, STREAMRL_PROCESS_ID, STREAMRL_GENERATION_PROCESSES,
STREAMRL_SCORING_PROCESSES (`-s`: the last S serve the run's judge), STREAMRL_HOST
(the actor's node IP) and PYTHONUNBUFFERED=1, on top of the actor's own environment
(Ray's: on a GPU node its CUDA_VISIBLE_DEVICES) and of this driver's STREAMRL_*
variables. The run secret: STREAMRL_AUTHKEY or STREAMRL_AUTHKEY_FILE when set here,
else a fresh random one; it reaches the actors as an argument of their start call (Ray's
RPCs inside the cluster), never on a command line. Child output comes back line by line,
prefixed `[p<id> <role>]`.

Without `--address` the launcher starts a Ray instance on this machine (as many logical
CPUs as the processes ask for, no dashboard; the processes then use 127.0.0.1 for the
coordinator and STREAMRL_HOST, as under `launch/local.py`) and stops it at the end;
`--address auto` joins the cluster this machine belongs to (e.g. a KubeRay head), other
values go to `ray.init(address=...)` as they are.

Failure, as `launch/local.py`: the first process to fail (non-zero exit, a signal, or its
actor dying: its child is SIGKILLed with it) makes every other child get SIGTERM and,
after `--grace_s`, SIGKILL; the launcher exits with that process's code (128 + signal;
137 for a dead actor). `--timeout_s` bounds the run (exit 124); every call to an actor is
bounded too and a stall names the process (exit 1). `--restart_generation K`: a
generation process that fails while a training process still runs is started again,
`--restart_delay_s` later, in the same actor if it lives, else in a new actor in the
same bundle: the same command, environment and process id, so it rejoins the run
(docs/multicontroller.md, "Losing a process"); at most K restarts over the run
(`--restart_scoring K`: the same for a scoring process).
`--pids_file PATH` writes `{process id: [pid, role, host (its STREAMRL_HOST), actor pid]}`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import local  # launch/local.py: the environment each process gets, exit statuses

RAY_PIN = "2.60.0"  # pyproject.toml's `ray` and `test` extras
_NEEDS_RAY = (
    f'launch/ray_cluster.py needs Ray: pip install "ray[default]=={RAY_PIN}" '
    '(or pip install -e ".[ray]")'
)
try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:
    if __name__ == "__main__":
        print(f"error: {_NEEDS_RAY}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_NEEDS_RAY) from None

CALL_TIMEOUT_S = 60.0  # one call to an actor (its creation included) answers within this
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LaunchError(RuntimeError):
    """The launch cannot go on: an actor or the placement group did not answer in time, or a
    process did not start; the message names which."""


def _die_with_parent(parent: int) -> Callable[[], None]:
    """The child's preexec_fn: the kernel SIGKILLs it when the actor's worker dies
    (`ray.kill`, a crash, its node's raylet gone), so no orphan holds on to the process
    id while a restarted one rejoins."""

    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the worker died before the prctl
            os._exit(128 + signal.SIGKILL)

    return preexec


def _node_ip() -> str:
    """The IP of the node this worker runs on, as the cluster knows it (the address its
    raylet was started with)."""
    me = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == me)


class ProcessActor:
    """One process of the program, on the node of its placement-group bundle: runs the
    command as a child (its own process group) and keeps its output until polled."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None
        self._lines: collections.deque[str] = collections.deque()

    def node(self) -> tuple[str, int]:
        """This node's IP and this worker's pid."""
        return _node_ip(), os.getpid()

    def free_port(self, host: str, port: int) -> int:
        """`port` (checked free) or a free port on `host`, an address of this node."""
        with socket.socket() as s:
            s.bind((host, port))
            return s.getsockname()[1]

    def start(self, command: list[str], env: dict[str, str], cwd: str) -> int:
        """Starts the child (`env` over this worker's environment); its pid."""
        self._proc = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a stop reaches its children too
            preexec_fn=_die_with_parent(os.getpid()),
        )
        self._pump = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._pump.start()
        return self._proc.pid

    def _read(self, proc: subprocess.Popen) -> None:
        for line in iter(proc.stdout.readline, b""):
            self._lines.append(line.decode(errors="replace"))

    def poll(self) -> tuple[list[str], int | None]:
        """The output lines since the last poll, and the child's return code once it has
        exited (after its output, unless a grandchild holds the pipe open)."""
        rc = self._proc.poll()
        if rc is not None:
            self._pump.join(1.0)
        lines = []
        while self._lines:
            lines.append(self._lines.popleft())
        return lines, rc

    def stop(self, grace_s: float) -> tuple[list[str], int | None]:
        """SIGTERM to the child's process group, SIGKILL after `grace_s`; then `poll`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._proc is None or self._proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(self._proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(grace_s)
        return self.poll() if self._proc is not None else ([], None)


@dataclasses.dataclass
class _Process:
    """The driver's view of one process of the program."""

    id: int
    role: str  # "gen" | "train" | "score"
    actor: ray.actor.ActorHandle
    node: str = ""
    actor_pid: int = 0
    pid: int = 0
    returncode: int | None = None  # set once it has ended (-9: its actor died)
    why: str = ""  # how it ended, for the launcher's lines


def _get(ref: ray.ObjectRef, what: str, timeout_s: float = CALL_TIMEOUT_S):
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"{what}: no answer within {timeout_s:.0f} s") from None


def _emit(p: _Process, lines: list[str]) -> None:
    for line in lines:
        end = "" if line.endswith("\n") else "\n"
        sys.stdout.write(f"[p{p.id} {p.role}] {line}{end}")
    sys.stdout.flush()


class Program:
    """The N processes as actors in one placement group, and their failure rules."""

    def __init__(
        self, args: argparse.Namespace, command: list[str], resources: dict, local_ray: bool
    ) -> None:
        self.args, self.command, self.resources = args, command, resources
        # A Ray started here has every process on this machine: they reach each other on
        # loopback, as under launch/local.py (Ray itself uses the host's routable address).
        self.loopback = local_ray
        self.n, self.g = args.num_processes, args.generation_processes
        self.s = args.scoring_processes
        self.restarts = {"gen": args.restart_generation, "score": args.restart_scoring}
        self.pg = placement_group([dict(resources)] * self.n, strategy=args.strategy)
        self._remote = ray.remote(ProcessActor)
        self.procs: list[_Process] = []
        self.coordinator = ""
        # The children's environment beyond their own: this driver's STREAMRL_* settings
        # (timeouts, a key file's path) and the run secret.
        self.env = {k: v for k, v in os.environ.items() if k.startswith("STREAMRL_")}
        secret = local.run_secret()
        if secret is not None:
            self.env["STREAMRL_AUTHKEY"] = secret

    def _actor(self, i: int) -> ray.actor.ActorHandle:
        """A new actor holding bundle `i` whole (Ray sets its devices: CUDA_VISIBLE_DEVICES)."""
        res = dict(self.resources)
        options = {
            "num_cpus": res.pop("CPU", 0),
            "num_gpus": res.pop("GPU", 0),
            "memory": res.pop("memory", None),
            "resources": res,
            "max_restarts": 0,  # the driver restarts (budget and timing as launch/local.py)
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i
            ),
        }
        return self._remote.options(**options).remote()

    def _start(self, p: _Process) -> None:
        """Starts process `p` in its actor (placed, on its node) with its environment."""
        what = f"process {p.id}'s actor (bundle {p.id})"
        node, p.actor_pid = _get(p.actor.node.remote(), what)
        p.node = "127.0.0.1" if self.loopback else node
        env = {
            **self.env,
            **local.process_env(p.id, self.n, self.g, self.coordinator, p.node, self.s),
        }
        try:
            p.pid = _get(p.actor.start.remote(self.command, env, self.args.cwd), what)
        except ray.exceptions.RayTaskError as e:  # e.g. no such command or directory there
            where = f"{self.command[0]!r} in {self.args.cwd} on {node}"
            raise LaunchError(f"process {p.id} did not start ({where}): {e.cause}") from None
        p.returncode, p.why = None, ""

    def _write_pids(self) -> None:
        if self.args.pids_file:
            pids = {p.id: [p.pid, p.role, p.node, p.actor_pid] for p in self.procs}
            with open(self.args.pids_file + ".tmp", "w", encoding="utf-8") as f:
                json.dump(pids, f)
            os.replace(self.args.pids_file + ".tmp", self.args.pids_file)

    def start(self) -> None:
        """Places the bundles, the actors, and starts every process."""
        what = f"placement group of {self.n} bundles {self.resources} ({self.args.strategy})"
        try:
            _get(self.pg.ready(), what, self.args.start_timeout_s)
        except LaunchError as e:
            raise LaunchError(f"{e}; the cluster has {ray.available_resources()} free") from None
        self.procs = [
            _Process(i, local.role_name(i, self.n, self.g, self.s), self._actor(i))
            for i in range(self.n)
        ]
        first = self.procs[self.g]  # the first training process serves the coordination service
        what = f"process {self.g}'s actor (bundle {self.g})"
        node, _ = _get(first.actor.node.remote(), what)
        host = "127.0.0.1" if self.loopback else node
        port = _get(first.actor.free_port.remote(host, self.args.port), what)
        self.coordinator = f"{host}:{port}"
        print(
            f"[launch] ray: {self.n} processes ({self.g} generation) in a placement group "
            f"({self.args.strategy}, {self.resources} each); coordinator {self.coordinator}",
            flush=True,
        )
        for p in self.procs:
            self._start(p)
        self._write_pids()

    def poll(self) -> None:
        """Prints every running process's new output; notes the ones that ended."""
        live = [p for p in self.procs if p.returncode is None]
        refs = [p.actor.poll.remote() for p in live]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        if pending:
            stalled = [
                f"process {p.id}'s actor ({p.node})"
                for p, r in zip(live, refs, strict=True)
                if r in pending
            ]
            raise LaunchError(f"{', '.join(stalled)}: no answer within {CALL_TIMEOUT_S:.0f} s")
        for p, ref in zip(live, refs, strict=True):
            try:
                lines, rc = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                # Its child got SIGKILL from the kernel (`_die_with_parent`).
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                p.returncode, p.why = -signal.SIGKILL, f"its actor died: {first}"
                continue
            _emit(p, lines)
            if rc is not None:
                p.returncode, p.why = rc, f"rc {rc}"

    def restart(self, p: _Process) -> None:
        """Process `p` again, same id and environment (so it rejoins the run): in its actor
        if that lives, else in a new actor in its bundle (on whichever node Ray placed it)."""
        self.restarts[p.role] -= 1
        delay = self.args.restart_delay_s
        what = {"gen": "generation", "score": "scoring"}[p.role]
        print(
            f"[launch] {what} process {p.id} failed ({p.why}); restarting it in "
            f"{delay:.0f} s ({self.restarts[p.role]} restart(s) left)",
            flush=True,
        )
        time.sleep(delay)
        if p.why.startswith("its actor died"):
            with contextlib.suppress(Exception):  # already gone: the kill only makes sure
                ray.kill(p.actor, no_restart=True)
            p.actor = self._actor(p.id)
        self._start(p)
        self._write_pids()

    def run(self) -> int:
        """Until every process has ended, one fails, or the timeout; the exit status."""
        timeout_s = self.args.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        while any(p.returncode is None for p in self.procs):
            self.poll()
            failed = [p for p in self.procs if p.returncode]
            training = any(p.returncode is None for p in self.procs[self.g : self.n - self.s])
            if failed and self.restarts.get(failed[0].role, 0) > 0 and training:
                self.restart(failed[0])
                continue
            if failed:
                p = failed[0]
                print(f"[launch] process {p.id} failed ({p.why}); stopping the others", flush=True)
                return local.exit_code(p.returncode)
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timeout after {timeout_s:.0f} s; stopping", flush=True)
                return 124
            time.sleep(_POLL_S)
        return 0

    def stop(self) -> None:
        """Stops every child still running (SIGTERM, SIGKILL after the grace period), prints
        what they still wrote, then removes the actors and the placement group."""
        live = [p for p in self.procs if p.returncode is None]
        refs = [p.actor.stop.remote(self.args.grace_s) for p in live]
        timeout_s = 2 * self.args.grace_s + CALL_TIMEOUT_S
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for p, ref in zip(live, refs, strict=True):
            if ref not in ready:
                print(f"[launch] process {p.id}'s actor did not stop within {timeout_s:.0f} s")
                continue
            with contextlib.suppress(ray.exceptions.RayError):  # it died: so did its child
                _emit(p, ray.get(ref)[0])
        for p in self.procs:
            with contextlib.suppress(Exception):  # a dead actor: nothing to kill
                ray.kill(p.actor, no_restart=True)  # the kernel kills a live child with it
        remove_placement_group(self.pg)


def _resources(text: str) -> dict[str, float]:
    try:
        res = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--resources_per_process={text!r}: not JSON ({e})") from None
    if not (
        isinstance(res, dict)
        and res
        and all(isinstance(v, int | float) and v >= 0 for v in res.values())
        and any(v > 0 for v in res.values())
    ):
        raise ValueError(
            f"--resources_per_process={text!r}: want a JSON object of resource amounts, "
            'one above 0, e.g. {"CPU": 1} or {"GPU": 8}'
        )
    return res


def _connect(address: str, resources: dict[str, float], n: int) -> bool:
    """Joins the Ray cluster at `address`, or starts one on this machine (True then)."""
    if __name__ != "__main__":  # imported: its actor class must travel by value too
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if address:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reports from a local run
    # Ray's memory monitor kills an actor when the machine as a whole is short of memory,
    # whoever uses it; on one machine the program's processes are the user's to size (a
    # process killed for another's memory would be a lost process for nothing).
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(
        address="local",
        num_cpus=max(1, int(-(-n * resources.get("CPU", 0) // 1))),
        include_dashboard=False,
        log_to_driver=False,  # the children's output comes back through `poll`
        logging_level="WARNING",
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = local.program_parser(__doc__, "[pid, role, host, actor pid]")
    parser.add_argument("--address", default="", help="'': a local Ray; 'auto'; ray.init's")
    parser.add_argument("--resources_per_process", default='{"CPU": 1}', help="one bundle, as JSON")
    parser.add_argument(
        "--strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
    )
    parser.add_argument("--cwd", default=os.getcwd(), help="the command's directory, every node")
    parser.add_argument(
        "--start_timeout_s", type=float, default=300.0, help="for the placement group"
    )
    args, command = local.parse_program(parser, argv)
    n = args.num_processes
    try:
        resources = _resources(args.resources_per_process)
    except ValueError as e:
        parser.error(str(e))

    try:
        started = _connect(args.address, resources, n)
    except ConnectionError as e:  # no Ray cluster at that address
        print(f"error: --address={args.address!r}: {e}", file=sys.stderr)
        return 1

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)  # after ray.init, which sets its own
    program = None
    try:
        program = Program(args, command, resources, local_ray=started)
        program.start()
        return program.run()
    except LaunchError as e:
        print(f"[launch] error: {e}; stopping", flush=True)
        return 1
    except KeyboardInterrupt:
        print("[launch] interrupted; stopping", flush=True)
        return 130
    finally:
        if program is not None:
            program.stop()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
