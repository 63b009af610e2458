"""The engine's decoder (`generation/decoder.py`) computes the training model's function:
its prefill and decode give the logits of `Llama`'s full-sequence forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.generation import decoder
from streamrl_jax.model import config, llama


@pytest.mark.parametrize("attention", decoder.ATTENTION)
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"qkv_bias": True, "tie_embeddings": False},
        # Qwen2's windows: a global layer, then one whose window (3) the prompts (5) and
        # the decoded sequences (11) outgrow; one RoPE for both (as Mistral's, Qwen2's)
        {"qkv_bias": True, "layer_windows": (0, 3)},
    ],
)
def test_prefill_then_decode_equals_the_full_forward(overrides, attention):
    """A prefill and six greedy decode steps of `GenModel`, with either decode attention
    form, give at every position the logits of the training model's full-sequence
    forward of the same tokens (f32, atol 1e-5, rtol 1e-5) and so its greedy tokens.
    Prefill rows land in their slots in any order, a row for a slot >= B is dropped, and
    inactive slots compute but do not advance."""
    cfg = config.tiny(**overrides)
    graphdef = nnx.split(nnx.eval_shape(lambda: llama.create(cfg)))[0]
    params = jax.jit(lambda: nnx.split(llama.create(cfg, seed=0))[1])()  # one program
    # Lively (x4: greedy tokens vary), and random norm scales and biases, so that every
    # parameter matters in the comparison.
    rng = np.random.default_rng(1)
    noise = jax.tree.map(lambda x: np.float32(0.05) * rng.standard_normal(x.shape), params)
    params = jax.jit(lambda p, n: jax.tree.map(lambda x, e: 4.0 * x + e, p, n))(params, noise)
    weights = jax.jit(lambda p: decoder.from_training_layout(graphdef, p, cfg))(params)
    b, s, steps = 4, 32, 6
    prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 8)), jnp.int32)
    lengths = jnp.array([3, 5, 3], jnp.int32)
    slots = jnp.array([2, 0, 9], jnp.int32)  # row 0 -> slot 2, row 1 -> slot 0, row 2 dropped
    active = jnp.array([True, False, True, False])

    @jax.jit
    def generate(weights):
        """Prefill, then greedy decode steps; every step's logits and tokens."""
        model = decoder.GenModel(weights, cfg, attention)
        logits, cache, _ = model.prefill(prompts, lengths, decoder.init_cache(cfg, b, s), slots)
        tok = jnp.zeros((b,), jnp.int32).at[slots].set(jnp.argmax(logits, -1), mode="drop")
        out_logits, out_tokens = [logits], [tok]
        for _ in range(steps):
            logits, cache, _ = model.decode(tok, cache, active)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            out_logits.append(logits)
            out_tokens.append(tok)
        return out_logits, out_tokens, cache.lengths

    logits, tokens, cache_lengths = jax.device_get(generate(weights))
    assert cache_lengths.tolist() == [5 + steps, 0, 3 + steps, 0]

    # The full forward of each row's prompt and the tokens it was fed, right-padded.
    rows = {0: 2, 1: 0}  # prompt row -> slot
    t = 5 + steps
    full_tokens, mask = np.zeros((2, t), np.int32), np.zeros((2, t), bool)
    for row, slot in rows.items():
        n = int(lengths[row])
        fed = [int(tokens[i][slot]) for i in range(steps)]
        full_tokens[row, : n + steps] = np.concatenate([np.asarray(prompts[row, :n]), fed])
        mask[row, : n + steps] = True

    @jax.jit
    def forward(params, tokens_BxT, mask_BxT):
        model = nnx.merge(graphdef, params)
        return model.logits(model.hidden_states(tokens_BxT, mask_BxT))

    full = np.asarray(forward(params, jnp.asarray(full_tokens), jnp.asarray(mask)))
    for row, slot in rows.items():
        n = int(lengths[row])
        want = full[row, n - 1 : n + steps]  # after the prompt, then after each fed token
        got = np.stack([logits[0][row]] + [logits[i][slot] for i in range(1, steps + 1)])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(
            [tokens[i][slot] for i in range(steps + 1)], np.argmax(want, -1)
        )
    assert len({int(tokens[i][2]) for i in range(steps + 1)}) > 1  # lively: tokens vary


def test_unknown_attention_form_is_named():
    with pytest.raises(ValueError, match="attention='flash'"):
        decoder.GenModel({}, config.tiny(), "flash")
