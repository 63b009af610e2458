"""Role meshes: one explicit split of the devices into a generation and a training mesh.

* Training mesh, axes ("fsdp", "tp"): parameters and optimizer state sharded
  FSDP-style over "fsdp", optional tensor parallel over "tp".
* Generation mesh, axes ("instance", "tp"): each row is one generation
  instance; `instance_meshes` cuts it into 1-D ("tp",) meshes, one per
  instance, whose devices run that instance's tensor-parallel engine.
* Colocated mode: one device set serves both roles (the two meshes share
  devices and differ only in shape).

Meshes are values built once by `make_meshes`; nothing here sets a global mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

TRAIN_AXES = ("fsdp", "tp")
GENERATE_AXES = ("instance", "tp")
INSTANCE_AXES = ("tp",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """How the devices are split between the two roles.

    Attributes:
      colocated: generation and training share all devices (ColocationRL baseline).
      generate_devices: devices given to generation (ignored when colocated).
      train_devices: devices given to training (ignored when colocated).
      train_tp: tensor-parallel size inside the training mesh; fsdp = train/train_tp.
      instance_tp: devices per generation instance (its tensor-parallel size).
    """

    colocated: bool = False
    generate_devices: int = 1
    train_devices: int = 1
    train_tp: int = 1
    instance_tp: int = 1


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The role meshes of one run."""

    generate: Mesh  # axes ("instance", "tp")
    train: Mesh  # axes ("fsdp", "tp")
    colocated: bool

    @property
    def num_instances(self) -> int:
        return self.generate.shape["instance"]


def _mesh(devices: Sequence[jax.Device], shape: tuple[int, int], axes: tuple[str, str]) -> Mesh:
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def make_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Meshes:
    """Splits `devices` (default `jax.devices()`) into the role meshes.

    Generation takes the first `generate_devices`, training the next
    `train_devices`; the split is disjoint unless `cfg.colocated`.

    Raises:
      ValueError: naming the field when the split does not fit the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name in ("generate_devices", "train_devices", "train_tp", "instance_tp"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"mesh.{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.colocated:
        gen_devices = train_devices = devices
    else:
        need = cfg.generate_devices + cfg.train_devices
        if need > n:
            raise ValueError(
                f"mesh.generate_devices ({cfg.generate_devices}) + mesh.train_devices "
                f"({cfg.train_devices}) = {need} exceeds the {n} available devices"
            )
        gen_devices = devices[: cfg.generate_devices]
        train_devices = devices[cfg.generate_devices : need]
    if len(train_devices) % cfg.train_tp:
        raise ValueError(
            f"mesh.train_tp ({cfg.train_tp}) must divide the training devices "
            f"({len(train_devices)})"
        )
    if len(gen_devices) % cfg.instance_tp:
        raise ValueError(
            f"mesh.instance_tp ({cfg.instance_tp}) must divide the generation devices "
            f"({len(gen_devices)})"
        )
    train = _mesh(train_devices, (len(train_devices) // cfg.train_tp, cfg.train_tp), TRAIN_AXES)
    generate = _mesh(
        gen_devices, (len(gen_devices) // cfg.instance_tp, cfg.instance_tp), GENERATE_AXES
    )
    return Meshes(generate=generate, train=train, colocated=cfg.colocated)


def instance_meshes(generate: Mesh, sizes: Sequence[int] | None = None) -> list[Mesh]:
    """Cuts the generation mesh into per-instance 1-D ("tp",) meshes.

    Args:
      generate: the ("instance", "tp") generation mesh.
      sizes: optional number of mesh rows per instance (default one row each);
        a larger instance gets a wider tensor-parallel group.
    """
    rows = generate.devices  # [instances, tp]
    sizes = [1] * rows.shape[0] if sizes is None else list(sizes)
    if sum(sizes) != rows.shape[0] or min(sizes, default=1) < 1:
        raise ValueError(
            f"instance sizes {sizes} must be positive and sum to the generation mesh's "
            f"{rows.shape[0]} rows"
        )
    out, start = [], 0
    for size in sizes:
        devs = rows[start : start + size].reshape(-1)
        out.append(Mesh(devs, INSTANCE_AXES, axis_types=(AxisType.Auto,)))
        start += size
    return out
