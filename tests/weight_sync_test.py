"""Cross-mesh weight sync: exact values, target shardings and dtype, versions, background."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl_jax import mesh as meshlib
from streamrl_jax import sharding
from streamrl_jax.model import config, llama
from streamrl_jax.weight_sync import WeightSync, place_on, tree_bytes

CFG = config.tiny(num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def setup():
    meshes = meshlib.make_meshes(
        meshlib.MeshConfig(generate_devices=4, train_devices=4, train_tp=1, instance_tp=2)
    )
    instances = meshlib.instance_meshes(meshes.generate)
    make = lambda: llama.create(CFG, seed=3)
    _, params = sharding.init_sharded(make, meshes.train, "train")
    dst = [sharding.state_shardings(params, m, "generate") for m in instances]
    return meshes, instances, params, dst


def _leaves(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def test_transfer_is_exact_and_lands_on_each_instance(setup):
    meshes, instances, params, dst = setup
    sync = WeightSync(jnp.float32, place_on(dst))
    out, stats = sync.transfer(params, version=7)
    assert len(out) == len(instances) == 2
    for pub, inst_mesh, shardings in zip(out, instances, dst, strict=True):
        assert pub.version == 7
        for got, sh in zip(jax.tree.leaves(pub.params), jax.tree.leaves(shardings), strict=True):
            assert got.sharding == sh
            assert set(got.sharding.device_set) == set(inst_mesh.devices.flat)
        for a, b in zip(_leaves(pub.params), _leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)
    assert stats.bytes == tree_bytes(params) and stats.destinations == 2


def test_cast_to_generation_dtype(setup):
    _, _, params, dst = setup
    out, stats = WeightSync(jnp.bfloat16, place_on(dst)).transfer(params, version=1)
    leaves = jax.tree.leaves(out[0].params)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert stats.bytes * 2 == tree_bytes(params)
    for a, b in zip(_leaves(out[0].params), _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))


def test_background_transfer_and_errors(setup):
    _, _, params, dst = setup
    sync = WeightSync(jnp.float32, place_on(dst))
    landed = []
    sync.start(params, version=2, on_done=lambda pubs, st: landed.append((pubs[0].version, st)))
    with pytest.raises(RuntimeError, match="already in flight"):
        sync.start(params, version=3)
    out, stats = sync.result(timeout=60)
    assert out[1].version == 2 and stats.version == 2
    assert landed == [(2, stats)]  # the callback ran with the same result
    with pytest.raises(RuntimeError, match="no transfer in flight"):
        sync.result(timeout=1)
