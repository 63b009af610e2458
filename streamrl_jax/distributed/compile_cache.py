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
bound and `filelock` imports; `launch._CACHE_SETTINGS`) serialises the writers, and a
writer finding the entry there writes nothing. Without that lock it stays JAX's rule.

This wraps JAX's private `compiler._cache_write` (the one place the rule lives, the same
in both JAX versions the package supports); JAX's own checks (host callbacks, the
minimum compile time) are kept, and a failed write is a logged warning, as in JAX.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from absl import logging


def write_from_every_process() -> bool:
    """Installs the writer; True when it is on (idempotent), False where JAX's
    process-0 rule stays (no cache, no file lock, or a JAX without the hook)."""
    import jax
    from jax._src import compilation_cache, compiler, distributed

    if not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return False
    if jax.config.jax_compilation_cache_max_size in (-1, 0) or not importlib.util.find_spec(
        "filelock"
    ):
        logging.info("compile cache: written by process 0 only (no file lock: JAX's rule)")
        return False
    original = getattr(compiler, "_cache_write", None)
    if original is None:
        logging.info("compile cache: written by process 0 only (this JAX has no _cache_write)")
        return False
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
