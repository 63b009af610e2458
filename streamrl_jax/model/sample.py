"""Minimal batched completion (greedy or temperature) over prefill + decode.

This is the interim "does the model talk" command, not the generation engine
(`generation/` has continuous batching, slots and chunks):

    python -m streamrl_jax.model.sample --prompt "What is 2+3?"

One jitted function runs prefill of the whole (right-padded) batch and a
`lax.while_loop` of decode steps that exits when every row has emitted a stop
token. Weights are a jit argument; prompt lengths are arrays; the padded
prompt length is rounded up to a multiple of `_BUCKET` so nearby prompt
lengths share one compilation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.kv_cache import init_cache

_BUCKET = 64


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_length"))
def _generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens_NxP: jax.Array,
    lengths_N: jax.Array,
    stop_ids_S: jax.Array,
    temperature: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    cache_length: int,
) -> tuple[jax.Array, jax.Array]:
    """Returns (i32[N, max_new_tokens] new tokens, i32[N] count before the first stop)."""
    model = nnx.merge(graphdef, params)
    n = tokens_NxP.shape[0]
    cache = init_cache(model.cfg, n, cache_length)
    logits_NxV, cache = model.prefill(tokens_NxP, lengths_N, cache, jnp.arange(n))

    def pick(logits_NxV: jax.Array, step_key: jax.Array) -> jax.Array:
        greedy = jnp.argmax(logits_NxV, axis=-1)
        sampled = jax.random.categorical(step_key, logits_NxV / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    def cond(carry):
        step, _, _, _, done_N, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done_N)

    def body(carry):
        step, logits_NxV, cache, out_NxT, done_N, count_N = carry
        tok_N = pick(logits_NxV, jax.random.fold_in(key, step))
        is_stop = jnp.any(tok_N[:, None] == stop_ids_S[None, :], axis=-1)
        count_N = count_N + (~done_N & ~is_stop).astype(jnp.int32)
        out_NxT = out_NxT.at[:, step].set(jnp.where(done_N, 0, tok_N))
        done_N = done_N | is_stop
        logits_NxV, cache = model.decode(tok_N, cache, ~done_N)
        return step + 1, logits_NxV, cache, out_NxT, done_N, count_N

    init = (
        jnp.int32(0),
        logits_NxV,
        cache,
        jnp.zeros((n, max_new_tokens), jnp.int32),
        jnp.zeros((n,), bool),
        jnp.zeros((n,), jnp.int32),
    )
    _, _, _, out_NxT, _, count_N = jax.lax.while_loop(cond, body, init)
    return out_NxT, count_N


def generate(
    cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[list[int]]:
    """Completes a batch of token prompts.

    Args:
      cfg: the model's config (for the context length).
      graphdef, params: the split model (params may be sharded).
      prompts: token ids per prompt, each non-empty.
      max_new_tokens: generation budget per prompt; generation also stops at
        the model's context length.
      temperature: 0 for greedy, else softmax sampling at this temperature.
      stop_ids: generation of a row ends at the first of these (not returned).
      seed: sampling seed.

    Returns:
      The new tokens of each prompt, up to (excluding) its first stop token.

    Raises:
      ValueError: an empty prompt, or one that leaves no room in the context
        (the message names its length and the context).
    """
    context = cfg.max_position_embeddings
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) < 1:
        raise ValueError("every prompt needs at least one token")
    if max(lengths) >= context:
        raise ValueError(
            f"prompt length {max(lengths)} leaves no room in the model's context of "
            f"{context} tokens (max_position_embeddings)"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    padded = min(-(-max(lengths) // _BUCKET) * _BUCKET, context)
    cache_length = min(padded + max_new_tokens, context)
    max_new_tokens = min(max_new_tokens, context - max(lengths))
    tokens = np.zeros((len(prompts), padded), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    out, counts = _generate(
        graphdef,
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(list(stop_ids), jnp.int32).reshape(-1),
        jnp.float32(temperature),
        jax.random.key(seed),
        max_new_tokens=max_new_tokens,
        cache_length=cache_length,
    )
    out, counts = np.asarray(out), np.asarray(counts)
    return [out[i, : counts[i]].tolist() for i in range(len(prompts))]


def complete_chat(pretrained, user_message: str, **kwargs) -> str:
    """Greedy (by default) answer of a `Pretrained` chat model to one user message."""
    tok = pretrained.tokenizer
    if tok is None:
        raise ValueError(f"{pretrained.source}: no tokenizer; cannot build a chat prompt")
    ids = tok.encode_chat([{"role": "user", "content": user_message}])
    kwargs.setdefault("stop_ids", tok.stop_ids)
    (new,) = generate(pretrained.cfg, pretrained.graphdef, pretrained.params, [ids], **kwargs)
    return tok.decode(new)


def main(argv: Sequence[str]) -> None:
    del argv
    from absl import flags

    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    f = flags.FLAGS
    pre = load_pretrained(f.model or smollm2_gguf_path())
    print(
        complete_chat(
            pre,
            f.prompt,
            max_new_tokens=f.max_new_tokens,
            temperature=f.temperature,
            seed=f.seed,
        )
    )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("prompt", "What is 2+3?", "User message to answer.")
    flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M).")
    flags.DEFINE_integer("max_new_tokens", 64, "Generation budget.")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    app.run(main)
