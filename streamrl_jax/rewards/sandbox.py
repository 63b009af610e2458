"""Reward scoring in confined worker processes: model output is untrusted (DESIGN.md §7).

Several reasoning-gym scorers `eval` or `sympy.parse_expr` the extracted answer
(countdown, puzzle24, polynomial_multiplication, ...): an answer like
`__import__('os').system(...)` runs as code, and `9**9**9**9` computes for
ever while holding the GIL. So scoring runs in a `pebble.ProcessPool` of
*spawned* workers (not forked: nothing of the trainer's memory is copied in),
each confined at start-up by `confine`:

* **Landlock** (Linux >= 5.13, unprivileged): the filesystem is read-only
  except the worker's own scratch directory, and `/proc` and `/sys` are not
  readable at all (other processes' memory and environment, and this one's
  inherited environment); nothing may be executed (no `execve`), no TCP bind or
  connect, no signals to processes outside the worker (not the trainer). Where
  the kernel has no Landlock the worker logs that once and relies on the layers
  below.
* **An audit hook** (PEP 578): refuses opens for writing outside the scratch
  directory, process creation (`fork`, `exec`, `system`, `subprocess`), sockets
  and `ctypes`. Not a boundary by itself (native code can bypass it); a second
  layer that also names what was refused.
* **Resource limits**: address space (`memory_mb`), CPU seconds, file size;
  the working directory is a fresh scratch directory; the environment keeps
  only a few harmless variables.

Every call has a deadline (`timeout_s`): a worker past it is killed and
replaced, and the call raises `RewardTimeout` naming the scorer. A worker that
dies (memory limit, crash) raises `RewardWorkerDied`. The owner (`pool.py`)
decides what a failure costs (score 0 and count, or stop the run). Closing never
waits on a stuck worker: workers are terminated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from absl import logging

from streamrl_jax.rewards.base import RewardFn

# The environment a worker keeps (no secrets: keys, tokens and addresses stay out).
_ENV_KEPT = ("PATH", "LANG", "LC_ALL", "PYTHONHASHSEED", "TZ")


class RewardTimeout(TimeoutError):
    """A reward call ran past its deadline; its worker was killed and replaced."""


class RewardWorkerDied(RuntimeError):
    """A reward worker process died during a call (memory limit, crash)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What one confined reward worker may use.

    Attributes:
      timeout_s: wall-clock deadline of one call.
      memory_mb: address-space limit of a worker.
      cpu_s: CPU seconds of a worker's lifetime (a backstop; workers are recycled
        every `max_tasks` calls long before it in normal use).
      max_tasks: calls after which a worker is replaced by a fresh one.
      file_mb: largest file a worker may write (in its scratch directory).
    """

    timeout_s: float = 10.0
    memory_mb: int = 2048
    cpu_s: int = 600
    max_tasks: int = 500
    file_mb: int = 16


# ---------------------------------------------------------------------- confinement
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # x86_64
_PR_SET_NO_NEW_PRIVS = 38
_FS_EXECUTE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 2, 1 << 3
_NET_ALL = (1 << 0) | (1 << 1)  # TCP bind, TCP connect
_SCOPE_ALL = (1 << 0) | (1 << 1)  # abstract unix sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _fs_rights(abi: int) -> int:
    """Every filesystem access right the kernel's Landlock ABI knows."""
    last = {1: 12, 2: 13, 3: 14, 4: 14}.get(abi, 15)  # REFER (2), TRUNCATE (3), IOCTL_DEV (5)
    return (1 << (last + 1)) - 1


def readable_roots(hidden: list[str]) -> list[str]:
    """Paths whose subtrees together cover all of `/` except the `hidden` ones.

    Landlock only grants, so hiding a path means granting its siblings along the
    way down from `/` instead of its ancestors (`/root/.streamrl` hidden: every
    entry of `/` but `/root`, then every entry of `/root` but `.streamrl`).
    """
    roots = ["/"]
    for path in hidden:
        split: list[str] = []
        for root in roots:
            if path == root:
                continue  # hidden whole
            if not path.startswith(root.rstrip("/") + "/"):
                split.append(root)
                continue
            cur = root  # an ancestor: grant the siblings of each step toward `path`
            while cur != path:
                step = os.path.join(cur, path[len(cur.rstrip("/")) + 1 :].split("/")[0])
                try:
                    entries = sorted(os.listdir(cur))
                except OSError:
                    entries = []
                # Symlinks are left out: a rule on one would grant its target (which may
                # be a hidden path's ancestor); whatever they point to is covered as itself.
                split += [
                    os.path.join(cur, e)
                    for e in entries
                    if os.path.join(cur, e) != step and not os.path.islink(os.path.join(cur, e))
                ]
                cur = step
        roots = split
    return roots


def hidden_paths() -> list[str]:
    """What a worker must not read: other processes (/proc), the kernel's view of
    them (/sys), and where the run key lives (docs/security.md)."""
    hidden = ["/proc", "/sys"]
    key_file = os.environ.get("STREAMRL_AUTHKEY_FILE")
    if key_file:
        hidden.append(os.path.dirname(os.path.realpath(key_file)))
    streamrl_home = os.path.realpath(os.path.expanduser("~/.streamrl"))
    if os.path.isdir(streamrl_home):
        hidden.append(streamrl_home)
    return hidden


def landlock(scratch: str, hidden: list[str] | None = None) -> int:
    """Confines this process: read-only filesystem except `scratch` (and nothing of
    `hidden`, default `hidden_paths()`), no execve, no TCP, no signals outside.
    Returns the Landlock ABI used (0: not available here)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    attr = _RulesetAttr(_fs_rights(abi), _NET_ALL if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        # Read everywhere but /proc and /sys (other processes' memory and environment,
        # this one's inherited environment) and the run key's directory; write only
        # beneath the scratch directory.
        rules = [
            (path, _FS_READ_FILE | (_FS_READ_DIR if os.path.isdir(path) else 0))
            for path in readable_roots(hidden if hidden is not None else hidden_paths())
        ]
        rules.append((scratch, attr.fs & ~_FS_EXECUTE))
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # a dangling link at the root: nothing to allow
                continue
            try:
                rule = _PathBeneath(allowed, fd)
                if libc.syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


_REFUSED_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "socket.connect", "socket.bind", "socket.__new__", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.cdata", "os.kill", "os.killpg", "signal.pthread_kill",
)  # fmt: skip
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link")


def _audit_hook(scratch: str):
    def inside(path: Any) -> bool:
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(scratch + os.sep)
        except (TypeError, ValueError):
            return False

    def hook(event: str, args: tuple) -> None:
        if event in _REFUSED_EVENTS:
            raise PermissionError(f"reward sandbox: {event} is not allowed")
        if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writes and not inside(args[0]):
                raise PermissionError(f"reward sandbox: writing {args[0]!r} is not allowed")
        elif event in _WRITE_EVENTS and not all(inside(a) for a in args[:2] if a is not None):
            raise PermissionError(f"reward sandbox: {event} outside the scratch directory")

    return hook


def confine(limits: Limits, root: str) -> str:
    """Confines the calling (worker) process; returns its scratch directory (a fresh
    directory under `root`)."""
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="worker-", dir=root))
    hidden = hidden_paths()  # before the environment that names the key file is cleared
    os.chdir(scratch)
    sys.dont_write_bytecode = True  # lazily imported modules: no .pyc writes to refuse
    kept = {k: v for k, v in os.environ.items() if k in _ENV_KEPT}
    os.environ.clear()
    os.environ.update(kept, HOME=scratch, TMPDIR=scratch)
    mb = 1 << 20
    for limit, value in (
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_FSIZE, limits.file_mb * mb),
        (resource.RLIMIT_CORE, 0),
    ):
        with contextlib.suppress(ValueError, OSError):  # never raise a hard limit we lack
            soft, hard = resource.getrlimit(limit)
            cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (cap, cap))
    abi = landlock(scratch, hidden)
    if abi == 0:
        logging.warning("reward sandbox: no Landlock on this kernel; audit hook and limits only")
    sys.addaudithook(_audit_hook(scratch))
    return scratch


_WORKER_FN: Callable[..., Any] | None = None  # the worker's function, unpickled at start-up


def _init_worker(limits: Limits, root: str, fn: Callable[..., Any]) -> None:
    global _WORKER_FN
    _WORKER_FN = fn  # unpickled (its imports done) before the first deadline runs
    confine(limits, root)


def _call(*args: Any) -> Any:
    return _WORKER_FN(*args)


# ---------------------------------------------------------------------- the pool
class SandboxPool:
    """Calls one picklable function (a `RewardFn`, an episode's tools) in confined worker
    processes (module docstring)."""

    def __init__(
        self,
        fn: RewardFn | Callable[..., Any],
        *,
        workers: int,
        limits: Limits,
        name: str = "reward",
    ):
        import pebble  # deferred: only sandboxed runs start processes

        self.fn, self.limits, self.name = fn, limits, name
        self.root = tempfile.mkdtemp(prefix=f"streamrl-{name}-")  # the workers' scratch dirs
        self._pool = pebble.ProcessPool(
            max_workers=workers,
            max_tasks=limits.max_tasks,
            initializer=_init_worker,
            initargs=(limits, self.root, fn),
            # Spawned, not forked: no copy of the trainer's memory (keys, weights) inside.
            context=multiprocessing.get_context("spawn"),
        )
        self._expired = pebble.ProcessExpired

    def submit(self, *args: Any, label: str = "") -> concurrent.futures.Future:
        """Schedules one call `fn(*args)`; the future holds its result, or `RewardTimeout`
        / `RewardWorkerDied` / the function's own exception. `label` names the call in
        those errors (a prompt id)."""
        inner = self._pool.schedule(_call, args=args, timeout=self.limits.timeout_s)
        outer: concurrent.futures.Future = concurrent.futures.Future()
        scorer = getattr(self.fn, "__name__", type(self.fn).__name__)
        where = f"{self.name} ({scorer}, {label or 'call'})"

        def done(f: concurrent.futures.Future) -> None:
            try:
                outer.set_result(f.result())
            except concurrent.futures.TimeoutError:
                outer.set_exception(
                    RewardTimeout(f"{where}: no result within {self.limits.timeout_s:g} s; "
                                  "the worker was killed and replaced")
                )  # fmt: skip
            except self._expired as e:
                outer.set_exception(RewardWorkerDied(f"{where}: the worker died ({e})"))
            except BaseException as e:  # noqa: BLE001 - the scorer's own error, handed on
                outer.set_exception(e)

        inner.add_done_callback(done)
        return outer

    def close(self, timeout: float = 5.0) -> None:
        """Terminates the workers (running calls are abandoned: nothing waits on a stuck
        scorer) and removes their scratch directories."""
        self._pool.stop()
        self._pool.join(timeout)
        shutil.rmtree(self.root, ignore_errors=True)
