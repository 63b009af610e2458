"""Entry point: `python -m streamrl_jax.launch --config=configs/NAME.py[:variant] --workdir=DIR`.

Only parses flags; `streamrl_jax.pipeline` builds and runs the experiment. With no
flags it runs the quickstart (configs/quickstart.py) in ./workdir/quickstart.
Override any field: `--config.pipeline.mode=stream_sync --config.pipeline.steps=5`.

Several processes (docs/multicontroller.md): the same command on every process
of a `jax.distributed` program, e.g.
`python launch/local.py -n 2 -g 1 -- python -m streamrl_jax.launch --config=...`;
processes 0 .. G-1 generate, the others train (`pipeline/processes.py`).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

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
    "needs (mesh.generate_devices + mesh.train_devices; with several processes, the "
    "process's own role's count), 0 = JAX's default.",
)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    ["auto", "on", "off"],
    "Run as one process of a multi-controller program: auto = when STREAMRL_NUM_PROCESSES "
    "(or SLURM_NTASKS under SLURM) is > 1; on = also when jax.distributed detects the "
    "processes itself (Cloud TPU).",
)


def _distributed_config():
    """The multi-controller settings from the environment, or None for one process."""
    if _DISTRIBUTED.value == "off":
        return None
    from streamrl_jax.distributed import roles

    count = os.environ.get(roles.ENV_NUM_PROCESSES) or os.environ.get("SLURM_NTASKS", "1")
    if _DISTRIBUTED.value == "auto" and not (count.isdigit() and int(count) > 1):
        return None
    return roles.DistributedConfig.from_env()


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with every user mistake one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _user_error(f"{e}\n(--helpshort lists the flags)" if "Traceback" not in str(e) else e)
    except Exception as e:  # noqa: BLE001 - the config file or an override; the user's
        _bad_override(argv, e)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from streamrl_jax import config as config_lib
    from streamrl_jax.errors import UserError

    value = _CONFIG.value
    if (failure := getattr(value, "_error", None)) is not None:  # the file did not load
        _user_error(f"--config: {failure}")
    try:
        cfg = config_lib.from_config_dict(value)
    except UserError as e:
        _user_error(str(e))
    import jax  # after flag parsing: the CPU device count must be set before the backend starts

    try:
        dcfg = _distributed_config()
    except ValueError as e:  # the STREAMRL_* / SLURM_* environment, or the run key, named
        _user_error(str(e))
    wanted = cfg.mesh.generate_devices + cfg.mesh.train_devices
    if dcfg is not None and dcfg.process_id is not None:
        generation = dcfg.role_of(dcfg.process_id) == "generation"
        wanted = cfg.mesh.generate_devices if generation else cfg.mesh.train_devices
    if _DEVICES.value:
        jax.config.update("jax_num_cpu_devices", wanted if _DEVICES.value < 0 else _DEVICES.value)
    logging.info("config:\n%s", cfg)
    try:
        if dcfg is None:
            from streamrl_jax import pipeline

            pipeline.run(cfg, _WORKDIR.value)
            return
        from streamrl_jax.pipeline import processes

        processes.run_process(cfg, _WORKDIR.value, dcfg)
    except (UserError, FileNotFoundError) as e:  # a field or a file of the user's, named
        _user_error(str(e))
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
