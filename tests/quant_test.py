"""int8 rollout weights (`generation/quant.py`, `generation.weight_dtype="int8"`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from support import CFG, ENGINE, requests

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.generation import decoder, quant
from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import SamplingParams

SAMPLED = SamplingParams(temperature=1.0)
# One decode shape (every slot, the whole cache): the compacted shapes gather and scatter
# cache rows whatever the weights are (compact_test's).
INT8 = dataclasses.replace(ENGINE, weight_dtype="int8", decode_buckets=False)


def _one_device():
    return Mesh(np.array(jax.devices()[:1]), ("tp",))


@pytest.mark.parametrize("name", sorted(quant.CONTRACTED))
def test_round_trip_within_half_a_step_per_channel(name):
    """|w - q * scale| <= scale / 2 element-wise (rounding), i.e. <= max|w| / 254 over
    the channel; int8 values in [-127, 127]; a zero channel stays zero."""
    shape = {"qkv": (16, 2, 4, 8), "o": (2, 3, 8, 16), "embed": (32, 16)}.get(name, (16, 24))
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w *= np.exp(np.random.default_rng(1).normal(size=shape[-1]))  # channels of varied size
    w[(0,) * (w.ndim - 1)] = 0.0  # part of a channel zero
    contracted = quant.CONTRACTED[name]
    qa = jax.jit(quant.quantize, static_argnums=1)(jnp.asarray(w), contracted)
    assert qa.q.dtype == jnp.int8 and int(jnp.max(jnp.abs(qa.q))) <= 127
    kept = tuple(d for i, d in enumerate(shape) if i not in contracted)
    assert qa.scale.shape == kept and qa.scale.dtype == jnp.float32
    dequantize = jax.jit(quant.dequantize, static_argnums=1)  # one program, not eager ops
    back = np.asarray(dequantize(qa, contracted))
    step = np.expand_dims(np.asarray(qa.scale), contracted)
    assert np.all(np.abs(w - back) <= step / 2 * (1 + 1e-6))
    amax = np.max(np.abs(w), axis=contracted, keepdims=True)
    np.testing.assert_allclose(step, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    zero = np.zeros_like(w)
    quantize = jax.jit(quant.quantize, static_argnums=1)
    np.testing.assert_array_equal(dequantize(quantize(zero, contracted), contracted), 0)


def test_int8_einsum_is_the_w8a8_product_and_one_row_equals_its_batch_row():
    """The W8A8 einsum equals (round(x / sx) * sx) @ (q * sw) in f32 (int32 accumulation
    is exact), within 1e-6 relative; a one-row call (padded to two inside) gives the
    row's result in a larger batch exactly."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 2, 4, 8)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 1, 16)), jnp.float32)
    qa = quant.quantize(w, (0,))
    got = jax.jit(lambda x, w: quant.einsum("nte,ekpd->ntkpd", x, w))(x, qa)
    sx = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    xq = jnp.round(x / sx) * sx
    want = jnp.einsum("nte,ekpd->ntkpd", xq, quant.dequantize(qa, (0,)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    one = jax.jit(lambda x, w: quant.einsum("nte,ekpd->ntkpd", x, w))(x[1:2], qa)
    np.testing.assert_array_equal(one, got[1:2])
    with pytest.raises(ValueError, match="trailing-axes"):
        quant.einsum("en,ekpd->nkpd", x[:, 0].T, qa)


def test_int8_engine_records_the_int8_models_logprobs_not_the_f32_models(model):
    """Sampled tokens of the int8 engine: their recorded behaviour log-probs equal
    log_softmax of the int8 generation model's logits (a prefill of prompt + the
    response so far, atol 1e-4), and differ from the f32 model's by far more.

    The activation is quantised per token by rounding to the nearest int8 step, so a
    float-level difference between the decode step and the prefill (their reductions
    run in another order) can move one value across a rounding boundary and that
    token's log-prob by ~0.04: at most one token of a sample may do so (seen on a
    2-core AVX-512 machine: 1 of 36 tokens, 0.040)."""
    graphdef, params, _ = model
    engine = Engine(graphdef, params, CFG, INT8, _one_device())
    samples = engine.run(requests(3, sampling=SAMPLED, max_new_tokens=12))
    weights = jax.jit(lambda p: decoder.from_training_layout(graphdef, p, CFG, "int8"))(params)
    f32 = jax.jit(lambda p: decoder.from_training_layout(graphdef, p, CFG))(params)
    assert isinstance(weights["layers"][0]["qkv"], quant.QArray)

    @jax.jit
    def last_logp(w, tokens, lengths):
        cache = decoder.init_cache(CFG, tokens.shape[0], ENGINE.max_total_length)
        slots = jnp.arange(tokens.shape[0])
        logits, _, _ = decoder.GenModel(w, CFG).prefill(tokens, lengths, cache, slots)
        return jax.nn.log_softmax(logits, axis=-1)

    gap = 0.0
    for s in samples:
        seq = np.concatenate([s.prompt, s.response])
        r, p = len(s.response), len(s.prompt)
        # one row per response token, padded to 12 rows (one shape: one compilation)
        tokens = np.zeros((12, 32), np.int32)
        for t in range(r):
            tokens[t, : p + t] = seq[: p + t]
        lengths = jnp.asarray(p + np.minimum(np.arange(12), r - 1), jnp.int32)
        rows = np.arange(r)
        want = np.asarray(last_logp(weights, jnp.asarray(tokens), lengths))[rows, s.response]
        off = np.abs(s.logprobs - want) > 1e-4
        assert off.sum() <= 1, (s.logprobs, want)
        full = np.asarray(last_logp(f32, jnp.asarray(tokens), lengths))[rows, s.response]
        gap = max(gap, float(np.max(np.abs(full - s.logprobs))))
    assert gap > 1e-2, f"int8 and f32 log-probs differ by only {gap}"


def test_int8_engine_compiles_once_per_shape_and_updates_without_recompiling(model):
    graphdef, params, params2 = model
    engine = Engine(graphdef, params, CFG, INT8, _one_device())
    # Engines of equal statics share their jit objects (generation/executables.py): count new ones.
    start = engine.compile_count()
    before = engine.run(requests(5, sampling=SAMPLED))
    compiled = engine.compile_count()
    # a prefill per bucket (with share_prefill the logits-keeping one), the fork, the chunk
    assert compiled - start <= len(INT8.buckets()) + 2
    engine.update_weights(params2, version=1)
    after = engine.run(requests(5, sampling=SAMPLED))
    assert engine.compile_count() == compiled
    assert all(s.policy_version == 1 for s in after)
    assert any(
        not np.array_equal(a.response, b.response)
        for a, b in zip(
            sorted(before, key=lambda s: s.request_id),
            sorted(after, key=lambda s: s.request_id),
            strict=True,
        )
    )


def test_int8_tensor_parallel_instance_matches_single_device(model):
    """The quantised layout shards (scales over the kv-head axis with their matrix)."""
    if jax.device_count() < 3:
        pytest.skip("needs 3 devices (2 generation, 1 training)")
    graphdef, params, _ = model
    meshes = mesh_lib.make_meshes(
        mesh_lib.MeshConfig(generate_devices=2, train_devices=1, instance_tp=2)
    )
    (tp2,) = mesh_lib.instance_meshes(meshes.generate)
    reqs = requests(3, sampling=SamplingParams.greedy())
    got = {s.request_id: s for s in Engine(graphdef, params, CFG, INT8, tp2).run(reqs)}
    want = Engine(graphdef, params, CFG, INT8, _one_device()).run(reqs)
    for s in want:
        np.testing.assert_array_equal(got[s.request_id].response, s.response)
        np.testing.assert_allclose(got[s.request_id].logprobs, s.logprobs, atol=1e-4)


def test_bad_weight_dtype_is_named():
    with pytest.raises(ValueError, match="EngineConfig.weight_dtype must be one of"):
        EngineConfig(weight_dtype="int4")
    with pytest.raises(ValueError, match="weight_dtype='fp8'"):
        decoder.from_training_layout(None, None, CFG, "fp8")


@pytest.mark.extended  # two pipeline runs (~1.5 min on the loaded 2-core machine)
def test_int8_rollout_trains_with_tis_against_recomputed_pi_old(tmp_path):
    """quickstart:tiny, stream_sync, TIS with a cap just above 1: pi_old is recomputed
    by the trainer, so with the f32 sampler (engine log-probs = the trainer's within
    float rounding) no token's weight pi_old / mu passes 1.001, while with the int8
    sampler, whose recorded log-probs are the int8 model's, many do. (Before pi_old
    was recomputed it was the recorded log-prob itself and every weight was 1.)"""
    from support import tiny_config

    from streamrl_jax import pipeline
    from streamrl_jax.rewards.vowels import vowel_reward

    def capped(weight_dtype):
        cfg = tiny_config(
            generation__weight_dtype=weight_dtype, algorithm__tis_cap=1.001, pipeline__steps=1
        )
        result = pipeline.run(cfg, str(tmp_path / weight_dtype), reward_fn=vowel_reward)
        return np.array([row["tis_capped_frac"] for row in result.steps])

    f32, int8 = capped("auto"), capped("int8")
    np.testing.assert_array_equal(f32, 0.0)
    assert np.all(int8 > 0.05), int8
