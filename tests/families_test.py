"""The checkpoint families the decoder loads (docs/model.md "Families"): each built by
`transformers` from its config with random weights and saved as safetensors, loaded
as `model.source=<dir>` is: logits within 1e-4 (f32) of transformers' at every
position; the engine's greedy tokens are the training forward's argmax and its
log-probs the training forward's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from support import HF_TINY, randomize_hf

from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model.config import SUPPORTED_ARCHITECTURES, from_hf_config
from streamrl_jax.model.loader import load_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # all three frequency bands at head_dim 16
    "rope_theta": 500000.0,
}
# family -> (config class, model class, config fields beyond HF_TINY)
FAMILIES = {
    # Qwen3: q/k norms; head_dim set apart from hidden / heads, as Qwen3's checkpoints do
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_untied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, tie_word_embeddings=False, rope_theta=1e6),
    ),
    # Gemma 3: sliding-window layers (window 4: the test's prompts are longer) between
    # global ones with their own RoPE base and linear scaling, q/k norms, (1 + w) norms
    # before and after attention and the MLP, GeGLU, sqrt(E)-scaled embeddings, an
    # attention scale apart from 1/sqrt(head_dim)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=4,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
    ),
    # Mixture of experts: Qwen3-MoE (q/k norms, top-k renormalised here) and Mixtral
    # (always renormalised), 4 experts, 2 a token; saved per expert, as the hub's are
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    # Sliding windows (4: shorter than the test's prompts and sequences) on every layer
    # (Mistral), and from layer `max_window_layers` on (Qwen2, with its q/k/v biases)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    # Llama 3.2 (1B/3B): tied embeddings and llama3 RoPE scaling
    "llama3.2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE),
    ),
}
_TOKENS = np.random.default_rng(0).integers(0, 128, size=(2, 12)).astype(np.int32)
# Each family's layer windows as its config above sets them (0: a global layer).
_WINDOWS = {"gemma3": (4, 0, 4, 0), "mistral": (4, 4), "qwen2": (0, 4)}


# The engine tests of these families run with -m extended (the suite's budget): qwen3,
# qwen3_moe and gemma3 (global and windowed layers) cover what they add; qwen2's windowed
# layers with q/k/v biases are decoder_test's `layer_windows=(0, 3)` case (the engine's
# decoder against the training forward), its checkpoint's windows the parity test's;
# llama3.2's llama3 RoPE scaling in the engine is loader_test's
# test_greedy_generate_matches_full_forward_argmax, its tied head engine_test's tiny model.
_ENGINE_EXTENDED = ("qwen3_untied", "mixtral", "mistral", "qwen2", "llama3.2")
ENGINE_FAMILIES = [
    pytest.param(f, marks=pytest.mark.extended) if f in _ENGINE_EXTENDED else f
    for f in sorted(FAMILIES)
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    cfg_cls, model_cls, extra = FAMILIES[request.param]
    cfg = getattr(transformers, cfg_cls)(**(HF_TINY | extra))
    model = randomize_hf(getattr(transformers, model_cls)(cfg))
    d = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    model.save_pretrained(d)
    return request.param, str(d), model, load_pretrained(str(d))  # loaded once a family


# The training forward's one shape: the engine tests' sequences (8 + 12 tokens at most)
# and the parity test's `_TOKENS` right-padded (causal: padding after a position never
# changes it), so each family compiles it once.
_WIDTH = 20


@jax.jit(static_argnums=0)
def _forward(graphdef, params, tokens_BxT):
    """(logits, log-probs of each next token) of the training forward, all positions."""
    m = nnx.merge(graphdef, params)
    ones = jnp.ones_like(tokens_BxT)
    logits = m.logits(m.hidden_states(tokens_BxT, ones))
    logp, _ = m.token_logprobs(tokens_BxT, jnp.roll(tokens_BxT, -1, axis=1), ones)
    return logits, logp


def _padded(rows) -> np.ndarray:
    out = np.zeros((len(rows), _WIDTH), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _engine(pre, max_total: int = 32) -> Engine:
    """An engine of 2 slots on one device for `pre` (prompts of up to 8 tokens); the
    tests' engines have equal statics, so they share its compiled programs."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    ecfg = EngineConfig(num_slots=2, max_prompt_length=8, max_total_length=max_total, chunk_steps=4)
    return Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)


def test_logits_match_transformers_at_every_position(family):
    name, _, model, pre = family
    assert pre.cfg.qk_norm == name.startswith(("qwen3", "gemma3"))
    assert bool(pre.cfg.num_experts) == (name in ("qwen3_moe", "mixtral"))
    assert pre.cfg.layer_windows == _WINDOWS.get(name, ())
    with torch.no_grad():
        ref = model(torch.from_numpy(_TOKENS).long()).logits.float().numpy()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits

    got = np.asarray(_forward(pre.graphdef, pre.params, _padded(_TOKENS))[0])[:, : _TOKENS.shape[1]]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ENGINE_FAMILIES, indirect=True)
def test_the_engine_decodes_the_training_forwards_argmax_and_logprobs(family):
    _, _, _, pre = family
    engine = _engine(pre)
    prompts = [_TOKENS[0, :8].tolist(), _TOKENS[1, :5].tolist()]
    reqs = [
        GenerationRequest(
            request_id=i, prompt=p, max_new_tokens=12, sampling=SamplingParams.greedy()
        )
        for i, p in enumerate(prompts)
    ]
    samples = sorted(engine.run(reqs), key=lambda s: s.request_id)
    seqs = [np.concatenate([s.prompt, s.response]) for s in samples]
    logits, logp = jax.device_get(_forward(pre.graphdef, pre.params, _padded(seqs)))
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        start, end = len(s.prompt) - 1, len(seq) - 1  # the positions that fed a response
        np.testing.assert_array_equal(s.response, logits[i, start:end].argmax(-1))
        np.testing.assert_allclose(s.logprobs, logp[i, start:end], atol=1e-4)


def test_an_unsupported_architecture_is_one_line_naming_it_and_the_supported_list():
    with pytest.raises(ValueError, match=r"unknown architecture 'Gemma2ForCausalLM'.*supported"):
        from_hf_config({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    assert {"Qwen3ForCausalLM", "Gemma3ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


def _run_dir(kind: str, root) -> str:
    """A tiny random checkpoint of `kind` with SmolLM2's tokenizer (`support.hf_run_dir`)."""
    from support import hf_run_dir

    return hf_run_dir(root / kind, *FAMILIES[kind])


@pytest.mark.parametrize(
    "kind,mode",
    # one by default (the suite's budget; a MoE's training is held by trainer_test's
    # packing test), the rest with -m extended
    [
        ("qwen3", "stream_async"),
        pytest.param("qwen3_moe", "stream_async", marks=pytest.mark.extended),
        pytest.param("qwen3", "colocated", marks=pytest.mark.extended),
        pytest.param("gemma3", "stream_async", marks=pytest.mark.extended),
    ],  # fmt: skip
)
def test_a_checkpoint_of_each_new_family_trains_through_the_pipeline(kind, mode, tmp_path):
    from support import tiny_config

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.rewards.vowels import vowel_reward

    source = _run_dir(kind, tmp_path)
    # one step: the checkpoint loads, generates and trains (what more steps add is the
    # pipeline's own, lifecycle_test's and resume_test's on the tiny source)
    cfg = tiny_config(model__source=source, pipeline__mode=mode, pipeline__steps=1)
    result = run_lib.run(cfg, str(tmp_path / "run"), reward_fn=vowel_reward)
    assert len(result.steps) == 1
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in result.steps)


def test_gemmas_builtin_chat_format_and_its_end_of_turn_stop():
    import tokenizers

    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.tokenizer import Tokenizer

    base = Tokenizer.from_gguf(smollm2_gguf_path())
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())  # a copy, then Gemma's
    backend.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    tok = Tokenizer(backend, eos_ids=base.eos_ids, bos_id=base.bos_id)
    assert tok.template_style == "gemma"
    assert backend.token_to_id("<end_of_turn>") in tok.stop_ids
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
         {"role": "assistant", "content": "5"}, {"role": "tool", "content": "ok"}]
    )  # fmt: skip
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n2+3?<end_of_turn>\n"
        "<start_of_turn>model\n5<end_of_turn>\n<start_of_turn>user\nok<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


# By default the family whose extension differs most (gemma3: sliding windows between
# global layers); the rest with -m extended (the suite's budget). The plain extension is
# engine_test's test_an_episode_turn_extends_the_kept_kv_as_a_re_prefill_would; a mixture
# of experts' extended positions route as the training forward does in
# routing_replay_test's test_the_engine_records_the_experts_the_training_forward_routes_to.
@pytest.mark.parametrize(
    "family",
    [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.extended)
     for f in sorted(FAMILIES)],
    indirect=True,
)  # fmt: skip
def test_an_episode_turn_extended_in_place_draws_what_a_re_prefill_draws(family):
    # Multi-turn episodes on every family (sliding windows included): the next turn
    # appended to the kept KV samples what re-prefilling the whole history samples.
    import dataclasses

    from streamrl_jax.generation.types import Continuation

    _, _, _, pre = family
    kept, fresh = _engine(pre), _engine(pre)
    sampled = SamplingParams(temperature=0.9)
    reqs = [
        GenerationRequest(request_id=i, prompt=_TOKENS[i, :8].tolist(), max_new_tokens=6,
                          sampling=sampled, seed=7 + i, keep_kv=True)
        for i in range(2)
    ]  # fmt: skip
    first = {s.request_id: s for s in kept.run(reqs)}
    env = [[5, 6, 7], [9]]
    turns = []
    for r in reqs:
        cont = Continuation.after(first[r.request_id], env[r.request_id])
        turns.append(
            dataclasses.replace(r, continuation=cont, max_new_tokens=cont.policy_tokens + 6)
        )
    extended = {s.request_id: s for s in kept.run(turns)}
    again = fresh.run([dataclasses.replace(t, keep_kv=False) for t in turns])
    assert kept.metrics()["extended"] == 2 and fresh.metrics()["extended"] == 0
    for s in again:
        np.testing.assert_array_equal(extended[s.request_id].response, s.response)
        np.testing.assert_allclose(extended[s.request_id].logprobs, s.logprobs, atol=1e-4)
