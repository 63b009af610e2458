"""Test-wide JAX settings: 8 host CPU devices and strict rank promotion.

These must run before any JAX backend starts, so they live here, imported by
pytest before any test module.

Transfer guard: with jax 0.10 on CPU a global `jax_transfer_guard="disallow"`
rejects even eager `jnp.zeros` (its scalar fill value counts as a host-to-device
transfer) while device-to-host copies are zero-copy and never guarded. So the
guard is applied where it means something: tests of the hot loops (the engine's
decode loop, the trainer's step) run them, after warm-up, inside
`jax.transfer_guard("disallow")`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
