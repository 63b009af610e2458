"""Which JAX platforms this process may start, read without starting JAX.

`jax_platforms` keeps a machine without a TPU from probing one (libtpu, installed with
the test extra, prints its start-up errors otherwise); `accelerator_attached` says
whether a GPU or TPU is there. The launcher and the server (`launch.py`, `serve.py`)
call them before any backend starts.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
from collections.abc import Mapping

# Device nodes (glob patterns) of attached accelerators: TPU chips appear as /dev/accel*
# (v2 to v5e hosts) or as VFIO groups (v5p, v6e hosts)
TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
# JAX's GPU platforms: (platform, its plugin's package name prefix, its device nodes)
GPUS = (("cuda", "jax-cuda", "/dev/nvidia[0-9]*"), ("rocm", "jax-rocm", "/dev/kfd"))


def attached(patterns: tuple[str, ...]) -> bool:
    return any(glob.glob(p) for p in patterns)


def accelerator_attached() -> bool:
    """A GPU or TPU device node, or JAX_PLATFORMS naming one (without starting JAX)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    return attached((*TPU_NODES, *(nodes for _, _, nodes in GPUS)))


def jax_platforms(env: Mapping[str, str]) -> str | None:
    """The platforms JAX may start in this process (`jax_platforms`), or None to leave
    JAX's own search: where the user named them (JAX_PLATFORMS, JAX_PLATFORM_NAME,
    JAX_FORCE_TPU_INIT) or a TPU is attached.

    Otherwise no TPU can be there, yet JAX's search starts libtpu wherever it is installed
    (the test extra brings it), and libtpu prints its start-up errors on the console
    ("unexpected worker hostname", "Failed to find host bounds") or fails on another
    process's lock file. So: every platform but TPU, i.e. each GPU platform whose device
    node is present and whose JAX plugin is installed (a platform named but not installed
    would fail the start), then the CPU. Compiling for a TPU topology that is not attached
    (`jax.experimental.topologies`, the pod planner) loads libtpu itself, unaffected.
    """
    asked = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "JAX_FORCE_TPU_INIT")
    if any(env.get(name) for name in asked) or attached(TPU_NODES):
        return None
    gpus = [(platform, plugin) for platform, plugin, nodes in GPUS if attached((nodes,))]
    if gpus:  # read the installed packages only where a GPU is attached
        installed = [
            (d.metadata["Name"] or "").lower().replace("_", "-")
            for d in importlib.metadata.distributions()
        ]
        gpus = [(p, plugin) for p, plugin in gpus if any(n.startswith(plugin) for n in installed)]
    return ",".join([*(platform for platform, _ in gpus), "cpu"])
