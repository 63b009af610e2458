"""The engine's generation layout computes the training model's prefill and decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.generation import decoder
from streamrl_jax.model import config, kv_cache, llama


@pytest.mark.parametrize("attention", decoder.ATTENTION)
@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": False}])
def test_generation_layout_matches_training_layout(overrides, attention):
    """Same logits (f32, atol 1e-5) after a prefill and three decode steps, and the
    same greedy tokens, as `Llama.prefill`/`Llama.decode` on the stacked weights, with
    either decode attention form."""
    cfg = config.tiny(**overrides)
    model = llama.Llama(cfg, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: 4.0 * x, params)  # lively: tokens vary
    weights = jax.jit(lambda p: decoder.from_training_layout(graphdef, p, cfg))(params)
    b, s = 3, 32
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    lengths, slots = jnp.array([8, 5], jnp.int32), jnp.array([2, 0], jnp.int32)

    def run(model, cache):
        """Prefill, then three greedy decode steps; every step's logits."""
        logits, cache = model.prefill(tokens, lengths, cache, slots)
        out, tok = [logits], jnp.zeros((b,), jnp.int32).at[slots].set(jnp.argmax(logits, -1))
        for _ in range(3):
            logits, cache = model.decode(tok, cache, jnp.array([True, False, True]))
            out.append(logits)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return out

    run_old = jax.jit(lambda p: run(nnx.merge(graphdef, p), kv_cache.init_cache(cfg, b, s)))
    run_new = jax.jit(
        lambda w: run(decoder.GenModel(w, cfg, attention), decoder.init_cache(cfg, b, s))
    )
    old, new = run_old(params), run_new(weights)
    for o, n in zip(old, new, strict=True):
        np.testing.assert_allclose(n, o, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(jnp.argmax(n, -1), jnp.argmax(o, -1))


def test_unknown_attention_form_is_named():
    with pytest.raises(ValueError, match="attention='flash'"):
        decoder.GenModel({}, config.tiny(), "flash")
