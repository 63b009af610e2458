"""LoRA adapters (`model/lora.py`): a new adapter changes nothing, the adapter's gradient is
the full model's pushed through W + s A B, and the generation side's merged weights
compute what the training forward computes (dense and mixture-of-experts)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from support import (
    CFG,
    ENGINE,
    ROOT,
    make_engine,
    policy_samples,
    random_adapters,
    requests,
)

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import OptimizerSection
from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.types import SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama, lora
from streamrl_jax.model.loader import load_pretrained
from streamrl_jax.trainer import TrainerConfig, make_batch, make_policy_trainer

LORA = CFG.replace(lora_rank=4, lora_alpha=8.0)
MOE = model_config.tiny(
    num_experts=4, experts_per_token=2, moe_intermediate_size=32, lora_rank=2, lora_alpha=4.0
)
# The mixture-of-experts cases run with -m extended (the suite's budget): the dense ones
# cover the adapters' maths, the MoE ones their expert axis.
FAMILIES = [
    pytest.param(LORA, id="dense"),
    pytest.param(MOE, id="moe", marks=pytest.mark.extended),
]


def _batch(cfg, seed=0, b=2, t=12):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 3]]))
    return tokens, mask


def _logits(model, tokens, mask):
    return model.logits(model.hidden_states(tokens, mask))


def _base_twin(model: llama.Llama, cfg) -> llama.Llama:
    """A model without adapters whose block weights are `model`'s merged ones."""
    twin = llama.create(dataclasses.replace(cfg, lora_rank=0))
    nnx.update(twin, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    for name, w in model.layers.merged_arrays(cfg.lora_scale).items():
        getattr(twin.layers, name)[...] = w
    return twin


@pytest.mark.parametrize("cfg", FAMILIES)
def test_a_new_adapter_leaves_the_logits_bitwise_unchanged(cfg):
    tokens, mask = _batch(cfg)
    adapted = llama.create(cfg, seed=3)
    plain = llama.create(dataclasses.replace(cfg, lora_rank=0), seed=3)
    assert set(adapted.layers.adapted) == {
        lora.param_name(t, cfg.num_experts) for t in cfg.lora_targets
    }
    nnx.update(plain, nnx.state(adapted, nnx.Not(nnx.LoRAParam)))
    np.testing.assert_array_equal(_logits(adapted, tokens, mask), _logits(plain, tokens, mask))
    # and the adapters are not zero as a whole: A is drawn, only B starts at zero
    a = adapted.layers.adapters()[adapted.layers.adapted[0]][0]
    assert float(jnp.abs(a).max()) > 0


@pytest.mark.parametrize("cfg", FAMILIES)
def test_the_adapter_gradient_is_the_full_gradient_through_the_adapter(cfg):
    # W' = W + s A B: dL/dA = s G B^T and dL/dB = s A^T G, G = dL/dW' of the model whose
    # weights are W' (no adapters). f32 throughout; tolerance 1e-5 relative to G's scale.
    tokens, mask = _batch(cfg, seed=1)
    weights = jax.random.normal(jax.random.key(9), (*tokens.shape, cfg.vocab_size))
    loss = lambda m: jnp.sum(_logits(m, tokens, mask) * weights * mask[..., None])
    model = random_adapters(llama.create(cfg, seed=4), seed=5)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    # Each gradient one jitted program (op by op, each of its primitives compiles alone).
    got = jax.jit(jax.grad(lambda a, r: loss(nnx.merge(graphdef, a, r))))(adapters, rest)
    twin = _base_twin(model, cfg)
    g_def, base = nnx.split(twin)
    full = jax.jit(jax.grad(lambda p: loss(nnx.merge(g_def, p))))(base)
    s = cfg.lora_scale
    for name, (a, b) in model.layers.adapters().items():
        lead = 2 if name.startswith("experts_") else 1
        g = full["layers"][name][...]
        ins, outs, r = a.shape[lead:-1], b.shape[lead + 1 :], a.shape[-1]
        g2 = g.reshape(*g.shape[:lead], int(np.prod(ins)), int(np.prod(outs)))
        a2 = a.reshape(*a.shape[:lead], -1, r)
        b2 = b.reshape(*b.shape[:lead], r, -1)
        want_a = s * g2 @ jnp.swapaxes(b2, -1, -2)
        want_b = s * jnp.swapaxes(a2, -1, -2) @ g2
        got_a = got["layers"][f"{name}_lora_a"][...].reshape(want_a.shape)
        got_b = got["layers"][f"{name}_lora_b"][...].reshape(want_b.shape)
        for got_x, want_x in ((got_a, want_a), (got_b, want_b)):
            scale = float(jnp.abs(want_x).max())
            assert scale > 0, name
            np.testing.assert_allclose(got_x, want_x, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("cfg", FAMILIES)
def test_merged_weights_compute_what_the_adapted_model_computes(cfg):
    tokens, mask = _batch(cfg, seed=2)
    model = random_adapters(llama.create(cfg, seed=6), seed=7)
    adapted = _logits(model, tokens, mask)
    merged = _logits(_base_twin(model, cfg), tokens, mask)
    np.testing.assert_allclose(adapted, merged, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(adapted - _logits(llama.create(cfg, seed=6), tokens, mask)).max()) > 1e-3


def test_the_engine_decodes_the_merged_adapted_model():
    # The generation side merges the adapters when it lays out the weights: the engine
    # of an adapted model draws what the engine of its merged twin draws.
    model = random_adapters(llama.create(LORA, seed=8), seed=9)
    twin = _base_twin(model, LORA)
    g_def, params = nnx.split(model)
    t_def, t_params = nnx.split(twin)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    reqs = requests(4, sampling=SamplingParams.greedy())
    got = {s.request_id: s for s in Engine(g_def, params, LORA, ENGINE, mesh).run(reqs)}
    want = {s.request_id: s for s in make_engine((t_def, t_params, None)).run(reqs)}
    for rid, s in want.items():
        np.testing.assert_array_equal(got[rid].response, s.response)
        np.testing.assert_allclose(got[rid].logprobs, s.logprobs, atol=1e-5)


def test_bad_lora_settings_are_named():
    with pytest.raises(ValueError, match="lora_targets must be a non-empty subset"):
        CFG.replace(lora_rank=4, lora_targets=("q", "qkv"))
    with pytest.raises(ValueError, match="lora_rank must be an int >= 0"):
        CFG.replace(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha must be > 0"):
        CFG.replace(lora_rank=2, lora_alpha=0.0)


def _trainer(cfg, learning_rate: float):
    """A policy trainer of `cfg` on one device: micro-batches of 4 x 32, no clipping."""
    tcfg = TrainerConfig(
        optimizer=OptimizerSection(learning_rate=learning_rate, max_grad_norm=0.0),
        seq_buckets=(32,),
        batch_buckets=(4,),
    )
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    return make_policy_trainer(cfg, tcfg, mesh)


def test_lora_training_differentiates_and_optimizes_the_adapters_alone():
    # The accumulator and AdamW's moments hold the adapters only; after two steps the
    # base weights are bitwise what they were and every adapter B has moved off zero.
    trainer = _trainer(LORA, learning_rate=1e-2)
    state = trainer.init_state(0)
    host = lambda t: jax.tree.map(lambda x: np.array(x, copy=True), t)
    before = host(state.params)
    adapters = before.filter(nnx.LoRAParam)
    n_adapter = sum(x.size for x in jax.tree.leaves(adapters))
    n_all = sum(x.size for x in jax.tree.leaves(before))
    assert 0 < n_adapter < n_all / 10
    acc = trainer.init_accumulator()
    assert jax.tree.structure(acc.grads) == jax.tree.structure(state.params.filter(nnx.LoRAParam))
    moments = [x.size for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(moments) == 2 * n_adapter  # AdamW's mu and nu, of the adapters alone
    batch = trainer.place_batch(
        make_batch(**policy_samples(vocab=CFG.vocab_size), seq_buckets=(32,), batch_buckets=(4,))
    )
    for _ in range(2):
        acc, _ = trainer.accumulate(state, acc, batch, trainer.scalar(1.0))
        state, acc, metrics = trainer.apply(state, acc)
        assert float(metrics["grad_norm"]) > 0
    after = host(state.params)
    base_before = before.filter(nnx.Not(nnx.LoRAParam))
    base_after = after.filter(nnx.Not(nnx.LoRAParam))
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
        np.testing.assert_array_equal(x, y)
    for name in llama.create(LORA).layers.adapted:
        assert np.abs(after["layers"][f"{name}_lora_b"][...]).max() > 0, name


def test_the_main_job_trains_a_lora_adapter_and_resumes_it_exactly(tmp_path):
    # trainer.lora in the run config: the policy trains the adapters alone (the base
    # weights end bitwise as they began); the generation side is sent the adapted
    # weights and decodes the merged model (`test_the_engine_decodes_...` above).
    from support import param_arrays, tiny_config

    from streamrl_jax import checkpoint as ckpt_lib
    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.pipeline import components
    from streamrl_jax.rewards.vowels import vowel_reward

    # The adapters of learners_test.py's first learner (rank 4, the default alpha and
    # targets, deterministic, lr 1e-3): its trainer's programs, compiled once for both.
    cfg = tiny_config(pipeline__steps=2, warmup__steps=0, trainer__lora={"rank": 4},
                      checkpoint__every=1, eval__num_problems=0)  # fmt: skip
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, deterministic=True))
    model_cfg = components.describe_model(cfg).cfg
    assert (model_cfg.lora_rank, model_cfg.lora_alpha) == (4, 16.0)
    # A subset of targets reaches the model's config (the adapters' maths per target: the
    # units above).
    subset = tiny_config(trainer__lora={"rank": 4, "alpha": 8.0, "targets": ("q", "v", "down")})
    subset_cfg = components.describe_model(subset).cfg
    assert (subset_cfg.lora_alpha, subset_cfg.lora_targets) == (8.0, ("q", "v", "down"))
    shapes = nnx.eval_shape(lambda: llama.create(subset_cfg))
    assert set(shapes.layers.adapted) == {"q", "v", "down"}
    result = run_lib.run(cfg, str(tmp_path / "run"), reward_fn=vowel_reward)
    assert len(result.steps) == 2
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in result.steps)
    start = jax.jit(lambda: nnx.state(llama.create(model_cfg, seed=cfg.seed)))()  # as init
    end = jax.device_get(result.state.params)
    base = lambda p: jax.tree.leaves(p.filter(nnx.Not(nnx.LoRAParam)))
    for x, y in zip(base(start), base(end), strict=True):
        np.testing.assert_array_equal(x, y)
    for name in nnx.eval_shape(lambda: llama.create(model_cfg)).layers.adapted:
        assert np.abs(end["layers"][f"{name}_lora_b"][...]).max() > 0, name
    # The checkpoint holds the adapters (and their moments), not the base: a fraction of
    # the model's bytes (the base is the model's source, loaded again on resume).
    step_dir = tmp_path / "run" / "checkpoints" / "2"
    on_disk = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    base_bytes = sum(x.nbytes for x in base(end))
    assert on_disk < base_bytes / 4, (on_disk, base_bytes)
    # Killed after step 1 (its checkpoint 1 alone in a new workdir, as the kill leaves it)
    # and resumed from that checkpoint: bitwise the uninterrupted run.
    src = ckpt_lib.Checkpointer(str(tmp_path / "run" / "checkpoints"))
    os.makedirs(tmp_path / "parts" / "checkpoints")
    os.symlink(src.step_directory(1), tmp_path / "parts" / "checkpoints" / "1")
    src.close()
    resumed = run_lib.run(cfg, str(tmp_path / "parts"), reward_fn=vowel_reward)
    assert resumed.start_batch == 1
    for x, y in zip(param_arrays(result), param_arrays(resumed), strict=True):
        np.testing.assert_array_equal(x, y)
    # tools/export_hf.py: the trained policy, adapters merged, as an HF directory that
    # the loader reads back with the adapted model's logits.
    out = tmp_path / "hf"
    cmd = [sys.executable, "tools/export_hf.py", "--config=configs/quickstart.py:tiny",
           "--config.pipeline.steps=2", "--config.warmup.steps=0",
           "--config.trainer.lora.rank=4",
           f"--checkpoint={tmp_path / 'run' / 'checkpoints'}", f"--out={out}"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    # the trained model from its abstract structure and the end state (no initialisers run)
    trained = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: llama.create(model_cfg))), end)
    tokens, mask = _batch(model_cfg, seed=5)
    back = load_pretrained(str(out), max_position_embeddings=model_cfg.max_position_embeddings)
    np.testing.assert_allclose(
        _logits(back.model(), tokens, mask), _logits(trained, tokens, mask), atol=1e-5
    )
    with pytest.raises(ValueError, match="trainer.lora.targets must be a non-empty subset"):
        tiny_config(trainer__lora={"rank": 4, "targets": ("qkv",)})


def test_an_adapter_only_sync_moves_the_adapters_and_publishes_the_whole_model():
    # The first transfer places every parameter on each destination, which keeps its
    # base; later ones move the adapters alone and publish them with that base: the
    # same arrays a whole transfer would have placed, bitwise.
    from streamrl_jax import sharding
    from streamrl_jax.weight_sync import WeightSync, place_on, tree_bytes

    model = random_adapters(llama.create(LORA, seed=10), seed=11)
    params = nnx.state(model)
    dst = [
        sharding.state_shardings(params, Mesh(np.array([d]), ("tp",)), "generate")
        for d in jax.devices()[1:3]
    ]
    whole = WeightSync(jnp.bfloat16, place_on(dst))
    lean = WeightSync(jnp.bfloat16, place_on(dst), adapters_only=True)
    _, first = lean.transfer(params, 0)
    assert first.bytes == tree_bytes(whole._cast(params))
    later = jax.tree.map(lambda x: x * 1.5, params)  # a later version, every leaf moved
    published, stats = lean.transfer(later, 1)
    adapters = later.filter(nnx.LoRAParam)
    assert stats.bytes == tree_bytes(whole._cast(adapters)) < first.bytes / 10
    want, _ = whole.transfer(jax.tree.map(lambda x: x, params), 0)
    want = [w.params.filter(nnx.Not(nnx.LoRAParam)) for w in want]  # the kept base
    for p, base, d in zip(published, want, jax.devices()[1:3], strict=True):
        assert p.version == 1
        assert jax.tree.structure(p.params) == jax.tree.structure(params)
        got_base = p.params.filter(nnx.Not(nnx.LoRAParam))
        for x, y in zip(jax.tree.leaves(got_base), jax.tree.leaves(base), strict=True):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(
            jax.tree.leaves(p.params.filter(nnx.LoRAParam)),
            jax.tree.leaves(whole._cast(adapters)),
            strict=True,
        ):
            np.testing.assert_array_equal(x, y)
            assert x.devices() == {d}


def test_a_bf16_base_trains_f32_adapters_without_rounding_them_away():
    # model.param_dtype="bfloat16" with LoRA: the frozen base is stored in bf16 (half the
    # memory), the adapters and their AdamW moments stay f32, and a layer merges in f32:
    # an update far below bf16's spacing at the weight still reaches the forward.
    cfg = LORA.replace(param_dtype="bfloat16")
    trainer = _trainer(cfg, learning_rate=1e-3)
    state = trainer.init_state(0)
    base = jax.tree.leaves(state.params.filter(nnx.Not(nnx.LoRAParam)))
    adapters = jax.tree.leaves(state.params.filter(nnx.LoRAParam))
    assert {x.dtype for x in base} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in adapters} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype("float32")}
    batch = trainer.place_batch(
        make_batch(**policy_samples(vocab=CFG.vocab_size), seq_buckets=(32,), batch_buckets=(4,))
    )
    acc, _ = trainer.accumulate(state, trainer.init_accumulator(), batch, trainer.scalar(1.0))
    state, _, metrics = trainer.apply(state, acc)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    w = jnp.full((4, 8), 0.02, jnp.bfloat16)  # bf16's spacing at 0.02 is 1.2e-4
    a, b = jnp.full((4, 2), 1e-3, jnp.float32), jnp.full((2, 8), 1e-3, jnp.float32)
    got = lora.merge_layer({"q": w}, {"q": (a, b)}, 2.0)["q"]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.float32(w[0, 0]) + 2.0 * 2e-6, rtol=1e-7)
