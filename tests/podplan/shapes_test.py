"""A user's own model planned from its `config.json` (`streamrl_podplan.shapes`): the shape
the planner compiles holds exactly the parameters of the model `transformers` builds
from the same file, and a path that is no model is refused by name."""

import jax
import numpy as np
import pytest

from streamrl_jax.errors import UserError
from streamrl_podplan import programs, search, shapes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip

# (config class, its model class, extra fields, whether the simulator's dense count is
# exact: it leaves the q/k norms out, 2 x head_dim a layer)
ARCHITECTURES = {
    "qwen2_untied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}, True),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, True),
    "qwen3_qk_norms": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}, False),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_config_json_plans_the_models_own_parameters(tmp_path, arch):
    cfg_cls, model_cls, extra, sim_exact = ARCHITECTURES[arch]
    hf_cfg = getattr(transformers, cfg_cls)(**SMALL, **extra)
    hf_cfg.architectures = [model_cls]
    hf_cfg.to_json_file(str(tmp_path / "config.json"))
    want = getattr(transformers, model_cls)(hf_cfg).num_parameters()

    # The directory and its config.json name the same model.
    cfg = shapes.model_config(str(tmp_path))
    assert shapes.model_config(str(tmp_path / "config.json")) == cfg
    assert cfg.num_params() == want
    # What the plan compiles: the trainer's state, as `Trainer.programs` places it.
    k = programs.Knobs(model=str(tmp_path), rows=2, seq=16, max_len=64, dtype="float32")
    accumulate = programs.training_programs(k, np.array(jax.devices()[:2]), apply=False)[0]
    params = accumulate.args[0].params
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == want
    sim = search.sim_model(cfg, arch).params
    assert want - sim == (0 if sim_exact else 2 * cfg.head_dim * cfg.num_layers)


def test_a_path_that_is_no_model_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"model '.*nowhere'.*Hugging Face model directory"):
        shapes.model_config(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    with pytest.raises(UserError, match=r"config\.json: unknown architecture 'BertModel'"):
        shapes.model_config(str(tmp_path / "config.json"))


def test_the_search_refuses_a_mixture_of_experts_before_compiling():
    # The simulator's cost model is dense: a MoE search would price the wrong FLOPs.
    cfg = shapes.model_config("moe_1b_a400m_shape")
    with pytest.raises(ValueError, match="num_experts=32"):
        search.sim_model(cfg, "moe_1b_a400m_shape")
