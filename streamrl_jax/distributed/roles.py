"""Process roles of a multi-controller run: the first processes generate, the next train,
the last S (if any) score with the run's judge.

One JAX multi-controller program (`jax.distributed`, no Pathways): every
process runs the same entry point, `initialize(DistributedConfig.from_env())`
joins the coordination service and tells each process its role and the
devices of each role (`jax.devices()` grouped by `d.process_index`).

Environment variables (explicit arguments win, then these, then SLURM's):

* `STREAMRL_COORDINATOR`: `host:port` of the coordination service (the first
  training process serves it when the ids are explicit, see below; else process 0);
* `STREAMRL_NUM_PROCESSES`, `STREAMRL_PROCESS_ID`: the program's size and
  this process's id;
* `STREAMRL_GENERATION_PROCESSES`: processes `0 .. G-1` generate, the rest
  train (default 1);
* `STREAMRL_SCORING_PROCESSES`: the last S processes score: each serves the run's judge
  (`judge.model`) to the training processes (`pipeline/processes/scoring.py`; default 0:
  the judge runs in each training process);
* `STREAMRL_HEARTBEAT_TIMEOUT_S` (10), `STREAMRL_INIT_TIMEOUT_S` (120),
  `STREAMRL_SHUTDOWN_TIMEOUT_S` (10): `jax.distributed` timeouts;
* `STREAMRL_CPU_COLLECTIVES`: `jax_cpu_collectives_implementation` (default
  `gloo`; `none` leaves it);
* `STREAMRL_AUTHKEY_FILE` (an owner-only file) or `STREAMRL_AUTHKEY`: the run
  secret every channel's keys derive from (`keys.py`; required);
* `STREAMRL_HOST`: the name other processes reach this one's servers by;
* `STREAMRL_COORDINATOR_PORT`: the coordinator port under SLURM;
* `STREAMRL_COORDINATOR_BIND`: where process 0's coordination service listens
  (default: the coordinator address itself, not every interface).

Under SLURM (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST` set) the
process id, count and coordinator (first host of the node list, port from
`SLURM_JOB_ID` as JAX's own SLURM detection does) come from SLURM. On Cloud
TPU leave all three unset: `jax.distributed.initialize()` detects them.

JAX's defaults wait 100 s (heartbeat) and 300 s (shutdown) before a lost
process is reported; the short defaults here make a dead peer an error within
seconds (DESIGN.md §5).

**Surviving a lost generation or scoring process.** Every process sets
`jax_enable_recoverability` before joining, so JAX does not abort the others when
one process dies and a process restarted with the same id joins again (measured on
jax 0.10.2: docs/multicontroller.md, "Losing a process"); the shutdown barrier then
waits only for the processes still there. The coordination service must outlive
every generation and scoring process, so with explicit ids (`launch/local.py`, SLURM) the first
training process serves it at `STREAMRL_COORDINATOR` (`_serve_coordination`: JAX
itself would start it on process 0, a generation process; that process's own
service is bound to a spare loopback port nobody dials). Only auto-detection (Cloud
TPU) leaves it on process 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
from absl import logging

from streamrl_jax.distributed import compile_cache, keys
from streamrl_jax.distributed.peers import is_loopback, parse_address

Role = Literal["generation", "training", "scoring"]

ENV_COORDINATOR = "STREAMRL_COORDINATOR"
ENV_NUM_PROCESSES = "STREAMRL_NUM_PROCESSES"
ENV_PROCESS_ID = "STREAMRL_PROCESS_ID"
ENV_GENERATION_PROCESSES = "STREAMRL_GENERATION_PROCESSES"
ENV_SCORING_PROCESSES = "STREAMRL_SCORING_PROCESSES"
ENV_HEARTBEAT_TIMEOUT_S = "STREAMRL_HEARTBEAT_TIMEOUT_S"
ENV_INIT_TIMEOUT_S = "STREAMRL_INIT_TIMEOUT_S"
ENV_SHUTDOWN_TIMEOUT_S = "STREAMRL_SHUTDOWN_TIMEOUT_S"
ENV_CPU_COLLECTIVES = "STREAMRL_CPU_COLLECTIVES"
ENV_HOST = "STREAMRL_HOST"
ENV_COORDINATOR_PORT = "STREAMRL_COORDINATOR_PORT"
ENV_COORDINATOR_BIND = "STREAMRL_COORDINATOR_BIND"
ENV_PEER_TIMEOUT_S = "STREAMRL_PEER_TIMEOUT_S"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Where this process sits in the program; validated on construction.

    Attributes:
      coordinator_address: `host:port` of the coordination service; None with
        `num_processes` and `process_id` None lets JAX auto-detect (TPU).
      num_processes: processes in the program (>= 2: one of each role).
      process_id: this process's id.
      generation_processes: processes `0 .. G-1` have role "generation"; 1 <= G.
      scoring_processes: the last S processes, `N-S .. N-1`, have role "scoring"; the
        other `N - G - S` (at least one) have role "training".
      heartbeat_timeout_s: seconds without heartbeats after which JAX declares
        a process dead (and the others fail instead of waiting).
      initialization_timeout_s: seconds to wait for every process to join.
      shutdown_timeout_s: seconds to wait for every process at shutdown.
      cpu_collectives: `jax_cpu_collectives_implementation` to set before
        initializing ("gloo" makes CPU cross-process collectives work); None
        leaves it.
      authkey: the run secret the channels' keys derive from (`keys.py`);
        required by `initialize`.
      peer_timeout_s: silence (no data, no heartbeat) after which a sample or weight
        channel's peer is lost: how long a hung generation process goes unnoticed.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    generation_processes: int = 1
    scoring_processes: int = 0
    heartbeat_timeout_s: int = 10
    initialization_timeout_s: int = 120
    shutdown_timeout_s: int = 10
    cpu_collectives: str | None = "gloo"
    authkey: bytes | None = None
    peer_timeout_s: float = 30.0

    def __post_init__(self):
        known = (self.coordinator_address, self.num_processes, self.process_id)
        auto = all(v is None for v in known)
        if not auto:
            if self.num_processes is None or self.process_id is None:
                raise ValueError(
                    f"distributed: set both {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                    f"(or neither, for auto-detection); got num_processes={self.num_processes}, "
                    f"process_id={self.process_id}"
                )
            if self.num_processes < 2:
                raise ValueError(
                    f"distributed: num_processes ({ENV_NUM_PROCESSES}) must be >= 2 (one "
                    f"generation and one training process), got {self.num_processes}"
                )
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(
                    f"distributed: process_id ({ENV_PROCESS_ID}) must be in "
                    f"[0, {self.num_processes - 1}], got {self.process_id}"
                )
            if self.coordinator_address is None:
                raise ValueError(
                    f"distributed: coordinator_address ({ENV_COORDINATOR}) is required with "
                    f"num_processes={self.num_processes}"
                )
            parse_address(self.coordinator_address)
            self.check_generation_processes(self.num_processes)
        elif self.generation_processes < 1:
            raise ValueError(
                f"distributed: generation_processes ({ENV_GENERATION_PROCESSES}) must be >= 1, "
                f"got {self.generation_processes}"
            )
        if not self.peer_timeout_s >= 1:
            raise ValueError(
                f"distributed: peer_timeout_s ({ENV_PEER_TIMEOUT_S}) must be >= 1 s, "
                f"got {self.peer_timeout_s}"
            )
        for name in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"distributed: {name} must be >= 1 s, got {getattr(self, name)}")

    def check_generation_processes(self, num_processes: int) -> None:
        """Raises ValueError unless `num_processes` hold G >= 1 generation, S >= 0
        scoring and at least one training process."""
        g, s = self.generation_processes, self.scoring_processes
        if s < 0:
            raise ValueError(
                f"distributed: scoring_processes ({ENV_SCORING_PROCESSES}) must be >= 0, got {s}"
            )
        if not 1 <= g <= num_processes - 1 - s:
            raise ValueError(
                f"distributed: generation_processes ({ENV_GENERATION_PROCESSES}) must be in "
                f"[1, num_processes - scoring_processes - 1] = [1, {num_processes - 1 - s}] "
                f"(at least one training process), got {g}"
                + (f" with {s} scoring process(es)" if s else "")
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any):
        """Reads the STREAMRL_* variables (then SLURM_*); `overrides` win over both."""
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        slurm = all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST"))
        if slurm:
            nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
            port = env.get(ENV_COORDINATOR_PORT) or str(
                int(env.get("SLURM_JOB_ID", "0")) % 2**12 + (65535 - 2**12 + 1)
            )
            kw["coordinator_address"] = f"{first_host(nodes)}:{port}"
            kw["num_processes"] = _int(env, "SLURM_NTASKS")
            kw["process_id"] = _int(env, "SLURM_PROCID")
        if ENV_COORDINATOR in env:
            kw["coordinator_address"] = env[ENV_COORDINATOR]
        for field, var in (
            ("num_processes", ENV_NUM_PROCESSES),
            ("process_id", ENV_PROCESS_ID),
            ("generation_processes", ENV_GENERATION_PROCESSES),
            ("scoring_processes", ENV_SCORING_PROCESSES),
            ("heartbeat_timeout_s", ENV_HEARTBEAT_TIMEOUT_S),
            ("initialization_timeout_s", ENV_INIT_TIMEOUT_S),
            ("shutdown_timeout_s", ENV_SHUTDOWN_TIMEOUT_S),
        ):
            if var in env:
                kw[field] = _int(env, var)
        if ENV_PEER_TIMEOUT_S in env:
            try:
                kw["peer_timeout_s"] = float(env[ENV_PEER_TIMEOUT_S])
            except ValueError:
                raise ValueError(
                    f"distributed: {ENV_PEER_TIMEOUT_S}={env[ENV_PEER_TIMEOUT_S]!r} is not a number"
                ) from None
        if ENV_CPU_COLLECTIVES in env:
            value = env[ENV_CPU_COLLECTIVES]
            kw["cpu_collectives"] = None if value in ("", "none") else value
        kw["authkey"] = keys.secret_from_env(env)
        kw.update(overrides)
        return cls(**kw)

    def role_of(self, process_id: int) -> Role:
        """The role of `process_id` (scoring only once the program's size is known: not
        under auto-detection)."""
        n, g, s = self.num_processes, self.generation_processes, self.scoring_processes
        return role_in(process_id, n, g, s)


def role_in(process_id: int, num_processes: int | None, generation: int, scoring: int) -> Role:
    """Process `process_id`'s role: the first `generation` generate, the last `scoring` of
    `num_processes` score (None: not known yet, so none), the others train."""
    if process_id < generation:
        return "generation"
    if num_processes is not None and process_id >= num_processes - scoring:
        return "scoring"
    return "training"


def _int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(f"distributed: {var}={env[var]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: `node[003-005,9],gpu1` → `node003`."""
    cut = next((i for i, ch in enumerate(nodelist) if ch in ",["), len(nodelist))
    if cut == len(nodelist) or nodelist[cut] == ",":
        return nodelist[:cut]
    rest = nodelist[cut + 1 :]
    end = next((i for i, ch in enumerate(rest) if ch in ",-]"), len(rest))
    return nodelist[:cut] + rest[:end]


@dataclasses.dataclass(frozen=True)
class Roles:
    """The role split of a started program, as seen by this process."""

    role: Role  # this process's role
    process_id: int
    num_processes: int
    generation_processes: tuple[int, ...]
    training_processes: tuple[int, ...]
    generation_devices: tuple[Any, ...]  # jax.Device of every generation process
    training_devices: tuple[Any, ...]
    rejoined: bool = False  # a restarted process joining a run already under way
    scoring_processes: tuple[int, ...] = ()  # the judge's processes (last of the program)
    scoring_devices: tuple[Any, ...] = ()


def assign_roles(
    process_id: int,
    num_processes: int,
    generation_processes: int,
    devices: Sequence[Any],
    scoring_processes: int = 0,
) -> Roles:
    """Splits `devices` (e.g. `jax.devices()`) by the role of their `process_index`."""
    cfg = DistributedConfig(
        generation_processes=generation_processes, scoring_processes=scoring_processes
    )
    cfg.check_generation_processes(num_processes)
    gen = tuple(range(generation_processes))
    train = tuple(range(generation_processes, num_processes - scoring_processes))
    score = tuple(range(num_processes - scoring_processes, num_processes))
    by_role = {
        name: tuple(d for d in devices if d.process_index in pids)
        for name, pids in (("generation", gen), ("training", train), ("scoring", score))
    }
    for pid in range(num_processes):
        if not any(d.process_index == pid for d in devices):
            raise ValueError(f"distributed: process {pid} has no devices")
    return Roles(
        role=role_in(process_id, num_processes, generation_processes, scoring_processes),
        process_id=process_id,
        num_processes=num_processes,
        generation_processes=gen,
        training_processes=train,
        generation_devices=by_role["generation"],
        training_devices=by_role["training"],
        scoring_processes=score,
        scoring_devices=by_role["scoring"],
    )


def initialize(cfg: DistributedConfig) -> Roles:
    """Joins the multi-controller program (`jax.distributed.initialize`) and returns the roles.

    Must run before anything else touches a JAX backend.
    """
    if cfg.authkey is None:
        raise keys.RunKeyError(
            f"distributed: no run key: set {keys.ENV_AUTHKEY_FILE} (an owner-only file) or "
            f"{keys.ENV_AUTHKEY}; launch/local.py, launch/slurm.sbatch and launch/tpu_pod.sh "
            "generate one per run"
        )
    if cfg.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    # A lost process must not abort the others, and a restarted one may join again.
    jax.config.update("jax_enable_recoverability", True)
    # The coordination service listens where the launcher pointed the program, not on
    # every interface (JAX's default).
    bind = os.environ.get(ENV_COORDINATOR_BIND) or cfg.coordinator_address
    if cfg.process_id is not None and cfg.process_id == cfg.generation_processes:
        _serve_coordination(bind, cfg)  # the first training process
    if cfg.process_id == 0 and cfg.num_processes is not None:
        # JAX starts a service on process 0 regardless; the program's is elsewhere. Bound
        # to loopback: process 0 may run on another node than the coordinator's host,
        # whose address it could not bind.
        bind = "127.0.0.1:0"
    kwargs = {
        "coordinator_address": cfg.coordinator_address,
        "coordinator_bind_address": bind,
        "num_processes": cfg.num_processes,
        "process_id": cfg.process_id,
        "initialization_timeout": cfg.initialization_timeout_s,
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout_s,
        "shutdown_timeout_seconds": cfg.shutdown_timeout_s,
    }
    accepted = inspect.signature(jax.distributed.initialize).parameters
    dropped = sorted(k for k in kwargs if k not in accepted)
    if dropped:  # another jax version: keep going, but say which timeouts are JAX's defaults
        logging.warning("jax.distributed.initialize does not accept %s; using defaults", dropped)
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in accepted})
    compile_cache.write_from_every_process()  # not JAX's process 0 only: every role's programs
    rejoined = _rejoining(cfg)
    cfg.check_generation_processes(jax.process_count())
    roles = assign_roles(
        jax.process_index(),
        jax.process_count(),
        cfg.generation_processes,
        jax.devices(),
        cfg.scoring_processes,
    )
    roles = dataclasses.replace(roles, rejoined=rejoined)
    logging.info(
        "process %d/%d: %s (%d generation, %d training%s devices)",
        roles.process_id,
        roles.num_processes,
        roles.role,
        len(roles.generation_devices),
        len(roles.training_devices),
        f", {len(roles.scoring_devices)} scoring" if roles.scoring_processes else "",
    )
    return roles


# Published by the first training process (pipeline/processes/plan.START_KEY).
RUN_STARTED_KEY = "start"
# XLA:CPU's topology, written once by process 0 (jax 0.10.2, `xla_bridge`'s CPU client).
_CPU_TOPOLOGY_KEY = "cpu:global_topology/cpu"


def _rejoining(cfg: DistributedConfig) -> bool:
    """A process restarted into a run under way (the run's start is already published).
    Process 0 then removes the CPU topology it wrote the first time: XLA:CPU's client
    refuses to write it again (`ALREADY_EXISTS`, measured), and writes the same one."""
    client = _kv_client()
    try:
        client.key_value_try_get(f"streamrl/{RUN_STARTED_KEY}")
    except Exception:  # noqa: BLE001 - NOT_FOUND: a fresh run
        return False
    logging.warning("process %s: rejoining a run under way", cfg.process_id)
    if cfg.process_id == 0:  # not jax.process_index(): that would start the backend
        with contextlib.suppress(Exception):  # another backend: no such key
            client.key_value_delete(_CPU_TOPOLOGY_KEY)
    return True


_SERVICE: list[Any] = []  # the coordination service this process serves, if any


def _serve_coordination(bind: str, cfg: DistributedConfig) -> None:
    """Starts the program's coordination service in this (the first training) process,
    as `jax.distributed.initialize` does on process 0, recoverable: a generation
    process, which may die, must not host it. jax 0.10.2 has no public call for it."""
    from jax._src.lib import _jax

    logging.info("serving the coordination service on %s (first training process)", bind)
    _SERVICE.append(
        _jax.get_distributed_runtime_service(
            bind,
            cfg.num_processes,
            heartbeat_timeout=cfg.heartbeat_timeout_s,
            shutdown_timeout=cfg.shutdown_timeout_s,
            recoverable=True,
        )
    )


def shutdown(timeout_s: float = 10.0) -> None:
    """`jax.distributed.shutdown()`; the process serving the coordination service first
    waits (up to `timeout_s`) for every other process to leave it (with recoverable
    tasks JAX's shutdown barrier waits for nobody, and a process still leaving when the
    service stops is aborted), then stops it."""
    if _SERVICE:
        client = _kv_client()
        me = jax.process_index()
        everyone = list(range(jax.process_count()))
        deadline = time.monotonic() + timeout_s
        while set(others := [p for p in client.get_live_nodes(everyone) if p != me]):
            if time.monotonic() > deadline:
                logging.warning(
                    "coordination service: processes %s still connected after %.0f s; stopping it",
                    sorted(others),
                    timeout_s,
                )
                break
            time.sleep(0.1)
    jax.distributed.shutdown()
    while _SERVICE:
        _SERVICE.pop().shutdown()


def advertised_host(cfg: DistributedConfig) -> str:
    """Host other processes use to reach this one: `STREAMRL_HOST`, else loopback when
    the coordinator is on loopback (one machine), else `socket.gethostname()`."""
    if os.environ.get(ENV_HOST):
        return os.environ[ENV_HOST]
    if cfg.coordinator_address and is_loopback(parse_address(cfg.coordinator_address)[0]):
        return "127.0.0.1"
    return socket.gethostname()


def _kv_client():
    from jax._src import distributed  # the coordination service's key-value store

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("distributed: jax.distributed is not initialized")
    return client


@dataclasses.dataclass(frozen=True)
class Board:
    """The coordination service's key-value store under one prefix: the keys of one run
    of the program. Several learners across processes (pipeline/processes/learners.py)
    are several runs on one program, each on its own board (`learner/<name>/`); the
    module functions below are the program's board (no prefix)."""

    prefix: str = ""

    def _key(self, key: str) -> str:
        return f"streamrl/{self.prefix}{key}"

    def publish(self, key: str, value: str, overwrite: bool = False) -> None:
        """Publishes `value` (e.g. a server's `host:port`) under `key` to every process
        (`overwrite`: replace an earlier value, e.g. a restarted process's address)."""
        _kv_client().key_value_set(self._key(key), value, allow_overwrite=overwrite)

    def try_lookup(self, key: str) -> str | None:
        """The value published under `key`, or None if there is none yet (does not wait)."""
        try:
            return _kv_client().key_value_try_get(self._key(key))
        except Exception:  # noqa: BLE001 - NOT_FOUND is a plain XlaRuntimeError
            return None

    def lookup(self, key: str, timeout_s: float) -> str:
        """Waits (up to `timeout_s`) for the value another process `publish`ed under `key`."""
        try:
            return _kv_client().blocking_key_value_get(self._key(key), int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - JAX raises a plain XlaRuntimeError on timeout
            raise TimeoutError(
                f"distributed: no process published {self.prefix + key!r} within "
                f"{timeout_s:.1f} s ({e})"
            ) from e

    def lookup_all(self, prefix: str) -> dict[str, str]:
        """Every value published under `prefix/` so far, by the rest of its key (does not
        wait)."""
        start = self._key(f"{prefix}/")
        return {k[len(start) :]: v for k, v in _kv_client().key_value_dir_get(start)}

    def forget(self, prefix: str) -> None:
        """Deletes every value published under `prefix/`."""
        _kv_client().key_value_delete(self._key(f"{prefix}/"))


PROGRAM = Board()  # the program's own keys
publish, try_lookup, lookup = PROGRAM.publish, PROGRAM.try_lookup, PROGRAM.lookup
lookup_all, forget = PROGRAM.lookup_all, PROGRAM.forget
