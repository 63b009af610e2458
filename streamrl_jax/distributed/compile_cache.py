"""The persistent compile cache written by every process of a multi-controller program.

JAX (0.10.2 through 0.12.0.1) writes persistent-cache entries from process 0 only ("Not
writing persistent cache entry since process_id != 0"), so that N hosts do not race to
write one entry. Here process 0 is the first generation process, and each process
compiles its own role's programs: the training processes' programs (and every other
generation process's) were never written, and a restarted or resumed trainer compiled
all of them again (docs/first_run.md, "The compile cache", measured: 48 programs of the
`:tiny` training process compiled again on a second run).

`write_from_every_process` lets every process write the programs it compiled. Programs
that span processes (the training mesh's, compiled by each training process under one
key) are written once: JAX's file lock around the cache (on where the cache has a size
bound and `filelock` imports; `compile_cache.SETTINGS`) serialises the writers, and a
writer finding the entry there writes nothing. Without that lock it stays JAX's rule.

This wraps JAX's private `compiler._cache_write` (the one place the rule lives, the same
in both JAX versions the package supports); JAX's own checks (host callbacks, the
minimum compile time) are kept, and a failed write is a logged warning, as in JAX.

**On CPU, a program that spans processes is never cached** (neither written nor read, by
any process, process 0 included). XLA:CPU runs such a program's collectives over gloo,
and an executable read back from the cache breaks them: with a warm cache the 3-process
agent job (1 generation + 2 training processes, `configs/agent.py:tiny`) aborted in its
second step in 6 of 6 runs (`gloo::EnforceNotMet ... op.preamble.length <= op.nbytes.
24576 vs 256`: the two training processes' messages no longer matched), and passed 3 of 3
cold; with these programs kept out of the cache it passes warm (measured 2026-12-07, jax
0.10.2). They compile again in every run (the training processes' programs: seconds on
the CPU models); a process's own programs (a generation instance, a one-device trainer)
are still cached. `tests/distributed_transport_test.py` runs both. On TPU and GPU the
rule above stands.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import time
from typing import Any

from absl import logging

# The cache's settings (docs/first_run.md, "The compile cache"), for every process of the
# package that turns the cache on (`launch`, `serve`); a JAX_* variable of the same name in
# the environment wins.
SETTINGS = {
    # Every program, however fast it compiled: with JAX's default (1 s), or 0.1 s, a warm
    # run compiles the small programs again, and keeping them costs little disk.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # A bound makes JAX evict least-recently-used entries, and it is what turns on JAX's
    # file lock around every read and write (JAX writes in place): two runs at once
    # never read an entry half written. Needs `filelock` (set only where it imports).
    "jax_compilation_cache_max_size": 1 << 30,
}
_ATIME, _ENTRY = "-atime", "-cache"  # JAX's LRU cache: an entry, its last access time


def configure(names: tuple[str, ...] = tuple(SETTINGS)) -> None:
    """`SETTINGS` of `names`, each unless the environment sets it (the size bound, which
    turns on JAX's file lock, only where `filelock` imports)."""
    import jax

    lock = importlib.util.find_spec("filelock") is not None
    for name in names:
        if name.upper() not in os.environ and (lock or name != "jax_compilation_cache_max_size"):
            jax.config.update(name, SETTINGS[name])


def heal(path: str, timeout_s: float = 10.0) -> int:
    """Gives every entry of the cache at `path` that has no access-time file one, under
    JAX's file lock; returns how many. A process whose cache has no size bound (neither
    this package's `configure` nor a JAX_COMPILATION_CACHE_MAX_SIZE) writes entries
    without one, and with a bound JAX reads every entry's access time before each write
    (to evict): from the first such entry on, every write into the directory fails
    (`FileNotFoundError: ...-atime`, a warning per program) and the cache stops growing
    for every process that shares it. Seen in the suite, which shared its cache with a
    served model's process that set no bound: 43 programs written in its first two
    minutes, none in the ten after."""
    if importlib.util.find_spec("filelock") is None or not os.path.isdir(path):
        return 0
    import filelock

    try:
        with filelock.FileLock(os.path.join(path, ".lockfile"), timeout=timeout_s):
            names = set(os.listdir(path))
            missing = [
                n.removesuffix(_ENTRY)
                for n in names
                if n.endswith(_ENTRY) and n.removesuffix(_ENTRY) + _ATIME not in names
            ]
            now = time.time_ns().to_bytes(8, "little")  # as JAX writes it
            for key in missing:
                with open(os.path.join(path, key + _ATIME), "wb") as f:
                    f.write(now)
    except (filelock.Timeout, OSError) as e:
        logging.warning("compile cache: %s not checked for entries JAX cannot evict: %s", path, e)
        return 0
    if missing:
        logging.warning(
            "compile cache: %d entries of %s had no access time (written by a process without "
            "a cache size bound), given one so that later writes succeed",
            len(missing),
            path,
        )
    return len(missing)


def write_from_every_process() -> bool:
    """Installs the writer; True when it is on (idempotent), False where JAX's
    process-0 rule stays (no cache, no file lock, or a JAX without the hook). Wherever
    the cache is on, a CPU program that spans processes is kept out of it first (module
    docstring); where this JAX cannot, the cache is turned off in this process."""
    import jax
    from jax._src import compilation_cache, compiler, distributed

    if not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return False
    if not _keep_spanning_programs_out(compiler):
        logging.warning(
            "compile cache: off in this process (this JAX has no compile_or_get_cached, "
            "_cache_read or _cache_write to keep a CPU program that spans processes out of it)"
        )
        jax.config.update("jax_enable_compilation_cache", False)
        return False
    if jax.config.jax_compilation_cache_max_size in (-1, 0) or not importlib.util.find_spec(
        "filelock"
    ):
        logging.info("compile cache: written by process 0 only (no file lock: JAX's rule)")
        return False
    original = compiler._cache_write
    if getattr(original, "streamrl_every_process", False):
        return True

    @functools.wraps(original)
    def cache_write(
        cache_key: str, compile_s: float, module: str, backend: Any, executable: Any, *rest: Any
    ) -> None:
        host_callbacks = rest[0] if rest else ()  # jax 0.10 passes them; 0.12 does not
        if (
            distributed.global_state.process_id == 0
            or host_callbacks
            or compile_s < jax.config.jax_persistent_cache_min_compile_time_secs
            or getattr(_uncached, "on", False)
        ):
            return original(cache_key, compile_s, module, backend, executable, *rest)
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module, executable, backend, int(compile_s)
            )
        except Exception as e:  # noqa: BLE001 - as JAX: the next run compiles it again
            logging.warning("compile cache: %r not written: %s: %s", module, type(e).__name__, e)

    cache_write.streamrl_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = cache_write
    return True


_uncached = threading.local()  # .on: the program this thread compiles stays out of the cache


def _keep_spanning_programs_out(compiler: Any) -> bool:
    """Wraps JAX's `compile_or_get_cached`, `_cache_read` and `_cache_write` so that a CPU
    program whose devices belong to several processes is neither read from the cache nor
    written to it (module docstring); True when in place (idempotent), False when this
    JAX has not the functions to wrap."""
    names = ("compile_or_get_cached", "_cache_read", "_cache_write")
    compile_or_get, read, write = (getattr(compiler, n, None) for n in names)
    if compile_or_get is None or read is None or write is None:
        return False
    if getattr(compile_or_get, "streamrl_spanning_out", False):
        return True

    @functools.wraps(compile_or_get)
    def compile_or_get_cached(backend: Any, computation: Any, devices: Any, *rest: Any, **kw: Any):
        before = getattr(_uncached, "on", False)
        _uncached.on = backend.platform == "cpu" and spans_processes(devices)
        try:
            return compile_or_get(backend, computation, devices, *rest, **kw)
        finally:
            _uncached.on = before

    @functools.wraps(read)
    def cache_read(*args: Any, **kw: Any):
        if getattr(_uncached, "on", False):
            return None, None  # a miss: compiled here, and not written
        return read(*args, **kw)

    @functools.wraps(write)
    def cache_write(*args: Any, **kw: Any) -> None:
        if not getattr(_uncached, "on", False):
            write(*args, **kw)

    compile_or_get_cached.streamrl_spanning_out = True  # type: ignore[attr-defined]
    compiler.compile_or_get_cached = compile_or_get_cached
    compiler._cache_read, compiler._cache_write = cache_read, cache_write
    return True


def spans_processes(devices: Any) -> bool:
    """Whether a program's devices (JAX's array of them) belong to more than one process;
    True where they cannot be read as devices (kept out of the cache: the safe side)."""
    try:
        return len({d.process_index for d in getattr(devices, "flat", devices)}) > 1
    except (AttributeError, TypeError):
        return True
