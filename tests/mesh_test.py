"""Role meshes: disjoint splits, colocation, per-instance meshes, errors."""

import jax
import pytest

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.mesh import MeshConfig


def _ids(mesh) -> set[int]:
    return {d.id for d in mesh.devices.reshape(-1)}


def test_disjoint_split():
    devices = jax.devices()
    assert len(devices) == 8
    cfg = MeshConfig(generate_devices=4, train_devices=4, train_tp=2, instance_tp=2)
    m = mesh_lib.make_meshes(cfg)
    assert m.generate.axis_names == ("instance", "tp") and m.train.axis_names == ("fsdp", "tp")
    assert dict(m.generate.shape) == {"instance": 2, "tp": 2}
    assert dict(m.train.shape) == {"fsdp": 2, "tp": 2}
    assert m.num_instances == 2 and not m.colocated
    assert _ids(m.generate) == {d.id for d in devices[:4]}  # generation takes the first ones
    assert _ids(m.train) == {d.id for d in devices[4:]}


def test_partial_use_of_devices():
    m = mesh_lib.make_meshes(MeshConfig(generate_devices=1, train_devices=2))
    assert m.generate.size == 1 and m.train.size == 2
    assert not _ids(m.generate) & _ids(m.train)


def test_colocated_shares_devices():
    m = mesh_lib.make_meshes(MeshConfig(colocated=True, train_tp=2, instance_tp=4))
    assert m.colocated and _ids(m.generate) == _ids(m.train) == {d.id for d in jax.devices()}
    assert dict(m.train.shape) == {"fsdp": 4, "tp": 2}
    assert dict(m.generate.shape) == {"instance": 2, "tp": 4}


def test_instance_meshes():
    m = mesh_lib.make_meshes(MeshConfig(generate_devices=4, train_devices=4, instance_tp=1))
    default = mesh_lib.instance_meshes(m.generate)
    assert [dict(x.shape) for x in default] == [{"tp": 1}] * 4
    sized = mesh_lib.instance_meshes(m.generate, [1, 3])
    assert [x.size for x in sized] == [1, 3]
    assert not _ids(sized[0]) & _ids(sized[1])
    assert _ids(sized[0]) | _ids(sized[1]) == _ids(m.generate)
    with pytest.raises(ValueError, match="sum to the generation mesh's 4 rows"):
        mesh_lib.instance_meshes(m.generate, [1, 2])
    with pytest.raises(ValueError, match="positive"):
        mesh_lib.instance_meshes(m.generate, [0, 4])


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (MeshConfig(generate_devices=4, train_devices=5), "exceeds the 8 available devices"),
        (MeshConfig(generate_devices=2, train_devices=3, train_tp=2), "mesh.train_tp"),
        (MeshConfig(generate_devices=3, train_devices=1, instance_tp=2), "mesh.instance_tp"),
        (MeshConfig(generate_devices=0), "mesh.generate_devices must be >= 1"),
        (MeshConfig(colocated=True, train_tp=3), "mesh.train_tp"),
    ],
)
def test_errors_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.make_meshes(cfg)


def test_explicit_device_list():
    devices = jax.devices()[2:6]
    m = mesh_lib.make_meshes(MeshConfig(generate_devices=2, train_devices=2), devices)
    assert _ids(m.generate) | _ids(m.train) == {d.id for d in devices}
    with pytest.raises(ValueError, match="exceeds the 4 available"):
        mesh_lib.make_meshes(MeshConfig(generate_devices=3, train_devices=2), devices)
