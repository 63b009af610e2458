"""Entry point: `python -m streamrl_jax.launch --config=configs/NAME.py[:variant] --workdir=DIR`.

Only parses flags; `streamrl_jax.run` builds and runs the experiment. With no
flags it runs the quickstart (configs/quickstart.py) in ./workdir/quickstart.
Override any field: `--config.pipeline.mode=stream_sync --config.pipeline.steps=5`.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(_REPO, "configs", "quickstart.py"),
    "Experiment config file (get_config(arg)); append :variant for a variant.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", os.path.join("workdir", "quickstart"), "Where metrics, traces and checkpoints go."
)
_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    -1,
    "Host CPU devices to expose when running on CPU: -1 = as many as the config's mesh "
    "needs (mesh.generate_devices + mesh.train_devices), 0 = JAX's default.",
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from streamrl_jax import config as config_lib

    cfg = config_lib.from_config_dict(_CONFIG.value)
    import jax  # after flag parsing: the CPU device count must be set before the backend starts

    wanted = cfg.mesh.generate_devices + cfg.mesh.train_devices
    if _DEVICES.value:
        jax.config.update("jax_num_cpu_devices", wanted if _DEVICES.value < 0 else _DEVICES.value)
    from streamrl_jax import run

    logging.info("config:\n%s", cfg)
    run.run(cfg, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
