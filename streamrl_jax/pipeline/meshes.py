"""The role meshes of a run, from the config: one explicit split of the devices.

`make_meshes` splits one process's devices into the generation and training
meshes (colocated mode puts both roles on the whole pool); `role_meshes` builds
one role's mesh on its processes' devices in a multi-controller run;
`scoring_mesh` puts a judge (`judge.devices`) on this process's devices that no role
mesh uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.errors import UserError


def devices_needed(cfg: ExperimentConfig) -> int:
    """Devices of the generation and training meshes of one process."""
    return cfg.mesh.generate_devices + cfg.mesh.train_devices


def scoring_mesh(cfg: ExperimentConfig, meshes: mesh_lib.Meshes) -> Mesh:
    """The judge's ("tp",) mesh: the first `judge.devices` of this process's devices
    that neither role mesh of `meshes` uses."""
    used = {d.id for m in (meshes.train, meshes.generate) for d in m.devices.flat}
    free = [d for d in jax.local_devices() if d.id not in used]
    n = cfg.judge.devices
    if len(free) < n:
        raise UserError(
            f"judge.devices={n}: this process has {len(free)} device(s) beside its generation "
            "and training meshes (on CPU, --cpu_devices or mesh sizes leave room for it)"
        )
    return Mesh(np.asarray(free[:n], dtype=object), ("tp",), axis_types=(AxisType.Auto,))


def make_meshes(cfg: ExperimentConfig, devices: list[jax.Device] | None = None) -> mesh_lib.Meshes:
    """The role meshes; colocated mode puts both roles on the whole device pool."""
    devices = list(jax.devices() if devices is None else devices)
    need = devices_needed(cfg)
    if need > len(devices):
        raise UserError(
            f"mesh.generate_devices + mesh.train_devices = {need} exceeds the "
            f"{len(devices)} available devices"
        )
    pool = devices[:need]
    m = cfg.mesh
    if cfg.pipeline.mode == "colocated":
        if need % len(m.instance_slots):
            raise UserError(
                f"colocated: {need} devices cannot be split into "
                f"{len(m.instance_slots)} instances (mesh.instance_slots)"
            )
        mc = mesh_lib.MeshConfig(
            colocated=True, train_tp=m.train_tp, instance_tp=need // len(m.instance_slots)
        )
    else:
        mc = mesh_lib.MeshConfig(
            generate_devices=m.generate_devices,
            train_devices=m.train_devices,
            train_tp=m.train_tp,
            instance_tp=m.instance_tp,
        )
    meshes = mesh_lib.make_meshes(mc, pool)
    if meshes.num_instances != len(m.instance_slots):
        raise UserError(
            f"mesh.instance_slots names {len(m.instance_slots)} instances but the generation "
            f"mesh has {meshes.num_instances} (generate_devices / instance_tp)"
        )
    return meshes


def role_meshes(
    cfg: ExperimentConfig, devices: Sequence[jax.Device], role: str, processes: int = 1
) -> mesh_lib.Meshes:
    """One role's mesh on its processes' devices (several processes): the first
    `mesh.generate_devices` (generation) or `processes * mesh.train_devices` (training:
    the training mesh spans every training process) of `devices`. Built as a
    "colocated" split of those devices, so both meshes of the result span them; only
    the role's own mesh is used."""
    m = cfg.mesh
    need = m.generate_devices if role == "generation" else m.train_devices * processes
    if need > len(devices):
        field = "mesh.generate_devices" if role == "generation" else "mesh.train_devices"
        raise UserError(
            f"{field} = {need // processes} exceeds the {len(devices) // processes} devices "
            f"of this {role} process"
        )
    generation = role == "generation"  # the other role's tp is 1: it always divides
    mc = mesh_lib.MeshConfig(
        colocated=True,
        train_tp=1 if generation else m.train_tp,
        instance_tp=m.instance_tp if generation else 1,
    )
    meshes = mesh_lib.make_meshes(mc, list(devices)[:need])
    if generation and meshes.num_instances != len(m.instance_slots):
        raise UserError(
            f"mesh.instance_slots names {len(m.instance_slots)} instances but each generation "
            f"process has {meshes.num_instances} (generate_devices / instance_tp)"
        )
    return meshes
