"""load_pretrained: logit parity with transformers (HF safetensors, GGUF), SmolLM2, bad input."""

import functools
import json
import os
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import HF_TINY, randomize_hf

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.generation import complete
from streamrl_jax.model import gguf_loader, hf_loader
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained


def _permute_qk(w_RxC: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (`convert_hf_to_gguf.py`), to write GGUF files as
    its converter does; `gguf_loader.unpermute_qk` is its inverse."""
    rows = w_RxC.shape[0]
    w = w_RxC.reshape(n_head, 2, rows // n_head // 2, *w_RxC.shape[1:])
    return w.swapaxes(1, 2).reshape(w_RxC.shape)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the scaled, smoothed and unscaled frequency bands all occur at head_dim 16.
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}


def _hf_model(kind: str, **overrides):
    if kind == "llama":
        cfg = transformers.LlamaConfig(**dict(HF_TINY, tie_word_embeddings=False, **overrides))
        return randomize_hf(transformers.LlamaForCausalLM(cfg))
    cfg = transformers.Qwen2Config(**dict(HF_TINY, tie_word_embeddings=True, **overrides))
    return randomize_hf(transformers.Qwen2ForCausalLM(cfg))


def _hf_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens_BxT).long()).logits.float().numpy()


@jax.jit(static_argnums=0)
def _forward(graphdef, params, tokens_BxT, mask_BxT):
    model = nnx.merge(graphdef, params)
    return model.logits(model.hidden_states(tokens_BxT, mask_BxT))


def _our_logits(pre, tokens_BxT: np.ndarray) -> np.ndarray:
    tokens = jnp.asarray(tokens_BxT)
    return np.asarray(_forward(pre.graphdef, pre.params, tokens, jnp.ones_like(tokens)))


def _next_token_greedy(pre, seq: list[int], pad_to: int = 16) -> int:
    """argmax of the full forward at the last token (right-padded: one compilation)."""
    tokens = np.zeros((1, pad_to), np.int32)
    tokens[0, : len(seq)] = seq
    mask = (np.arange(pad_to) < len(seq))[None, :]
    logits = _forward(pre.graphdef, pre.params, jnp.asarray(tokens), jnp.asarray(mask))
    return int(np.asarray(logits)[0, len(seq) - 1].argmax())


_TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = _hf_model("llama", rope_scaling=_LLAMA3_ROPE)
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d)
    return str(d), model


# ------------------------------------------------------------------ HF parity
def test_llama3_rope_scaling_logits_match_transformers(llama_dir):
    d, model = llama_dir
    pre = load_pretrained(d)
    assert pre.cfg.rope_scaling is not None and pre.cfg.rope_scaling.factor == 8.0
    assert not pre.cfg.tie_embeddings
    ref = _hf_logits(model, _TOKENS)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits
    np.testing.assert_allclose(_our_logits(pre, _TOKENS), ref, atol=1e-4, rtol=0)


def test_qwen2_tied_with_bias_logits_match_transformers(tmp_path):
    model = _hf_model("qwen2", rope_theta=5000.0)
    model.save_pretrained(tmp_path)
    pre = load_pretrained(str(tmp_path))
    assert pre.cfg.qkv_bias and pre.cfg.tie_embeddings and pre.cfg.rope_theta == 5000.0
    np.testing.assert_allclose(
        _our_logits(pre, _TOKENS), _hf_logits(model, _TOKENS), atol=1e-4, rtol=0
    )


def test_sharded_safetensors_onto_tp_mesh(tmp_path, llama_dir):
    _, model = llama_dir
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    meshes = mesh_lib.make_meshes(mesh_lib.MeshConfig(generate_devices=2, instance_tp=2))
    (inst,) = mesh_lib.instance_meshes(meshes.generate)
    pre = load_pretrained(str(tmp_path), mesh=inst, role="generate")
    q = pre.params["layers"]["q"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp", None)
    # Each device holds only its half of the heads.
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 2, 16)}
    np.testing.assert_allclose(
        _our_logits(pre, _TOKENS), _hf_logits(model, _TOKENS), atol=1e-4, rtol=0
    )


def test_bf16_params_load(llama_dir):
    pre = load_pretrained(llama_dir[0], param_dtype="bfloat16", dtype="bfloat16")
    assert pre.params["embed"][...].dtype == jnp.bfloat16
    ref = _hf_logits(llama_dir[1], _TOKENS)
    assert np.abs(_our_logits(pre, _TOKENS) - ref).max() < 0.1 * np.abs(ref).max()


# ------------------------------------------------------------------ GGUF
def _write_gguf(path: str, model, *, permute: bool = True, arch: str = "llama") -> None:
    """Writes an F32 GGUF the way llama.cpp's converter lays a Llama model out."""
    import gguf

    c = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(c.num_hidden_layers):
        for g, h in names.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            if permute and g == "attn_q":
                t = _permute_qk(t, c.num_attention_heads)
            if permute and g == "attn_k":
                t = _permute_qk(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = _hf_model("llama")
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    _write_gguf(path, model)
    return path, model


def test_permute_roundtrip():
    w = np.arange(8 * 3 * 2 * 5, dtype=np.float32).reshape(48, 5)
    p = _permute_qk(w, 3)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(p, 3), w)


def test_gguf_logits_match_transformers(tiny_gguf):
    path, model = tiny_gguf
    pre = load_pretrained(path)
    assert pre.tokenizer is None and not pre.cfg.tie_embeddings
    np.testing.assert_allclose(
        _our_logits(pre, _TOKENS), _hf_logits(model, _TOKENS), atol=1e-4, rtol=0
    )


def test_a_gguf_files_matrices_are_written_once_in_the_models_layout(tiny_gguf):
    # read_gguf stacks each per-layer matrix into an array whose transpose is the model's
    # [L, in, out] layout as it lies: to_model_layout takes it without another copy (the
    # copy of a 135M model's weights into fresh memory cost SmolLM2's load 6 s here).
    path, model = tiny_gguf
    contents = gguf_loader.read_gguf(path)
    out = hf_loader.to_model_layout(contents.hf_weights, contents.cfg, path)
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        assert np.shares_memory(out[f"layers/{name}"], contents.hf_weights[name]), name
        assert out[f"layers/{name}"].flags.c_contiguous, name


def test_gguf_without_permutation_is_detected_as_different(tmp_path, tiny_gguf):
    # Guards the parity test's power: skipping llama.cpp's q/k permutation must show.
    _, model = tiny_gguf
    path = str(tmp_path / "unpermuted.gguf")
    _write_gguf(path, model, permute=False)
    diff = np.abs(_our_logits(load_pretrained(path), _TOKENS) - _hf_logits(model, _TOKENS))
    assert diff.max() > 1e-2


# ------------------------------------------------------------------ bad input
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        load_pretrained(str(tmp_path / "nothing_here"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(str(tmp_path))


def test_missing_weights(tmp_path, llama_dir):
    shutil.copy(os.path.join(llama_dir[0], "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(str(tmp_path))


def test_truncated_safetensors(tmp_path, llama_dir):
    shutil.copytree(llama_dir[0], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        load_pretrained(str(tmp_path / "m"))
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        load_pretrained(str(tmp_path / "m"))


def test_truncated_gguf(tmp_path, tiny_gguf):
    with open(tiny_gguf[0], "rb") as f:
        data = f.read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) * 3 // 5])
    with pytest.raises(ValueError, match="cut.gguf"):
        load_pretrained(str(path))
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="cut.gguf.*not a GGUF"):
        load_pretrained(str(path))


def test_the_gguf_header_reads_as_the_gguf_library_reads_it(tmp_path):
    # `read_header` (the tokenizer's and the config's path) against gguf.GGUFReader on the
    # shipped SmolLM2 file: every metadata value, tensor name and tensor's bytes the same.
    path = smollm2_gguf_path()
    meta, names = gguf_loader.read_header(path)
    reader = gguf.GGUFReader(path, "r")
    assert meta == {key: field.contents() for key, field in reader.fields.items()}
    assert names == [t.name for t in reader.tensors]
    # read_gguf's tensors: the same bytes, shapes and dtypes as the library's views
    _, entries, start, buf = gguf_loader._parse(path)
    assert start == reader.data_offset
    for entry, theirs in zip(entries, reader.tensors, strict=True):
        ours = gguf_loader._tensor_data(path, buf, start, entry)
        assert (ours.shape, ours.dtype) == (theirs.data.shape, theirs.data.dtype), entry
        np.testing.assert_array_equal(ours, theirs.data, err_msg=entry.name)
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(start + 4096))  # the header whole, the tensors cut short
    with pytest.raises(ValueError, match=r"cut.gguf: tensor '.*' lies past the end of the file"):
        gguf_loader.read_gguf(str(cut))
    with open(path, "rb") as f:
        head = f.read(1 << 20)  # the header (~2 MB of vocabulary) cut short
    cut.write_bytes(head)
    with pytest.raises(ValueError, match=r"cut.gguf: not a readable GGUF file \(truncated"):
        gguf_loader.read_header(str(cut))
    claim = bytearray(head[:24])
    claim[16:24] = (1 << 62).to_bytes(8, "little")  # a metadata count no file holds
    cut.write_bytes(bytes(claim) + b"\x05" * 64)
    with pytest.raises(ValueError, match="cut.gguf"):
        gguf_loader.read_header(str(cut))


def test_unknown_architecture(tmp_path, llama_dir, tiny_gguf):
    shutil.copytree(llama_dir[0], tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json.*unknown architecture 'GPT2LMHeadModel'"):
        load_pretrained(str(tmp_path / "m"))
    path = str(tmp_path / "gpt2.gguf")
    _write_gguf(path, tiny_gguf[1], arch="gpt2")
    with pytest.raises(ValueError, match="gpt2.gguf.*unknown architecture.*'gpt2'"):
        load_pretrained(path)


@pytest.mark.parametrize(
    "key,value",
    [("rope.scaling.type", "linear"), ("rope.dimension_count", 8),
     ("attention.sliding_window", 4)],
)  # fmt: skip
def test_gguf_metadata_the_reader_does_not_map_is_refused_by_name(key, value):
    from streamrl_jax.model.gguf_loader import config_from_metadata

    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.feed_forward_length": 112,
            "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 128, "llama.rope.dimension_count": 16}  # fmt: skip
    assert config_from_metadata(meta, set(), "m.gguf").head_dim == 16
    with pytest.raises(ValueError, match=f"m.gguf: GGUF metadata llama.{key}={value!r}"):
        config_from_metadata(meta | {f"llama.{key}": value}, set(), "m.gguf")


def test_config_weights_shape_mismatch(tmp_path, llama_dir):
    shutil.copytree(llama_dir[0], tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 96
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'gate'.*config"):
        load_pretrained(str(tmp_path / "m"))


def test_unused_checkpoint_tensor_is_an_error(tmp_path, llama_dir):
    _, model = llama_dir
    model.config.mlp_bias = False
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)
    from safetensors.torch import save_file

    shutil.copy(os.path.join(llama_dir[0], "config.json"), tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.bias"):
        load_pretrained(str(tmp_path))


# ------------------------------------------------------------------ complete (engine)
# One generation shared by the two tests below (one engine's programs): prompts of 40 and
# 60 tokens, both in the last prompt bucket (one prefill program); the second fills the
# context of 64 after 4 new tokens.
_PROMPTS = [np.random.default_rng(s).integers(0, 128, n).tolist() for s, n in ((2, 40), (1, 60))]


@pytest.fixture(scope="module")
def generated(llama_dir):
    pre = load_pretrained(llama_dir[0])
    out = complete.generate(pre.cfg, pre.graphdef, pre.params, _PROMPTS, max_new_tokens=10)
    return pre, out


def test_greedy_generate_matches_full_forward_argmax(generated):
    pre, out = generated
    for prompt, new in zip(_PROMPTS, out, strict=True):
        seq = list(prompt)
        for _ in range(len(new)):
            seq.append(_next_token_greedy(pre, seq, pad_to=64))
        assert new == seq[len(prompt) :]
    # A stop id ends the row early and is not returned (the same shapes: no new compile).
    stopped, _ = complete.generate(
        pre.cfg, pre.graphdef, pre.params, _PROMPTS, max_new_tokens=10, stop_ids=[out[0][2]]
    )
    assert stopped == out[0][: out[0].index(out[0][2])]


def test_prompt_longer_than_context(llama_dir):
    pre = load_pretrained(llama_dir[0])
    with pytest.raises(ValueError, match="prompt length 70 .*context of 64"):
        complete.generate(pre.cfg, pre.graphdef, pre.params, [[1] * 70], max_new_tokens=4)


def test_generate_stops_at_the_context_and_rejects_bad_arguments(generated):
    pre, out = generated
    assert [len(new) for new in out] == [10, 4]  # 60 + 4 fills the context of 64
    short = _PROMPTS[0]
    with pytest.raises(ValueError, match="at least one token"):
        complete.generate(pre.cfg, pre.graphdef, pre.params, [short, []])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        complete.generate(pre.cfg, pre.graphdef, pre.params, [short], max_new_tokens=0)


# ------------------------------------------------------------------ SmolLM2 (embedded default)
@pytest.fixture(scope="module")
def smol():
    return load_pretrained(smollm2_gguf_path())


_CHAT = [{"role": "user", "content": "What is 2+3?"}]


def test_smollm2_config(smol):
    cfg = smol.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    assert smol.tokenizer.eos_id == 2 and 2 in smol.tokenizer.stop_ids


@pytest.mark.extended  # the real model through the engine (~20 s of compiling its 30 layers);
# its forward is checked against transformers below, the engine's decode on the tiny models
def test_smollm2_greedy_answers_5(smol):
    answer = complete.complete_chat(smol, "What is 2+3?", max_new_tokens=24)
    assert "5" in answer, answer


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smol, monkeypatch):
    # transformers dequantises the same file itself (and undoes the q/k permutation its
    # own way); both sides compute in float32 on identical dequantised weights.
    # Its loader parses the file's header twice (config, then weights) and builds gguf's
    # tensor-name map once per tensor (397 times): both are pure, so each is made once
    # for the same arguments here (measured quiet: this test 20.5 s -> 10.8 s; what it
    # reads is unchanged).
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
    names = functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map)
    monkeypatch.setattr(gguf, "get_tensor_name_map", names)
    directory, name = os.path.split(smollm2_gguf_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    ids = np.asarray([smol.tokenizer.encode_chat(_CHAT)], np.int32)
    ref = _hf_logits(hf, ids)
    ours = _our_logits(smol, ids)
    diff = np.abs(ours - ref).max()
    assert diff <= 1e-3, diff
    assert (ours[0, -1].argmax()) == ref[0, -1].argmax()
