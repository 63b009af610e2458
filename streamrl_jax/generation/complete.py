"""Complete a few prompts with the generation engine: the "does the model talk" command.

    python -m streamrl_jax.generation.complete --prompt "What is 2+3?"

`generate` sizes a one-off `Engine` to the prompts (one slot per prompt, the
longest prompt rounded up to a power-of-two bucket, the cache capped at the
model's context) on a one-device mesh and runs it to completion. There is no
second decoder: prefill, the decode loop, sampling and stopping are the
engine's. Equal shapes reuse the engine's shared jit cache, so repeated calls
with similar prompts compile nothing new.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.mesh import INSTANCE_AXES
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.loader import Pretrained

_MIN_BUCKET = 16  # smallest prompt bucket; longer prompts round up to a power of two times this


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
      graphdef, params: the split model (params are copied onto one device).
      prompts: token ids per prompt, each non-empty.
      max_new_tokens: generation budget per prompt; generation also stops at
        the model's context length.
      temperature: 0 for greedy, else softmax sampling at this temperature.
      stop_ids: generation of a prompt ends at the first of these (not returned).
      seed: sampling seed; prompt i draws with the key data [seed, i], so rows
        differ and each depends only on (weights, prompt, seed, i).

    Returns:
      The new tokens of each prompt, in prompt order, up to (excluding) its
      first stop token.

    Raises:
      ValueError: an empty prompt, one that leaves no room in the context (the
        message names its length and the context), or max_new_tokens < 1.
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
    bucket = _MIN_BUCKET
    while bucket < max(lengths):
        bucket *= 2
    # The cache must leave room for one new token after the longest bucket.
    max_prompt = min(bucket, context - 1)
    engine_cfg = EngineConfig(
        num_slots=len(prompts),
        max_prompt_length=max_prompt,
        max_total_length=min(max_prompt + max_new_tokens, context),
        prefill_batch=len(prompts),
        min_bucket=_MIN_BUCKET,
        max_stop_ids=max(len(stop_ids), 1),
    )
    mesh = Mesh(np.array(jax.devices()[:1]), INSTANCE_AXES, axis_types=(AxisType.Auto,))
    engine = Engine(graphdef, params, cfg, engine_cfg, mesh)
    sampling = SamplingParams(temperature=float(temperature), stop_ids=tuple(stop_ids))
    samples = engine.run(
        [
            GenerationRequest(
                request_id=i,
                prompt=list(p),
                max_new_tokens=int(max_new_tokens),
                sampling=sampling,
                seed=((int(seed) & 0xFFFFFFFF) << 32) | i,  # key data [seed, i]
            )
            for i, p in enumerate(prompts)
        ]
    )
    out: list[list[int]] = [[] for _ in prompts]
    for s in samples:
        # The engine keeps the stop token as the last response token; callers here do not.
        end = s.num_tokens - 1 if s.finish_reason == "stop" else s.num_tokens
        out[s.request_id] = s.response[:end].tolist()
    return out


def complete_chat(pretrained: Pretrained, user_message: str, **kwargs) -> str:
    """Greedy (by default) answer of a chat model to one user message.

    Args:
      pretrained: a loaded checkpoint with a tokenizer.
      user_message: the user's turn, rendered with the tokenizer's chat template.
      **kwargs: `generate` options; `stop_ids` defaults to the tokenizer's.
    """
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

    # Defined here, not at import, so importing the module adds no global flags.
    flags.DEFINE_string("prompt", "What is 2+3?", "User message to answer.")
    flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M).")
    flags.DEFINE_integer("max_new_tokens", 64, "Generation budget.")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    app.run(main)
