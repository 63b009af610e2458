"""What the loader does with each `config.json` field of the supported architectures.

Every field that transformers' config class of a supported family writes, and the
older names the hub's checkpoints still carry, is in exactly one of three sets:

* honoured: `config.from_hf_config` reads it into `ModelConfig`;
* refused: the decoder does not build what it describes; any value but the neutral
  ones listed fails at start-up with one line naming the field, its value and the
  architecture (`check`);
* ignored: not part of the model's function: transformers' bookkeeping, output
  switches, token ids, initialisation, and training-time noise or auxiliary losses
  (transformers' eval forward, the one the parity tests match, reads none of them).

A field in none of the sets is logged by `from_hf_config` (`unknown`): transformers
itself ignores what its config class does not declare. `tests/hf_fields_test.py`
fails when transformers' own config classes write a field no set holds (a new field
in a new transformers version); docs/model.md ("config.json fields") is the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Not the model's function, in every family: bookkeeping, outputs, storage dtype (the
# run's `model.param_dtype` decides), initialisation, generation settings that
# transformers < 5 also wrote into config.json, the padding id (transformers' embedding
# only zeroes that row's gradient; padding is masked here) and attention dropout
# (training-time noise: the eval forward does not apply it, and this trainer runs
# without dropout).
_IGNORED = frozenset({
    "_name_or_path", "_attn_implementation_autoset", "transformers_version",
    "transformers.js_config", "dtype", "torch_dtype", "use_cache", "cache_implementation",
    "initializer_range", "pad_token_id", "attention_dropout", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "is_decoder",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params", "sep_token_id",
    "decoder_start_token_id", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})  # fmt: skip
# A MoE's training-side router settings: the load-balancing loss is
# `algorithm.router_aux_coef`; Mixtral's jitter multiplies the router's input by noise
# in training mode only.
_ROUTER_TRAINING = frozenset({"output_router_logits", "router_aux_loss_coef"})

# Read by every family: shapes, norms, RoPE (transformers >= 5's `rope_parameters`, or
# the older `rope_scaling` + `rope_theta`; the RoPE kind and its keys are checked
# where they are read), embeddings, the family, token ids.
_HONOURED = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_scaling", "rope_theta", "bos_token_id", "eos_token_id",
})  # fmt: skip
# Qwen2/Qwen3's windows: `use_sliding_window` turns `sliding_window` on for the layers
# `layer_types` names "sliding_attention" (by default those from `max_window_layers` on).
_QWEN_WINDOWS = frozenset(
    {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
)
# q/k/v *and output* projection biases (Llama, Qwen3, Gemma 3, Qwen3-MoE): the output
# bias is not built. Qwen2's q/k/v biases are not a field: they always exist.
_NO_ATTENTION_BIAS = {"attention_bias": (False, None)}
# Anywhere: quantised weights (GPTQ, AWQ, FP8 ...) and partial rotary embeddings.
_REFUSED = {"quantization_config": (None,), "partial_rotary_factor": (None, 1, 1.0)}


@dataclasses.dataclass(frozen=True)
class Fields:
    """One family's `config.json` fields by what the loader does with them.

    Attributes:
      architecture: its `architectures[0]` in a `config.json`.
      config_class: transformers' config class of the family.
      honoured: read into `ModelConfig`.
      refused: field -> the neutral values accepted; any other value is refused.
      ignored: not part of the model's function.
    """

    architecture: str
    config_class: str
    honoured: frozenset[str]
    refused: Mapping[str, tuple[Any, ...]]
    ignored: frozenset[str]


def _family(
    architecture: str,
    config_class: str,
    honoured: set[str] | frozenset[str] = frozenset(),
    refused: Mapping[str, tuple[Any, ...]] | None = None,
    ignored: set[str] | frozenset[str] = frozenset(),
    not_honoured: frozenset[str] = frozenset(),
) -> Fields:
    return Fields(
        architecture=architecture,
        config_class=config_class,
        honoured=(_HONOURED - not_honoured) | frozenset(honoured),
        refused={**_REFUSED, **(refused or {})},
        ignored=_IGNORED | frozenset(ignored),
    )


# family (its `model_type`) -> its fields
FAMILIES: dict[str, Fields] = {
    # `pretraining_tp`: transformers 5 does not read it (4.x sliced the same matmuls)
    "llama": _family(
        "LlamaForCausalLM",
        "LlamaConfig",
        {"hidden_act"},
        {**_NO_ATTENTION_BIAS, "mlp_bias": (False, None)},
        {"pretraining_tp"},
    ),
    "qwen2": _family("Qwen2ForCausalLM", "Qwen2Config", {"hidden_act"} | _QWEN_WINDOWS),
    "qwen3": _family(
        "Qwen3ForCausalLM", "Qwen3Config", {"hidden_act"} | _QWEN_WINDOWS, _NO_ATTENTION_BIAS
    ),
    # every layer slides when `sliding_window` is set (Mistral 7B v0.1)
    "mistral": _family("MistralForCausalLM", "MistralConfig", {"hidden_act", "sliding_window"}),
    "gemma3_text": _family(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            "hidden_activation",
            "query_pre_attn_scalar",
            "sliding_window",
            "layer_types",
            "sliding_window_pattern",
            "rope_local_base_freq",
        },
        {
            **_NO_ATTENTION_BIAS,
            "final_logit_softcapping": (None,),
            "attn_logit_softcapping": (None,),
            "use_bidirectional_attention": (False, None),
        },
        # written by transformers 5 beside `layer_types`, which is what it reads back
        {"_sliding_window_pattern"},
    ),  # fmt: skip
    # transformers' Qwen3-MoE slides every layer when `use_sliding_window` is on: it does
    # not read `max_window_layers` (which the hub's configs carry); the dense layers'
    # `intermediate_size` only matters with `mlp_only_layers`, which is refused.
    "qwen3_moe": _family(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            "hidden_act",
            "use_sliding_window",
            "sliding_window",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
        },
        {
            **_NO_ATTENTION_BIAS,
            "decoder_sparse_step": (1, None),
            "mlp_only_layers": (None, []),
            "shared_expert_intermediate_size": (None, 0),
        },
        _ROUTER_TRAINING | {"max_window_layers", "intermediate_size"},
        not_honoured=frozenset({"intermediate_size"}),
    ),  # fmt: skip
    "mixtral": _family(
        "MixtralForCausalLM",
        "MixtralConfig",
        {"hidden_act", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"},
        ignored=_ROUTER_TRAINING | {"router_jitter_noise"},
    ),  # fmt: skip
}


def check(hf: Mapping[str, Any], family: str, arch: str) -> list[str]:
    """Refuses a `config.json` field of `family` the decoder does not build.

    Returns:
      the fields of `hf` in none of the family's sets (`from_hf_config` logs them).

    Raises:
      ValueError: a refused field with a value other than its neutral ones, naming the
        field, its value and the architecture.
    """
    fields = FAMILIES[family]
    for name, neutral in fields.refused.items():
        if name in hf and not any(_same(hf[name], n) for n in neutral):
            raise ValueError(
                f"config.json: {name}={hf[name]!r} is not supported for {arch} "
                f"(accepted: {', '.join(repr(n) for n in neutral)}; docs/model.md, "
                '"config.json fields")'
            )
    known = fields.honoured | set(fields.refused) | fields.ignored
    return sorted(set(hf) - known)


def _same(value: Any, neutral: Any) -> bool:
    """`value == neutral` without True == 1 or 0 == False passing for each other."""
    return type(value) is type(neutral) and value == neutral
