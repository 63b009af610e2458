"""Tokenizer: GGUF-built SmolLM2 tokenizer vs transformers, chat templates, stop ids."""

import json
import os

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# No multi-digit numbers here: transformers' GGUF reader splits those differently (see below).
_TEXTS = [
    "What is 2+3?",
    "Hello world! How are you doing today?",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square",
]


@pytest.fixture(scope="module")
def smol_tok():
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def hf_tok():
    pytest.importorskip("torch")  # transformers' GGUF reader imports it (none on 3.12)
    directory, name = os.path.split(smollm2_gguf_path())
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_ids_match_transformers_gguf_tokenizer(smol_tok, hf_tok):
    for text in _TEXTS:
        assert smol_tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids, text
    chat = [{"role": "user", "content": "What is 2+3?"}]
    prompt = smol_tok.apply_chat_template(chat)
    assert prompt == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert smol_tok.encode_chat(chat) == hf_tok(prompt, add_special_tokens=False).input_ids


def test_digits_split_individually_like_llama_cpp_smollm(smol_tok):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) isolate
    # every digit; transformers' GGUF reader uses plain GPT-2 splitting instead.
    ids = smol_tok.encode("12345")
    assert [smol_tok.decode([i]) for i in ids] == list("12345")


def test_roundtrip_and_special_tokens(smol_tok):
    for text in _TEXTS:
        assert smol_tok.decode(smol_tok.encode(text), skip_special_tokens=False) == text
    ids = smol_tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol_tok.decode(ids) == "assistant\nok"


def test_smollm2_special_ids_and_template(smol_tok):
    assert smol_tok.eos_id == 2 and smol_tok.pad_id == 2 and smol_tok.bos_id == 1
    assert smol_tok.stop_ids[0] == 2 and set(smol_tok.stop_ids) == {0, 2}
    assert smol_tok.template_style == "chatml"
    chat = [{"role": "user", "content": "hi"}]
    stored = smol_tok.apply_chat_template(chat)
    assert "You are a helpful AI assistant named SmolLM" in stored  # the template's default
    assert stored.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # With an explicit system turn the stored and the built-in ChatML formatter agree.
    chat = [{"role": "system", "content": "Be brief."}, *chat]
    assert smol_tok.apply_chat_template(chat) == smol_tok.apply_chat_template(
        chat, use_builtin=True
    )
    no_gen = smol_tok.apply_chat_template(chat, add_generation_prompt=False)
    assert no_gen.endswith("hi<|im_end|>\n")


def _llama3_dir(tmp_path) -> str:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>"]
    words = ["user", "assistant", "hi", "Ċ", "ĊĊ", "Ġthere"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="hi"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in specials])
    backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_llama3_builtin_template_and_stop_ids(tmp_path):
    gen = {"eos_token_id": [1, 4], "bos_token_id": 0}
    tok = Tokenizer.from_dir(_llama3_dir(tmp_path), generation_config=gen)
    assert tok.template_style == "llama3" and tok.chat_template is None
    assert tok.eos_id == 4 and set(tok.stop_ids) == {1, 4} and tok.pad_id == 4
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.encode("hi", add_bos=True) == [0, vocab_id(tok, "hi")]


def vocab_id(tok: Tokenizer, token: str) -> int:
    return tok.backend.token_to_id(token)


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer.ggml.model='llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        Tokenizer.from_dir(_llama3_dir(tmp_path)).apply_chat_template([{"text": "hi"}])
