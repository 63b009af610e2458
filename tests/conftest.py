"""Test-wide JAX settings: 8 host CPU devices, strict ranks, no implicit transfers.

These must run before any JAX backend starts, so they live here, imported by
pytest before any test module.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_transfer_guard", "disallow")
