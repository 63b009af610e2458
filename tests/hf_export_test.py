"""`model.hf_export`: a LoRA-adapted model written as an HF safetensors directory, the
adapters merged, reads back through this package's loader and through transformers with
the adapted model's logits (a Llama config written from the ModelConfig; a Qwen3-MoE
checkpoint's own config copied)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import hf_run_dir, random_adapters

from streamrl_jax.model import config as model_config
from streamrl_jax.model import hf_export, llama
from streamrl_jax.model.loader import load_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 12)).astype(np.int32)


def _logits(model) -> np.ndarray:
    t = jnp.asarray(TOKENS)
    return np.asarray(model.logits(model.hidden_states(t, jnp.ones_like(t))))


def _hf_logits(directory: str) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def test_a_merged_lora_export_reads_back_with_the_adapted_logits(tmp_path):
    cfg = model_config.tiny(vocab_size=128, lora_rank=4, lora_alpha=8.0)
    model = random_adapters(llama.create(cfg, seed=1), seed=2)
    want = _logits(model)
    assert np.abs(want - _logits(llama.create(cfg, seed=1))).max() > 1e-3  # adapters matter
    out = hf_export.export(model, cfg, str(tmp_path / "export"))
    back = load_pretrained(out)
    assert back.cfg.lora_rank == 0 and back.cfg.num_layers == cfg.num_layers
    np.testing.assert_allclose(_logits(back.model()), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_hf_logits(out), want, atol=1e-4, rtol=1e-4)


def test_a_model_with_qkv_biases_exports_as_qwen2(tmp_path):
    # not as a Llama `attention_bias`, whose output projection bias is not in the weights
    cfg = model_config.tiny(vocab_size=128, qkv_bias=True)
    model = llama.create(cfg, seed=1)
    biased = jax.tree.map(lambda x: x + 0.05, nnx.state(model, nnx.Param))
    nnx.update(model, biased)  # non-zero biases, so that they matter
    want = _logits(model)
    out = hf_export.export(model, cfg, str(tmp_path / "export"))
    assert load_pretrained(out).cfg.qkv_bias
    np.testing.assert_allclose(_logits(load_pretrained(out).model()), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_hf_logits(out), want, atol=1e-4, rtol=1e-4)


@pytest.mark.extended  # the suite's budget: the dense export covers the writer
def test_a_moe_checkpoint_exports_under_its_own_config(tmp_path):
    extra = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True)  # fmt: skip
    source = hf_run_dir(tmp_path / "src", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", extra)
    pre = load_pretrained(source)
    cfg = pre.cfg.replace(lora_rank=2, lora_alpha=4.0)
    model = llama.create(cfg, seed=3)
    nnx.update(model, pre.params)  # the checkpoint's base under new adapters
    model = random_adapters(model, seed=4)
    want = _logits(model)
    out = hf_export.export(model, cfg, str(tmp_path / "export"), source=source)
    np.testing.assert_allclose(_logits(load_pretrained(out).model()), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_hf_logits(out), want, atol=1e-4, rtol=1e-4)


def test_a_family_without_a_source_config_is_named():
    cfg = model_config.tiny(vocab_size=128, qk_norm=True)
    with pytest.raises(ValueError, match="needs its source's config.json"):
        hf_export.llama_config(cfg, "float32")
