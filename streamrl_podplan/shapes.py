"""The models a plan is made for, as shapes with no weights: real models' published shapes
(`SHAPES`, also the benchmarks' `--models=<name>_shape`), "tiny", or the user's own model
from its Hugging Face `config.json`.

No checkpoint of the presets is offline here; a plan or a benchmark of speed or memory
needs only the shapes: the widths, depths, heads, vocabulary and the architecture's
structure (q/k norms, Gemma 3's window pattern, the experts). Each preset is a
`ModelConfig` built from the published `config.json` of the model named; RoPE scaling and
other numerics that move no cost are left out. A user's `config.json` is read whole, by
the package's own loader (`streamrl_jax.model.hf_loader.read_hf_config`: the config a
checkpoint of that directory would load with).

    from streamrl_podplan.shapes import SHAPES, model_config
"""

from __future__ import annotations

import os
from typing import Any

from streamrl_jax.model import config as config_lib
from streamrl_jax.model.hf_loader import read_hf_config

# "tiny": the tests' two-layer model at TPU tile sizes (every dimension a multiple of 128,
# so that tile padding does not blur a hand count of its bytes).
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=2,
            num_kv_heads=1, head_dim=128)  # fmt: skip

_GEMMA3_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))  # 5 local : 1 global

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M / 1.7B (Llama architecture, vocabulary 49,152, tied)
    "smollm2_shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64),
    "smollm2_1.7b_shape": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                               num_layers=24, num_heads=32, num_kv_heads=32, head_dim=64),
    # Qwen3-0.6B: q/k norms, head_dim 128 apart from E / H, tied
    "qwen3_0.6b_shape": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                             num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                             qk_norm=True, rope_theta=1e6),
    # Llama 3.2 1B: tied, GQA 32:8
    "llama3.2_1b_shape": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                              num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                              rope_theta=5e5),
    # Gemma 3 1B (text): 5 sliding-window (512) layers to 1 global, one kv head of 256,
    # sandwich norms, GeGLU, scaled embeddings, a 262k vocabulary
    "gemma3_1b_shape": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                            num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                            qk_norm=True, embed_scale=True, mlp_act="gelu_tanh",
                            sandwich_norms=True, attn_scale=256**-0.5,
                            layer_windows=_GEMMA3_WINDOWS, rope_theta=1e6,
                            rope_local_theta=1e4),
    # Granite-3.0-1B-A400M's widths in Qwen3-MoE's layout: 32 experts of width 512, 8 a
    # token (1.3B parameters, 0.4B active), tied
    "moe_1b_a400m_shape": dict(vocab_size=49155, hidden_size=1024, intermediate_size=512,
                               num_layers=24, num_heads=16, num_kv_heads=8, head_dim=64,
                               num_experts=32, experts_per_token=8,
                               moe_intermediate_size=512, norm_topk_prob=True),
    # PAPER.md's policies: Qwen2.5-7B / 32B / 72B (q/k/v biases, untied, GQA)
    "qwen2.5_7b_shape": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                             num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                             qkv_bias=True, tie_embeddings=False, rope_theta=1e6),
    "qwen2.5_32b_shape": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                              num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128,
                              qkv_bias=True, tie_embeddings=False, rope_theta=1e6),
    "qwen2.5_72b_shape": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              qkv_bias=True, tie_embeddings=False, rope_theta=1e6),
}  # fmt: skip


def model_config(model: str, **overrides: Any) -> config_lib.ModelConfig:
    """The `ModelConfig` of `model`, with `overrides`.

    Args:
      model: a shape of `SHAPES` (tied embeddings), "tiny", or a Hugging Face model
        directory or its `config.json` (no weight is read).
      **overrides: `ModelConfig` fields to replace (dtypes, remat, context length).

    Raises:
      ValueError: `model` is none of these.
      UserError: a `config.json` the loader refuses (named with its path).
    """
    if model == "tiny":
        return config_lib.tiny(**{**TINY, **overrides})
    if model in SHAPES:
        return config_lib.tiny(**{**SHAPES[model], **overrides})
    directory = model
    if os.path.isfile(model) and os.path.basename(model) == "config.json":
        directory = os.path.dirname(model)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(
            f"model {model!r}: not a shape ({', '.join(SHAPES)}), tiny, nor a Hugging Face "
            "model directory or its config.json"
        )
    return read_hf_config(directory, **overrides)[0]
