"""Tests for simulation/hardware.py: shapes give the published parameter counts."""

import dataclasses

import pytest

from streamrl_podplan.simulation import hardware


@pytest.mark.parametrize(
    "name, billions",
    [
        ("qwen2.5-7b", 7.62),
        ("qwen2.5-32b", 32.76),
        ("qwen2.5-72b", 72.71),
        ("smollm2-135m", 0.1345),
        ("smollm2-360m", 0.3618),
        ("smollm2-1.7b", 1.711),
    ],
)
def test_param_counts_match_model_cards(name, billions):
    assert hardware.get_model(name).params / 1e9 == pytest.approx(billions, rel=0.005)


def test_kv_bytes_per_token_qwen7b():
    # 28 layers x (K, V) x 4 KV heads x 128 dims x 2 bytes.
    assert hardware.get_model("qwen2.5-7b").kv_bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_forward_flops_is_two_per_param_without_context():
    m = hardware.get_model("qwen2.5-7b")
    assert m.forward_flops(10, 0) == 20 * m.matmul_params


def test_presets_and_unknown_names():
    assert hardware.get_hardware("h800").peak_flops == 989.5e12
    assert hardware.get_hardware("h20").hbm_bw == 4.0e12
    with pytest.raises(ValueError, match="hardware must be one of"):
        hardware.get_hardware("a100")
    with pytest.raises(ValueError, match="model must be one of"):
        hardware.get_model("gpt-5")


def test_invalid_descriptions_name_the_field():
    h800 = hardware.get_hardware("h800")
    with pytest.raises(ValueError, match="Hardware.hbm_bw"):
        dataclasses.replace(h800, hbm_bw=0.0)
    with pytest.raises(ValueError, match="Model.n_kv_heads"):
        dataclasses.replace(hardware.get_model("qwen2.5-7b"), n_kv_heads=5)
    with pytest.raises(ValueError, match="Model.layers"):
        dataclasses.replace(hardware.get_model("qwen2.5-7b"), layers=0)
