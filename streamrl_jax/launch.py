"""Entry point: `python -m streamrl_jax.launch --config=configs/NAME.py[:variant] --workdir=DIR`.

Only parses flags; `streamrl_jax.pipeline` builds and runs the experiment. With no
flags it runs the quickstart (configs/quickstart.py) in ./workdir/quickstart.
Override any field: `--config.pipeline.mode=stream_sync --config.pipeline.steps=5`.

The console shows a start-up summary, the progress line, warnings and errors; the
config and every INFO line go to `<workdir>/log.txt` (`streamrl_jax/console.py`;
`--verbosity=0` shows INFO on the console too). JAX's persistent compilation cache
is on for one-process runs (`--compile_cache`), so a second run of the same config
loads its compiled programs instead of compiling them again.

Several processes (docs/multicontroller.md): the same command on every process
of a `jax.distributed` program, e.g.
`python launch/local.py -n 2 -g 1 -- python -m streamrl_jax.launch --config=...`;
processes 0 .. G-1 generate, the others train (`pipeline/processes/`).

Stage processes (`--processes`): on a CPU machine XLA runs all of a process's devices
on one thread pool, so the generation and training stages of one process take turns
(DESIGN.md §5). `--processes=stages` runs this command as that program itself, one
generation and one training process, each pinned to its half of the cores; `auto` does
so where it should pay (`stage_plan`: a CPU machine with four cores or more, a
disaggregated config the processes support, a model larger than the tiny test model)
and otherwise runs both stages here; `one` (the default: on 2 cores the quickstart ran
1.36x slower a step in stages, BENCHMARKS.md) always here.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from streamrl_jax import platforms

if TYPE_CHECKING:
    from streamrl_jax.config import ExperimentConfig
    from streamrl_jax.console import Console
    from streamrl_jax.distributed.roles import DistributedConfig
    from streamrl_jax.pipeline import RunResult

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_error(message: str) -> NoReturn:
    """A mistake of the user's (config, a file they named): one line, exit status 2.
    A message that carries a traceback (a config file that raised) keeps its last line."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    text = lines[-1] if any(line.startswith("Traceback") for line in lines) else " ".join(lines)
    print(f"error: {text}", file=sys.stderr)
    sys.exit(2)


def _bad_override(argv: list[str], exc: BaseException) -> NoReturn:
    """A `--config.a.b=v` override that names no field or does not convert, named."""
    from streamrl_jax import config as config_lib

    fields = config_lib.defaults()
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    for arg in overrides:
        path = arg[len("--config.") :].partition("=")[0]
        section, _, field = path.partition(".")
        if section not in fields or (field and field not in fields[section]):
            known = ", ".join(sorted(fields[section])) if section in fields else ""
            where = f" ({section} has: {known})" if known else ""
            _user_error(f"{arg}: no config field {path}{where}")
    named = overrides or [a for a in argv[1:] if a.startswith("--config=")] or ["flags"]
    _user_error(f"{' '.join(named)}: {exc}")


try:  # ml_collections applies the --config.* overrides of sys.argv right here
    _CONFIG = config_flags.DEFINE_config_file(
        "config",
        os.path.join(_REPO, "configs", "quickstart.py"),
        "Experiment config file (get_config(arg)); append :variant for a variant.",
        lock_config=True,
    )
except Exception as e:  # noqa: BLE001 - the config file or an override; the user's
    _bad_override(sys.argv, e)
_WORKDIR = flags.DEFINE_string(
    "workdir", os.path.join("workdir", "quickstart"), "Where metrics, traces and checkpoints go."
)
_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    -1,
    "Host CPU devices to expose when running on CPU: -1 = as many as the config's mesh "
    "needs (mesh.generate_devices + mesh.train_devices, + judge.devices with a judge on "
    "its scoring mesh; "
    "with several processes, the process's own role's count), 0 = JAX's default.",
)


def _default_compile_cache() -> str:
    """`$XDG_CACHE_HOME/streamrl_jax/jax`, or `~/.cache/streamrl_jax/jax` (the XDG base
    directory rule: an unset or relative XDG_CACHE_HOME is ignored)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "streamrl_jax", "jax")


_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    _default_compile_cache(),
    "JAX's persistent compilation cache: a second run of the same config loads its "
    "compiled programs from here instead of compiling them. Safe to delete at any time "
    "(it only costs the next run its compile time). Empty (--compile_cache=) turns it off. "
    "On by default for one-process runs; a multi-controller process uses it only when "
    "this flag is given (JAX writes entries from process 0 only). A JAX_COMPILATION_"
    "CACHE_DIR in the environment replaces the default.",
)
_PROCESSES = flags.DEFINE_enum(
    "processes",
    "one",  # on 2 cores the stages measured slower (BENCHMARKS.md, "The main job, ...")
    ["auto", "one", "stages"],
    "stages: run the generation and training stages as two pinned processes of one "
    "multi-controller program (checkpoints and resume as in one); one: both in this "
    "process; auto: stages where they should pay (a CPU machine with >= 4 cores, a config the "
    "processes support, a model larger than the tiny one), else one.",
)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    ["auto", "on", "off"],
    "Run as one process of a multi-controller program: auto = when STREAMRL_NUM_PROCESSES "
    "(or SLURM_NTASKS under SLURM) is > 1; on = also when jax.distributed detects the "
    "processes itself (Cloud TPU).",
)


def _distributed_config() -> DistributedConfig | None:
    """The multi-controller settings from the environment, or None for one process."""
    if _DISTRIBUTED.value == "off":
        return None
    from streamrl_jax.distributed import roles

    count = os.environ.get(roles.ENV_NUM_PROCESSES) or os.environ.get("SLURM_NTASKS", "1")
    if _DISTRIBUTED.value == "auto" and not (count.isdigit() and int(count) > 1):
        return None
    return roles.DistributedConfig.from_env()


def _default_cache_dir() -> str | None:
    """The compile cache directory a one-process run would use (`--compile_cache`, or the
    environment's), without turning anything on; None when it is off."""
    if not _COMPILE_CACHE.present and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    return (
        os.path.abspath(os.path.expanduser(_COMPILE_CACHE.value)) if _COMPILE_CACHE.value else None
    )


def _compile_cache(several_processes: bool) -> str | None:
    """Turns JAX's persistent compilation cache on (`--compile_cache`); its directory,
    or None when it is off."""
    import jax

    from streamrl_jax.distributed import compile_cache

    flag = _COMPILE_CACHE
    if not flag.present and (several_processes or jax.config.jax_compilation_cache_dir):
        path = jax.config.jax_compilation_cache_dir or None  # the environment's, or off
        if path:  # processes may share it (a multi-process run): JAX's lock, at least
            compile_cache.configure(("jax_compilation_cache_max_size",))
            compile_cache.heal(path)
        return path
    if not flag.value:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = os.path.abspath(os.path.expanduser(flag.value))
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, e.strerror
    else:
        why = "not writable"
    if not writable:
        if flag.present:
            _user_error(f"--compile_cache={flag.value}: cannot use the directory ({why})")
        logging.warning("compile cache off: %s: %s (--compile_cache=DIR names another)", path, why)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    compile_cache.configure()
    compile_cache.heal(path)
    return path


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with every user mistake one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _user_error(f"{e}\n(--helpshort lists the flags)" if "Traceback" not in str(e) else e)
    except Exception as e:  # noqa: BLE001 - the config file or an override; the user's
        _bad_override(argv, e)


class _Place(NamedTuple):
    """Where this process sits in the run, and what it shows."""

    name: str | None  # names its log file (None: the one process of a run)
    role: str | None  # "generation" | "training" | "scoring" (None: both, or not known yet)
    layout: str | None  # the processes, in words, for the summary (None: one process)
    speaks: bool  # shows the summary and the closing lines (one process of a program)


def _place(dcfg: DistributedConfig | None) -> _Place:
    """This process's place: the one process, or one of a multi-controller program's,
    where the first training process (it writes the metrics) speaks."""
    if dcfg is None:
        return _Place(None, None, None, True)
    if dcfg.process_id is None:  # JAX finds the processes itself (Cloud TPU): each speaks
        return _Place(f"{socket.gethostname()}-{os.getpid()}", None, None, True)
    role, g, n = dcfg.role_of(dcfg.process_id), dcfg.generation_processes, dcfg.num_processes
    s = dcfg.scoring_processes
    scoring = f", {s} scoring" if s else ""
    layout = f"{n} processes ({g} generation, {n - g - s} training{scoring}), a log file each"
    return _Place(f"p{dcfg.process_id}-{role}", role, layout, dcfg.process_id == g)


# Cores `auto` asks for: on 2 cores (one a stage) the quickstart measured 1.36x slower a
# step than one process, whose stages each use both cores while the other waits
# (BENCHMARKS.md "The main job, one process or stage processes"); more cores unmeasured.
_STAGES_MIN_CORES = 4


def stage_plan(
    cfg: ExperimentConfig, choice: str, cpus: list[int], accelerator: bool
) -> tuple[bool, str]:
    """Whether to run the stages as two processes (`--processes` = `choice`), and why (not).

    Raises:
      UserError: `choice` is "stages" and they cannot run (naming every reason).
    """
    from streamrl_jax import config as config_lib
    from streamrl_jax.errors import UserError

    if choice == "one":
        return False, "--processes=one"
    problems = []
    if len(cpus) < 2:
        problems.append(f"this process may use {len(cpus)} core")
    elif choice == "auto" and len(cpus) < _STAGES_MIN_CORES:
        problems.append(
            f"{len(cpus)} cores (on 2 the stages measured slower than one process; auto "
            f"asks for {_STAGES_MIN_CORES})"
        )
    if accelerator:
        problems.append("an accelerator is attached (its stages do not share a thread pool)")
    try:
        config_lib.check(cfg, config_lib.Processes(total=2, generation=1))
    except config_lib.ConfigError as e:
        problems.append(str(e))
    if choice == "auto" and cfg.model.source == "tiny":
        # Its steps are a few hundred milliseconds: the second process's start-up and the
        # weight transfer would outweigh them.
        problems.append("the tiny model (its steps are too short to gain)")
    if not problems:
        return True, f"generation on CPUs {_half(cpus, 0)}, training on CPUs {_half(cpus, 1)}"
    if choice == "stages":
        raise UserError(f"--processes=stages: {'; '.join(problems)}")
    return False, "; ".join(problems)


def _half(cpus: list[int], i: int) -> list[int]:
    """Stage i's CPUs: the first half of `cpus` generates, the rest trains."""
    k = max(len(cpus) // 2, 1)
    return cpus[:k] if i == 0 else cpus[k:]


def _run_stages(cache: str | None) -> int:
    """This command as a 2-process program (1 generation, 1 training), each process pinned
    to its half of the cores; the training process speaks (its lines as they are), the
    generation process's lines are prefixed. Returns the program's exit status."""
    from streamrl_jax.distributed import local_program

    command = [sys.executable, *sys.orig_argv[1:]]
    if cache and not _COMPILE_CACHE.present:  # a child uses the cache only when told
        command.append(f"--compile_cache={cache}")
    cpus = sorted(os.sched_getaffinity(0))
    return local_program.supervise(
        [command, command],
        1,
        prefixes=["[generation] ", ""],
        affinity=[_half(cpus, 0), _half(cpus, 1)],
        grace_s=300.0,  # SIGTERM checkpoints the last step boundary before stopping
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )


def _run(
    cfg: ExperimentConfig, dcfg: DistributedConfig | None, out: Console
) -> RunResult | dict[str, RunResult] | None:
    """The experiment, in this process or as one process of several; the run's result
    (each learner's by name with `learners`; None on a generation process)."""
    from streamrl_jax.errors import UserError

    try:
        if dcfg is None and cfg.learners:
            from streamrl_jax.pipeline import learners

            return learners.run(cfg, _WORKDIR.value)
        if dcfg is None:
            from streamrl_jax import pipeline

            return pipeline.run(cfg, _WORKDIR.value)
        from streamrl_jax.pipeline import processes

        return processes.run_process(cfg, _WORKDIR.value, dcfg)
    except (UserError, FileNotFoundError) as e:  # a field or a file of the user's, named
        _user_error(str(e))
    except Exception:
        out.failed()  # the traceback into the log file too
        raise


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from streamrl_jax import config as config_lib
    from streamrl_jax import console
    from streamrl_jax.errors import UserError

    value = _CONFIG.value
    if (failure := getattr(value, "_error", None)) is not None:  # the file did not load
        _user_error(f"--config: {failure}")
    try:
        dcfg = _distributed_config()
    except ValueError as e:  # the STREAMRL_* / SLURM_* environment, or the run key, named
        _user_error(str(e))
    place = _place(dcfg)
    # Logging goes to its places first: checking the config imports the task libraries,
    # and they log. --verbosity given: the console shows what the file gets.
    try:
        out = console.start(
            _WORKDIR.value, process=place.name, verbose=flags.FLAGS["verbosity"].present
        )
    except OSError as e:
        _user_error(f"--workdir={_WORKDIR.value}: cannot write its log file ({e.strerror})")
    try:
        cfg = config_lib.from_config_dict(value)
    except UserError as e:
        _user_error(str(e))
    if dcfg is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
            stages, why = stage_plan(cfg, _PROCESSES.value, cpus, platforms.accelerator_attached())
        except UserError as e:
            _user_error(str(e))
        logging.info("stage processes: %s (%s)", "yes" if stages else "no", why)
        if stages:
            out.say([f"stages as 2 pinned processes: {why} (--processes=one: one process)"])
            sys.exit(_run_stages(_default_cache_dir()))
    import jax  # after flag parsing: the CPU device count must be set before the backend starts

    if (names := platforms.jax_platforms(os.environ)) is not None:  # before any backend starts
        jax.config.update("jax_platforms", names)
        logging.info("JAX platforms: %s (no TPU attached; JAX_PLATFORMS chooses)", names)
    logging.info("CPUs this process may use: %s", sorted(os.sched_getaffinity(0)))

    mesh = cfg.mesh
    # The scoring mesh (a judge that is the generation service's tenant has none).
    judge = cfg.judge.devices if cfg.judge.model and cfg.judge.placement == "scoring" else 0
    # (where ingest runs, unless scoring processes serve the judge)
    here = 0 if dcfg is not None and dcfg.scoring_processes else judge
    per_role = {
        "generation": mesh.generate_devices,
        "training": mesh.train_devices + here,
        "scoring": judge,
    }
    wanted = per_role.get(place.role, mesh.generate_devices + mesh.train_devices + judge)
    if _DEVICES.value:
        jax.config.update("jax_num_cpu_devices", wanted if _DEVICES.value < 0 else _DEVICES.value)
    cache = _compile_cache(several_processes=dcfg is not None)
    if place.speaks:
        out.say(
            console.summary(
                cfg,
                _WORKDIR.value,
                log_file=out.log_file,
                compile_cache=cache,
                processes=place.layout,
            )
        )
    logging.info("config:\n%s", "\n".join(console.config_lines(cfg)))
    result = _run(cfg, dcfg, out)
    results = result if isinstance(result, dict) else {"": result}
    for name, r in results.items():
        if not place.speaks or r is None:
            continue
        lines = console.closing(
            start=r.start_batch,
            end=r.start_batch + len(r.steps),
            wall_s=r.wall_s,
            samples=r.samples,
            evals=r.evals,
            stopped=r.stopped,
        )
        out.say([f"learner {name}: {line}" if name else line for line in lines])
    from streamrl_jax.distributed import roles

    # Every process leaves within seconds of the others; the first training process,
    # serving the coordination service, last.
    roles.shutdown(dcfg.shutdown_timeout_s if dcfg is not None else 10.0)


_HUGEPAGES = "glibc.malloc.hugetlb=1"


def reexec_with_malloc_hugepages() -> None:
    """Starts this command again with glibc's malloc asking for transparent huge pages.

    XLA:CPU allocates each step's large buffers afresh; with 4 KB pages a SmolLM2 train
    step took 0.5-0.9 M page faults, and this tunable cut them to ~5 k and the step's
    CPU time by ~10% (docs/trainer.md). glibc reads it only at process start, hence the
    exec (same pid, same arguments); glibc versions without it ignore it. Set
    `STREAMRL_MALLOC_HUGEPAGES=0` to keep the environment as it is.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        not sys.platform.startswith("linux")
        or "glibc.malloc.hugetlb" in tunables
        or os.environ.get("STREAMRL_MALLOC_HUGEPAGES", "1") == "0"
    ):
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{_HUGEPAGES}" if tunables else _HUGEPAGES
    os.execv(sys.executable, sys.orig_argv)


if __name__ == "__main__":
    reexec_with_malloc_hugepages()
    app.run(main, flags_parser=_parse_flags)
