"""Test-wide JAX settings: 8 host CPU devices and strict rank promotion.

These must run before any JAX backend starts, so they live here, imported by
pytest before any test module.

Transfer guard: with jax 0.10 on CPU a global `jax_transfer_guard="disallow"`
rejects even eager `jnp.zeros` (its scalar fill value counts as a host-to-device
transfer) while device-to-host copies are zero-copy and never guarded. So the
guard is applied where it means something: tests of the hot loops (the engine's
decode loop, the trainer's step) run them, after warm-up, inside
`jax.transfer_guard("disallow")`.

Compilation cache: every pipeline test builds a fresh engine and trainer whose
programs are the same as the previous test's; JAX's persistent cache (it works on
XLA:CPU with jax 0.10.2) turns those recompilations into cache reads. It lives in
`.pytest_cache/jax` (or `$STREAMRL_TEST_JAX_CACHE`); delete it freely. The console test's
launch uses it too (a read that meets an entry being written only costs a compile).
"""

import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Compiling is most of a cold suite, and the suite's tiny models run for microseconds, so
# the tests (and the processes they launch, which inherit XLA_FLAGS) compile XLA:CPU's
# kernels the quick way; runs, launches and benches keep XLA's defaults:
# * LLVM at -O0 (`--xla_backend_optimization_level=0`; measured: llama_test.py cold,
#   89 s -> 67 s). XLA's HLO passes, which decide fusion, layouts and the order of every
#   reduction, are the same at any level, and so are the programs' numerics (no fast-math
#   at any level).
# * No verification of the MLIR that XLA:CPU's fusion emitters generate
#   (`--xla_cpu_emitter_verification_level=0`; the verifier checks the compiler's own
#   output, it changes no kernel). Measured quiet, alternated twice, cold:
#   lifecycle_test.py's each-mode runs and llama_test.py compile in 43.3 / 44.0 s against
#   46.7 / 47.7 s with the verifier (7 %). (A first try on a loaded machine read 2.4x:
#   load noise.)
# * XLA:CPU's elemental IR emitters for fused computations instead of its MLIR fusion
#   emitters (`--xla_cpu_use_fusion_emitters=false`), where the jaxlib has the flag: 0.10
#   does, 0.12 does not, and XLA aborts a process on a flag it does not know, so a child
#   Python tries it once (`STREAMRL_TEST_XLA_ELEMENTAL=0/1` decides instead). The kernels'
#   code differs from a run's, as at -O0. Measured quiet, cold, on trainer_test.py,
#   llama_test.py and lifecycle_test.py's each-mode runs: 85.6 s of XLA compile -> 32.6 s,
#   151 s -> 95 s of wall time, every test passing.
# `STREAMRL_TEST_XLA_DEFAULTS=1` tests at XLA's defaults, as runs compile.
_ELEMENTAL = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: a Python that starts JAX's CPU backend with
    it exits cleanly (XLA aborts on an unknown flag)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if os.environ.get("STREAMRL_TEST_XLA_DEFAULTS") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    _quick = ["--xla_backend_optimization_level=0", "--xla_cpu_emitter_verification_level=0"]
    # Decided once, by pytest's first process: its xdist workers inherit the decision, and
    # every process a test launches inherits XLA_FLAGS.
    if "STREAMRL_TEST_XLA_ELEMENTAL" not in os.environ:
        os.environ["STREAMRL_TEST_XLA_ELEMENTAL"] = str(int(_jaxlib_takes(_ELEMENTAL)))
    if os.environ["STREAMRL_TEST_XLA_ELEMENTAL"] == "1":
        _quick.append(_ELEMENTAL)
    for _flag in _quick:
        if _flag.split("=")[0] + "=" not in _flags:
            _flags = f"{_flags} {_flag}".strip()
    os.environ["XLA_FLAGS"] = _flags
# libtpu is a test dependency (the pod planner, streamrl_podplan.plan, compiles for TPU
# topologies that are not attached); without a TPU, a backend search would try it and log
# its failure to start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Parity tests compare f32 forms at ~1e-5; on a GPU the default dot precision is TF32
# (10 mantissa bits). XLA:CPU computes f32 dots in full precision either way.
jax.config.update("jax_default_matmul_precision", "highest")
_CACHE = os.environ.get(
    "STREAMRL_TEST_JAX_CACHE",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"
    ),
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# The suite's xdist workers and the processes its tests launch share this directory, and
# JAX writes an entry in place: without its file lock (turned on by a size bound, as
# `compile_cache.SETTINGS` does) a process can read an entry half written and abort in
# deserialisation, which takes its xdist worker down and leaves the run waiting.
if importlib.util.find_spec("filelock") is not None:
    jax.config.update("jax_compilation_cache_max_size", 1 << 32)

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def model():
    """The engine tests' tiny random models (`support.lively_model`, seeds 0 and 1):
    (graphdef, params 0, params 1), built once per test module."""
    from support import lively_model

    return lively_model((0, 1))


# ------------------------------------------------------------- compile report (opt-in)
# `STREAMRL_TEST_COMPILE_REPORT=FILE`: per test, JAX's compile events (how many programs
# were traced, lowered, compiled by XLA, read from the persistent cache, and their
# seconds; and per jitted function, its traces and seconds) as JSON lines appended to
# FILE: where a cold suite's time goes is mostly here.
_COMPILE_REPORT = os.environ.get("STREAMRL_TEST_COMPILE_REPORT")
_compile_events: dict[str, float] = {}


_compile_functions: dict[str, list] = {}  # function -> [traces, seconds traced+lowered+compiled]


def _count_compile_event(event: str, duration: float, **kwargs) -> None:
    name = event.rsplit("/", 1)[-1]
    _compile_events[name + "_n"] = _compile_events.get(name + "_n", 0) + 1
    _compile_events[name + "_s"] = _compile_events.get(name + "_s", 0.0) + duration
    if event.startswith("/jax/core/compile/") and "fun_name" in kwargs:
        fun = kwargs["fun_name"].removeprefix("jit(").removesuffix(")")
        entry = _compile_functions.setdefault(fun, [0, 0.0])
        entry[0] += name == "jaxpr_trace_duration"
        entry[1] += duration


if _COMPILE_REPORT:
    import json

    jax.monitoring.register_event_duration_secs_listener(_count_compile_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _compile_events.clear()
        _compile_functions.clear()
        yield
        row = {"test": item.nodeid, **{k: round(v, 3) for k, v in _compile_events.items()}}
        row["functions"] = {f: [n, round(s, 3)] for f, (n, s) in _compile_functions.items()}
        with open(_COMPILE_REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    # The files in the order below, not xdist's (by number of tests, which put the files
    # that launch processes, a test or two of a minute or more each, last: they then ran
    # side by side at the end, 3-4 processes each on 2 cores; measured 680 s cold).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The files whose tests launch the multi-process program (`pytest.mark.processes`)
    spread evenly over the others (in collection order), so that the two workers
    (`--dist loadfile`) seldom run two of them at once, and neither is left for the end."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    launching = [f for f, its in files.items() if its[0].get_closest_marker("processes")]
    others = [f for f in files if f not in launching]
    order = list(others)
    step = len(others) / (len(launching) + 1)
    for i, f in reversed(list(enumerate(launching, start=1))):
        order.insert(round(i * step), f)
    items[:] = [item for f in order for item in files[f]]
