"""Unmerged LoRA adapter slots in the engine (`generation/adapters.py`): rows of different
adapters in one decode batch draw what each adapter draws alone, an unmerged adapter what
the merged one draws, slot -1 what the base model draws; each slot keeps its own version."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from support import CFG, ENGINE, SAMPLED, by_id, random_adapters, requests

from streamrl_jax.generation.engine import Engine
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama

LORA = CFG.replace(lora_rank=4, lora_alpha=8.0)
# Every slot decodes over the whole cache (one decode shape a program set: the compacted
# decode's buckets are engine_test.py's and compact_test.py's); the adapter slots' rows
# mix in that one batch.
FULL = dataclasses.replace(ENGINE, decode_buckets=False)
SLOTS = dataclasses.replace(FULL, adapters=3)


def _mesh(n: int = 1) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


@pytest.fixture(scope="module")
def adapted():
    """(graphdef, three LoRA states of one base with different adapters), built by one
    jitted program (eagerly, every initialiser's op would compile on its own)."""

    @jax.jit
    def init(seed):
        return nnx.state(random_adapters(llama.create(LORA, seed=8), seed=seed))

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(LORA)))
    return graphdef, [init(s) for s in (9, 10, 11)]


def _requests():
    """Eight requests, the first four's prompts repeated by the last four (a shared
    prompt under two adapters must not share its prefill)."""
    reqs = requests(4, sampling=SAMPLED)
    again = [dataclasses.replace(r, request_id=4 + i, seed=200 + i) for i, r in enumerate(reqs)]
    return reqs + again


def _slot_engine(graphdef, states, mesh=None) -> Engine:
    engine = Engine(graphdef, states[0], LORA, SLOTS, mesh or _mesh(), version=3)
    engine.update_adapter(1, states[1].filter(nnx.LoRAParam), version=5)  # adapters alone
    engine.update_adapter(2, states[2], version=7)  # or a whole state
    return engine


def test_a_mixed_adapter_batch_draws_what_each_adapter_draws_alone(adapted):
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states)
    reqs = _requests()
    alone = [by_id(engine.run([dataclasses.replace(r, adapter=k) for r in reqs])) for k in range(3)]
    mixed = [
        dataclasses.replace(r, adapter=i % 3, request_id=(r.request_id, i % 3))
        for i, r in enumerate(reqs)
    ]
    got = by_id(engine.run(mixed))
    assert engine.metrics()["forked"] > 0  # shared prompts did fork, within an adapter
    for (rid, k), s in got.items():
        want = alone[k][rid]
        np.testing.assert_array_equal(s.response, want.response, err_msg=f"{rid}, adapter {k}")
        np.testing.assert_array_equal(s.logprobs, want.logprobs, err_msg=f"{rid}, adapter {k}")
        assert s.policy_version == s.last_policy_version == (3, 5, 7)[k]
        assert set(s.token_versions.tolist()) == {(3, 5, 7)[k]}
    # The adapters differ: some request draws differently under another adapter.
    assert any(
        not np.array_equal(alone[0][r].response, alone[k][r].response)
        for r in range(8)
        for k in (1, 2)
    )


def test_an_unmerged_adapter_draws_what_the_merged_one_draws(adapted):
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states)
    reqs = _requests()
    for k, state in enumerate(states):
        merged = by_id(Engine(graphdef, state, LORA, FULL, _mesh()).run(reqs))
        slot = by_id(engine.run([dataclasses.replace(r, adapter=k) for r in reqs]))
        for rid, s in merged.items():
            np.testing.assert_array_equal(slot[rid].response, s.response, err_msg=f"{rid}")
            np.testing.assert_allclose(slot[rid].logprobs, s.logprobs, atol=1e-5)


def test_a_slot_with_its_own_alpha_draws_what_the_model_with_that_alpha_draws(adapted):
    # Several learners may differ in alpha: each slot folds its own scale into its B.
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states)
    engine.update_adapter(1, states[1], version=6, alpha=2.0)  # 0.5 against LORA's 2.0
    reqs = _requests()
    mine = LORA.replace(lora_alpha=2.0)
    want = by_id(Engine(graphdef, states[1], mine, FULL, _mesh()).run(reqs))
    got = by_id(engine.run([dataclasses.replace(r, adapter=1) for r in reqs]))
    default = by_id(Engine(graphdef, states[1], LORA, FULL, _mesh()).run(reqs))
    for rid, s in want.items():
        np.testing.assert_array_equal(got[rid].response, s.response, err_msg=f"{rid}")
        np.testing.assert_allclose(got[rid].logprobs, s.logprobs, atol=1e-5)
    assert any(  # the scale mattered: the model's own alpha draws otherwise
        not np.allclose(default[r].logprobs[:4], want[r].logprobs[:4], atol=1e-3) for r in want
    )
    other = by_id(engine.run([dataclasses.replace(r, adapter=2) for r in reqs]))  # untouched
    on_two = [dataclasses.replace(r, adapter=2) for r in reqs]
    again = by_id(_slot_engine(graphdef, states).run(on_two))
    for rid, s in again.items():
        np.testing.assert_array_equal(other[rid].response, s.response)
    for bad in (0.0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="alpha .* must be a finite number > 0"):
            engine.update_adapter(1, states[1], version=8, alpha=bad)


def test_slot_minus_one_is_the_base_model_and_update_weights_resets_the_slots(adapted):
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states)
    plain_cfg = CFG.replace(lora_rank=0)
    p_def, plain = nnx.split(nnx.eval_shape(lambda: llama.create(plain_cfg)))
    base = states[0].filter(nnx.Not(nnx.LoRAParam))
    nnx.replace_by_pure_dict(plain, nnx.to_pure_dict(base))  # the same base, no adapter
    reqs = requests(4, sampling=SAMPLED)
    want = by_id(Engine(p_def, plain, plain_cfg, FULL, _mesh()).run(reqs))
    got = by_id(engine.run([dataclasses.replace(r, adapter=-1) for r in reqs]))
    for rid, s in want.items():
        np.testing.assert_array_equal(got[rid].response, s.response)
        np.testing.assert_allclose(got[rid].logprobs, s.logprobs, atol=1e-5)
        assert got[rid].policy_version == 3  # the base's version
    # A whole-weights update: slot 0 takes the new adapter, the others the base alone.
    engine.update_weights(states[1], version=9)
    after = by_id(engine.run([dataclasses.replace(r, adapter=2) for r in reqs]))
    assert engine.adapter_versions == [9, 9, 9]
    for rid, s in want.items():
        np.testing.assert_array_equal(after[rid].response, s.response)


def test_adapter_slots_on_a_tensor_parallel_instance(adapted):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states, _mesh(2))  # one instance, TP 2
    table = engine.weights["layers"][0]["qkv_lora_b"]
    assert table.sharding.spec[2] == "tp"  # B shards as its matrix's output (kv heads)
    mixed = [dataclasses.replace(r, adapter=i % 3) for i, r in enumerate(_requests())]
    got = by_id(engine.run(mixed))
    want = by_id(_slot_engine(graphdef, states).run(mixed))
    for rid, s in want.items():
        np.testing.assert_array_equal(got[rid].response, s.response)
        np.testing.assert_allclose(got[rid].logprobs, s.logprobs, atol=1e-4)


def test_bad_adapter_settings_and_requests_are_named(adapted):
    graphdef, states = adapted
    engine = _slot_engine(graphdef, states)
    (req,) = requests(1)
    with pytest.raises(ValueError, match=r"adapter 3; expected \[-1, 3\)"):
        engine.submit([dataclasses.replace(req, adapter=3)])
    with pytest.raises(ValueError, match=r"adapter slot 3 outside \[0, 3\)"):
        engine.update_adapter(3, states[1], version=1)
    merged = Engine(graphdef, states[0], LORA, FULL, _mesh())
    with pytest.raises(ValueError, match="adapter 1; expected 0 .the engine has no adapter"):
        merged.submit([dataclasses.replace(req, adapter=1)])
    with pytest.raises(ValueError, match="update_adapter needs adapter slots"):
        merged.update_adapter(0, states[1], version=1)
    plain_cfg = CFG.replace(lora_rank=0)
    # (the refusals come before the weights are read: abstract models, nothing to compile)
    plain = nnx.split(nnx.eval_shape(lambda: llama.create(plain_cfg)))
    with pytest.raises(ValueError, match="the model has no LoRA adapters"):
        Engine(*plain, plain_cfg, SLOTS, _mesh())
    moe = model_config.tiny(
        num_experts=4, experts_per_token=2, moe_intermediate_size=32, lora_rank=2
    )
    with pytest.raises(ValueError, match=r"targets \['down', 'gate', 'up'\] adapt a mixture"):
        Engine(*nnx.split(nnx.eval_shape(lambda: llama.create(moe))), moe, SLOTS, _mesh())
    with pytest.raises(ValueError, match="EngineConfig.adapters must be an int >= 0"):
        dataclasses.replace(ENGINE, adapters=-1)
