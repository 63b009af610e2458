"""Checkpoints and exact resume (see `docs/checkpoint.md`).

* `manager`: `Checkpointer` (one orbax `CheckpointManager`: train state,
  extra array trees, ranker, JSON metadata saved together, asynchronous,
  keep-last-K, re-sharding restore) and `restore_params_only`.
* `policy`: `policy_params`, a run's policy at a checkpoint, LoRA-aware (`init_from`,
  the distillation teacher, export, the tools).
* `trees`: model fingerprint, shape signatures, typed PRNG keys.
* `npz`: parameters as one .npz of host arrays (`log.final_params`).
* `shutdown`: SIGINT/SIGTERM to a flag the loop polls (`install_shutdown_handler`).
"""

from streamrl_jax.checkpoint.manager import (
    FORMAT_VERSION,
    Checkpointer,
    Restored,
    restore_params_only,
)
from streamrl_jax.checkpoint.npz import save_params_npz
from streamrl_jax.checkpoint.policy import policy_params
from streamrl_jax.checkpoint.shutdown import ShutdownRequest, install_shutdown_handler
from streamrl_jax.checkpoint.trees import FINGERPRINT_FIELDS, abstract_tree, model_fingerprint

__all__ = [
    "FINGERPRINT_FIELDS",
    "FORMAT_VERSION",
    "Checkpointer",
    "Restored",
    "ShutdownRequest",
    "abstract_tree",
    "install_shutdown_handler",
    "model_fingerprint",
    "policy_params",
    "restore_params_only",
    "save_params_npz",
]
