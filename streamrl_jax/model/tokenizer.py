"""Tokenizer: a thin wrapper over HF `tokenizers`, from `tokenizer.json` or GGUF metadata.

* `encode` never adds special tokens on its own (pass `add_bos=True`); chat
  prompts carry theirs in the template text, so nothing is doubled.
* `apply_chat_template` renders the checkpoint's own Jinja template when one
  is stored and `jinja2` is importable (as transformers does), else a
  built-in ChatML (SmolLM2, Qwen) or Llama-3 formatter chosen by which special
  tokens the vocabulary has. The built-in ChatML adds no default system
  prompt; SmolLM2's stored template does.
* `stop_ids`: end-of-sequence ids plus the template's end-of-turn tokens.

GGUF ("gpt2" byte-level BPE): the vocabulary and merges come from
`tokenizer.ggml.tokens` / `merges`; control tokens (token_type 3) become
special added tokens and user-defined ones (4) plain added tokens; the
pre-tokenizer follows `tokenizer.ggml.pre` the way llama.cpp does ("smollm":
every digit alone, then the GPT-2 regex -- the same split as SmolLM2's own
`tokenizer.json`; transformers' GGUF reader uses plain GPT-2 here and so
splits multi-digit numbers differently).
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from streamrl_jax.errors import UserError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",  # Gemma
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


class Tokenizer:
    """Text <-> token ids, chat templates and stop tokens of one checkpoint."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_ids: Sequence[int] = (),
        bos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
    ):
        """Wraps a `tokenizers.Tokenizer`.

        Args:
          backend: the HF fast tokenizer.
          eos_ids: end-of-sequence ids (first one is the canonical eos).
          bos_id: beginning-of-sequence id, if the model has one.
          pad_id: padding id; defaults to the first eos id.
          chat_template: the checkpoint's Jinja chat template, if any.
        """
        self.backend = backend
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.bos_id = bos_id
        self._pad_id = pad_id
        self.chat_template = chat_template
        vocab = backend.get_vocab(with_added_tokens=True)
        if "<|start_header_id|>" in vocab:
            self.template_style = "llama3"
        elif "<start_of_turn>" in vocab:
            self.template_style = "gemma"
        elif "<|im_start|>" in vocab:
            self.template_style = "chatml"
        else:
            self.template_style = None
        ends = [vocab[t] for t in _END_OF_TURN if t in vocab]
        self.stop_ids = tuple(dict.fromkeys([*self.eos_ids, *ends]))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dir(cls, directory: str, generation_config: dict | None = None) -> Tokenizer:
        """From an HF directory's `tokenizer.json` (+ `tokenizer_config.json`)."""
        from streamrl_jax.model.hf_loader import read_json

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"missing file: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:
            raise UserError(f"{path}: cannot parse tokenizer: {e}") from e
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        tok_cfg = read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        gen = generation_config or {}

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = gen.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        tok_eos = token_id(tok_cfg.get("eos_token"))
        if tok_eos is not None:  # the tokenizer's own eos is the canonical (first) one
            eos_ids = [tok_eos, *(i for i in eos_ids if i != tok_eos)]
        bos = gen.get("bos_token_id", token_id(tok_cfg.get("bos_token")))
        pad = gen.get("pad_token_id", token_id(tok_cfg.get("pad_token")))
        return cls(
            backend,
            eos_ids=eos_ids,
            bos_id=bos,
            pad_id=pad,
            chat_template=tok_cfg.get("chat_template"),
        )

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """From a GGUF file's metadata (no weights are read). One tokenizer per file
        version in a process: every run, learner and tool that describes the model shares
        it (a tokenizer is not changed after it is built)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        st = os.stat(path)
        return _gguf_tokenizer(cls, os.path.realpath(path), st.st_size, st.st_mtime_ns)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "GGUF") -> Tokenizer:
        """Builds a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` fields.

        Raises:
          ValueError: a tokenizer model other than "gpt2", or missing tokens/merges.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UserError(
                f"{source}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2' "
                "byte-level BPE)"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise UserError(f"{source}: missing tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        # A token outside the byte alphabet is stored as raw text; respell it in bytes.
        tokens = [
            t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
            for t in tokens
        ]
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        if len(types) != len(tokens):
            raise UserError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        typed = list(zip(tokens, types, strict=True))
        special = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == 3]
        backend.add_special_tokens(special)
        user = [AddedToken(t, special=False, normalized=False) for t, k in typed if k == 4]
        if user:
            backend.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            eos_ids=() if eos is None else (int(eos),),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ------------------------------------------------------------------ text <-> ids
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def pad_id(self) -> int:
        """Padding id: the checkpoint's pad token, else eos, else 0."""
        if self._pad_id is not None:
            return int(self._pad_id)
        return self.eos_id if self.eos_id is not None else 0

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [int(self.bos_id), *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        use_builtin: bool = False,
        tools: Sequence[dict] | None = None,
    ) -> str:
        """Renders a conversation ([{"role", "content"}, ...]) as prompt text.

        Args:
          messages: the conversation.
          add_generation_prompt: end with the assistant header, ready to generate.
          use_builtin: ignore the checkpoint's template and use the built-in one.
          tools: OpenAI function schemas, for a template that renders them
            (`renders_tools`); refused otherwise (the caller shows them another way).

        Raises:
          ValueError: no stored template and a vocabulary with no known chat tokens.
        """
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content', got {sorted(m)}")
        if tools and (use_builtin or not self.renders_tools):
            raise ValueError("this chat template does not render tools")
        if self.chat_template and not use_builtin:
            rendered = self._render_jinja(messages, add_generation_prompt, tools)
            if rendered is not None:
                return rendered
        if self.template_style == "chatml":
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        if self.template_style == "llama3":
            text = "<|begin_of_text|>" + "".join(
                f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                for m in messages
            )
            gen = "<|start_header_id|>assistant<|end_header_id|>\n\n"
            return text + (gen if add_generation_prompt else "")
        if self.template_style == "gemma":
            return _gemma_chat(messages, add_generation_prompt)
        raise ValueError(
            "tokenizer has no chat template and no ChatML / Llama-3 special tokens; "
            "format the prompt yourself"
        )

    @property
    def renders_tools(self) -> bool:
        """The checkpoint's chat template renders a `tools` list (Qwen3's, Llama 3.1's)."""
        return (
            bool(self.chat_template)
            and "tools" in self.chat_template
            and (self._jinja_template is not None)
        )

    def _render_jinja(
        self, messages: Sequence[dict], add_generation_prompt: bool, tools: Sequence[dict] | None
    ) -> str | None:
        template = self._jinja_template
        if template is None:  # jinja2 is optional; fall back to the built-in formatter
            return None

        def tok(i: int | None) -> str:
            return "" if i is None else (self.backend.id_to_token(int(i)) or "")

        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_id),
            eos_token=tok(self.eos_id),
            **({"tools": list(tools)} if tools else {}),
        )

    @functools.cached_property
    def _jinja_template(self) -> Any:
        """The chat template compiled once (a compile is ~100x a render; the data pipeline
        and the endpoint render one per prompt), in a sandbox; None without jinja2."""
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            return None

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation (`tools`: as `apply_chat_template`)."""
        return self.encode(
            self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        )


def _gemma_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """Gemma's chat format: `<start_of_turn>{user|model}\n...<end_of_turn>\n` after
    `<bos>`; a system message opens the first user turn (Gemma has no system role) and
    any other role (a tool's result) is a user turn."""
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"] + "\n\n", messages[1:]
    text = "<bos>"
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else "user"
        prefix = system if i == 0 and role == "user" else ""
        text += f"<start_of_turn>{role}\n{prefix}{m['content']}<end_of_turn>\n"
    return text + ("<start_of_turn>model\n" if add_generation_prompt else "")


@functools.lru_cache(maxsize=8)
def _gguf_tokenizer(cls: type[Tokenizer], path: str, size: int, mtime_ns: int) -> Tokenizer:
    """`Tokenizer.from_gguf` of one version (size, modification time) of the file."""
    from streamrl_jax.model import gguf_loader

    return cls.from_gguf_metadata(gguf_loader.read_header(path)[0], path)
