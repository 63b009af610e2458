"""Sharding: per-role PartitionSpec snapshot, sharded == unsharded forward, rule errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from streamrl_jax import mesh as mesh_lib
from streamrl_jax import sharding
from streamrl_jax.model import config, llama

# Heads (4), kv heads (2), vocab (256), mlp (128) divide tp=2; embed (64) divides fsdp=4.
_CFG = config.tiny(tie_embeddings=False, qkv_bias=True)

# Regenerate only on a deliberate rule-table change; every entry is a design decision.
_TRAIN_TABLE = {
    "embed": P("tp", "fsdp"),
    "final_norm": P(None),
    "lm_head": P("fsdp", "tp"),
    "layers/attn_norm": P(None, None),
    "layers/mlp_norm": P(None, None),
    "layers/q": P(None, "fsdp", "tp", None),
    "layers/k": P(None, "fsdp", "tp", None),
    "layers/v": P(None, "fsdp", "tp", None),
    "layers/o": P(None, "tp", None, "fsdp"),
    "layers/gate": P(None, "fsdp", "tp"),
    "layers/up": P(None, "fsdp", "tp"),
    "layers/down": P(None, "tp", "fsdp"),
    "layers/q_bias": P(None, "tp", None),
    "layers/k_bias": P(None, "tp", None),
    "layers/v_bias": P(None, "tp", None),
}
_GENERATE_TABLE = {
    "embed": P("tp", None),
    "final_norm": P(None),
    "lm_head": P(None, "tp"),
    "layers/attn_norm": P(None, None),
    "layers/mlp_norm": P(None, None),
    "layers/q": P(None, None, "tp", None),
    "layers/k": P(None, None, "tp", None),
    "layers/v": P(None, None, "tp", None),
    "layers/o": P(None, "tp", None, None),
    "layers/gate": P(None, None, "tp"),
    "layers/up": P(None, None, "tp"),
    "layers/down": P(None, "tp", None),
    "layers/q_bias": P(None, "tp", None),
    "layers/k_bias": P(None, "tp", None),
    "layers/v_bias": P(None, "tp", None),
}


@pytest.fixture(scope="module")
def meshes():
    return mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True, train_tp=2, instance_tp=2))


def _abstract(cfg=_CFG):
    return nnx.split(nnx.eval_shape(lambda: llama.create(cfg)))


def test_spec_table_snapshot(meshes):
    _, abstract = _abstract()
    assert dict(meshes.train.shape) == {"fsdp": 4, "tp": 2}
    assert sharding.spec_table(abstract, meshes.train, "train") == _TRAIN_TABLE
    instance = mesh_lib.instance_meshes(meshes.generate)[0]
    assert dict(instance.shape) == {"tp": 2}
    assert sharding.spec_table(abstract, instance, "generate") == _GENERATE_TABLE


@jax.jit(static_argnums=0)
def _logits(graphdef, params, tokens_BxT):
    model = nnx.merge(graphdef, params)
    return model.logits(model.hidden_states(tokens_BxT, jnp.ones_like(tokens_BxT)))


def test_sharded_forward_equals_unsharded(meshes):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
    graphdef, state = nnx.split(llama.create(_CFG, seed=3))
    expected = np.asarray(_logits(graphdef, state, tokens))
    instance = mesh_lib.instance_meshes(meshes.generate)[1]
    for mesh, role in ((meshes.train, "train"), (instance, "generate")):
        g, sharded = sharding.init_sharded(lambda: llama.create(_CFG, seed=3), mesh, role)
        q = sharded["layers"]["q"][...]
        assert q.sharding.spec == (_TRAIN_TABLE if role == "train" else _GENERATE_TABLE)["layers/q"]
        assert len(q.sharding.device_set) == mesh.size
        np.testing.assert_allclose(np.asarray(_logits(g, sharded, tokens)), expected, atol=1e-5)


def test_place_host_arrays_slices_per_device(meshes):
    graphdef, state = nnx.split(llama.create(_CFG, seed=1))
    host = {
        sharding._path_name(p): np.asarray(v.get_value())
        for p, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=sharding._is_var)
    }
    _, abstract = _abstract()
    placed = sharding.place_host_arrays(abstract, host, meshes.train, "train")
    gate = placed["layers"]["gate"][...]
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 16, 64)}
    np.testing.assert_array_equal(np.asarray(gate), host["layers/gate"])
    missing = dict(host)
    del missing["layers/up"]
    with pytest.raises(ValueError, match="'layers/up'"):
        sharding.place_host_arrays(abstract, missing, meshes.train, "train")
    wrong = dict(host, **{"layers/down": host["layers/down"][:, :64]})
    with pytest.raises(ValueError, match="'layers/down'.*\\(2, 64, 64\\)"):
        sharding.place_host_arrays(abstract, wrong, meshes.train, "train")


def test_axis_without_rule_names_param(meshes):
    _, abstract = _abstract()
    rules = {k: v for k, v in sharding.TRAIN_RULES.items() if k != "mlp"}
    with pytest.raises(ValueError, match="layers/(down|gate|up).*'mlp'"):
        sharding.state_shardings(abstract, meshes.train, rules)


def test_non_divisible_dim_names_param(meshes):
    _, abstract = _abstract(config.tiny(num_heads=3, num_kv_heads=3, head_dim=16))
    instance = mesh_lib.instance_meshes(meshes.generate)[0]
    with pytest.raises(ValueError, match="layers/\\w+: dimension (heads|kv_heads)=3 .*'tp'"):
        sharding.state_shardings(abstract, instance, "generate")


def test_activations_are_constrained_only_inside_their_context(meshes):
    x = jnp.zeros((4, 8, 64), jnp.float32)
    assert sharding.constrain(x, sharding.ACTIVATION) is x  # no context: generation, eager

    def pinned(gather):
        @jax.jit
        def f(x):
            with sharding.activation_sharding(meshes.train, "train"):
                axes = sharding.GATHERED if gather else sharding.ACTIVATION
                return sharding.constrain(x * 2, axes)

        return f

    # rows over fsdp; the sequence over tp (sequence parallel) or whole (gathered)
    assert pinned(False)(x).sharding.spec == P("fsdp", "tp")
    assert pinned(True)(x).sharding.spec == P("fsdp")
    with pytest.raises(ValueError, match="activation: dimension activation_length=9 .*'tp'"):
        pinned(False)(jnp.zeros((4, 9, 64)))


def test_a_sequence_parallel_forward_equals_the_unsharded_one(meshes):
    cfg = config.tiny(tie_embeddings=False, qkv_bias=True, sequence_parallel=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 8)), jnp.int32)
    plain = config.tiny(tie_embeddings=False, qkv_bias=True)
    graphdef, state = nnx.split(llama.create(plain, seed=3))
    expected = np.asarray(_logits(graphdef, state, tokens))
    g, sharded = sharding.init_sharded(lambda: llama.create(cfg, seed=3), meshes.train, "train")

    @jax.jit
    def logits(params, tokens_BxT):  # the context opened inside the outermost jit
        with sharding.activation_sharding(meshes.train, "train"):
            model = nnx.merge(g, params)
            return model.logits(model.hidden_states(tokens_BxT, jnp.ones_like(tokens_BxT)))

    # Pinned: the stream entering and leaving the blocks, and in the (scanned) block its
    # two normalised inputs (gathered), two projection outputs (the MLP's gathered first)
    # and its output (sharded).
    assert logits.lower(sharded, tokens).as_text().count("sharding_constraint") == 8
    np.testing.assert_allclose(np.asarray(logits(sharded, tokens)), expected, atol=1e-5)
