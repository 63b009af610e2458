"""Every `config.json` field of the supported families is honoured, refused by name, or
ignored as not part of the model's function (`model/hf_fields.py`, docs/model.md
"config.json fields"); the sliding windows read from a config are the ones transformers
applies."""

import logging

import pytest

from streamrl_jax.model.config import from_hf_config
from streamrl_jax.model.hf_fields import FAMILIES

# What each family needs beyond the shapes to load at all.
_NEEDS = {
    "gemma3_text": dict(sliding_window=4),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def _hf(family: str, **fields) -> dict:
    """A minimal `config.json` of `family` with `fields` set."""
    base = dict(architectures=[FAMILIES[family].architecture], model_type=family, vocab_size=128,
                hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return base | _NEEDS.get(family, {}) | fields


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_transformers_writes_is_honoured_refused_or_ignored(family):
    # A field a new transformers version adds to one of these classes fails here until
    # it is classified (and built, or refused by name).
    transformers = pytest.importorskip("transformers")
    fields = FAMILIES[family]
    sets = {"honoured": fields.honoured, "refused": set(fields.refused), "ignored": fields.ignored}
    for a in sets:
        for b in sets:
            assert a == b or not sets[a] & sets[b], f"{family}: {sets[a] & sets[b]} in {a} and {b}"
    written = set(getattr(transformers, fields.config_class)().to_dict())
    unclassified = written - fields.honoured - set(fields.refused) - fields.ignored
    assert not unclassified, f"{family}: config.json fields not classified: {unclassified}"


# Each refused field with a value the decoder does not build.
REFUSED = [
    ("llama", "attention_bias", True),  # the output projection's bias too
    ("llama", "mlp_bias", True),
    ("qwen3", "attention_bias", True),
    ("gemma3_text", "attention_bias", True),
    ("gemma3_text", "final_logit_softcapping", 30.0),
    ("gemma3_text", "attn_logit_softcapping", 50.0),
    ("gemma3_text", "use_bidirectional_attention", True),
    ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "mlp_only_layers", [0]),
    ("qwen3_moe", "shared_expert_intermediate_size", 64),
    *((f, "quantization_config", {"quant_method": "fp8"}) for f in sorted(FAMILIES)),
    *((f, "partial_rotary_factor", 0.5) for f in sorted(FAMILIES)),
]


def test_every_refused_field_has_a_case():
    cases = {(family, name) for family, name, _ in REFUSED}
    assert cases == {(f, name) for f, fields in FAMILIES.items() for name in fields.refused}


@pytest.mark.parametrize("family,name,value", REFUSED)
def test_a_refused_field_is_named_with_its_value_and_architecture(family, name, value):
    neutral = FAMILIES[family].refused[name][0]
    from_hf_config(_hf(family, **{name: neutral}))  # the neutral value loads
    with pytest.raises(ValueError) as e:
        from_hf_config(_hf(family, **{name: value}))
    message = str(e.value)
    assert f"{name}={value!r}" in message and FAMILIES[family].architecture in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "family,fields,named",
    [
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("mistral", dict(hidden_act="relu"), "hidden_act='relu'"),
        ("gemma3_text", dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
        ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "type 'yarn'"),
        ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                        "partial_rotary_factor": 0.5}),
         "rope_parameters.partial_rotary_factor=0.5"),
        ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                        "mrope_section": [8, 8]}),
         "rope_parameters.mrope_section"),
        ("gemma3_text", dict(rope_parameters={
            "sliding_attention": {"rope_type": "linear", "factor": 2.0},
            "full_attention": {"rope_type": "default"}}),
         "rope_parameters.sliding_attention RoPE scaling 'linear'"),
        ("qwen2", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),
         "layer_types names sliding_attention layers, but there is no window"),
        ("qwen3", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
        ("mistral", dict(sliding_window=0), "sliding_window=0"),
    ],
)  # fmt: skip
def test_an_honoured_field_with_a_value_not_built_is_named(family, fields, named):
    with pytest.raises(ValueError) as e:
        from_hf_config(_hf(family, **fields))
    assert named in str(e.value)


def test_a_field_no_family_knows_is_logged_by_name(caplog):
    with caplog.at_level(logging.WARNING):
        from_hf_config(_hf("mistral", layer_types=["sliding_attention"] * 2))
    # transformers' Mistral does not read `layer_types` (Ministral does): nor is it read here
    assert "MistralForCausalLM fields this loader does not know" in caplog.text
    assert "layer_types" in caplog.text


# transformers' config -> each layer's window, as its modelling code applies it
# (Qwen2/Qwen3: `sliding_window` on the layers `layer_types` names sliding; the others:
# on every layer).
WINDOW_CASES = [
    ("MistralConfig", dict(sliding_window=3)),
    ("MistralConfig", dict(sliding_window=None)),
    ("MixtralConfig", dict(sliding_window=3, num_local_experts=4)),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=3, max_window_layers=2)),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=3, max_window_layers=0)),
    ("Qwen2Config", dict(use_sliding_window=False, sliding_window=3, max_window_layers=0)),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=3)),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=5, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=3, max_window_layers=2,
                            num_experts=4, num_experts_per_tok=2)),
    ("Qwen3MoeConfig", dict(use_sliding_window=False, sliding_window=3, num_experts=4,
                            num_experts_per_tok=2)),
]  # fmt: skip


@pytest.mark.parametrize("cls,fields", WINDOW_CASES)
@pytest.mark.parametrize("written_by", ["transformers 5", "older (no layer_types)"])
def test_layer_windows_are_transformers_windows(cls, fields, written_by):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, cls)(num_hidden_layers=4, **fields)
    per_layer = hf.layer_types if cls in ("Qwen2Config", "Qwen3Config") else None
    want = tuple(
        (hf.sliding_window or 0) if per_layer is None or per_layer[i] == "sliding_attention" else 0
        for i in range(4)
    )
    written = hf.to_dict()
    if written_by != "transformers 5":
        if "layer_types" in fields:
            pytest.skip("explicit layer_types are transformers 5's")
        written.pop("layer_types", None)
        written["sliding_window"] = fields["sliding_window"]  # transformers 5 nulls it when off
    got = from_hf_config(written).layer_windows or (0,) * 4
    assert got == want
