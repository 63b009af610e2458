"""The training–generation mismatch of a mixture-of-experts model against a dense one.

A tiny MoE (8 experts, 2 a token) and a dense model of the same width, random weights
scaled x4 (so routing and attention are far from uniform); each generates in bfloat16
(the engine's compute dtype) and is re-scored in float32 by the training forward
(`Llama.token_logprobs`, what the trainer computes), as a bf16 rollout with an f32
trainer does. Per sampled token: |log pi_train - log pi_behaviour|, and the importance
ratio exp(log pi_train - log pi_behaviour) (its spread, and the share outside PPO's
clip range [0.8, 1.2]). The MoE's engine records its routes (`EngineConfig.record_routes`)
and the same figures are measured again with them replayed in the f32 forward
(`model.routing_replay`); the routers' choices are compared per (fed position, layer),
the f32 trainer's own against the bf16 engine's record: a flipped expert is the
mismatch routing replay removes (docs/model.md, "Routing replay").

    PYTHONPATH=. python tools/bench_moe_mismatch.py            # 64 prompts x 48 tokens
    PYTHONPATH=. python tools/bench_moe_mismatch.py --quick    # 16 prompts

The last line of stdout is JSON: per model, the |dlogp| mean / p99 / max, the ratio's
std and out-of-clip share, and (MoE) the share of routing decisions that differ and the
same figures with the routes replayed (`replay`).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama

FLAGS = flags.FLAGS
flags.DEFINE_integer("prompts", 64, "Prompts (one sample each).")
flags.DEFINE_integer("new", 48, "Sampled tokens per prompt.")
flags.DEFINE_integer("prompt", 16, "Prompt tokens.")
flags.DEFINE_bool("quick", False, "16 prompts (seconds).")
flags.DEFINE_integer("seed", 0, "Weights and prompts seed.")

_WIDTH = dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
MODELS = {
    "moe": model_config.tiny(**_WIDTH, num_experts=8, experts_per_token=2,
                             moe_intermediate_size=32, intermediate_size=64),
    "dense": model_config.tiny(**_WIDTH, intermediate_size=64),
}  # fmt: skip


def _stats(d: np.ndarray) -> dict:
    """|log pi_train - log pi_behaviour| and the importance ratio's spread over tokens."""
    ratio = np.exp(d)
    return {
        "tokens": int(d.size),
        "abs_dlogp_mean": round(float(np.abs(d).mean()), 5),
        "abs_dlogp_p99": round(float(np.percentile(np.abs(d), 99)), 5),
        "abs_dlogp_max": round(float(np.abs(d).max()), 5),
        "ratio_std": round(float(ratio.std()), 5),
        "ratio_outside_clip": round(float(((ratio < 0.8) | (ratio > 1.2)).mean()), 5),
    }


def measure(name: str, cfg, n: int) -> dict:
    key = jax.random.key(FLAGS.seed)
    params = jax.jit(
        lambda: jax.tree.map(lambda x: 4.0 * x, nnx.state(llama.Llama(cfg, rngs=nnx.Rngs(key))))
    )()
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(cfg)))
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    total = FLAGS.prompt + FLAGS.new
    moe = bool(cfg.num_experts)
    ecfg = EngineConfig(num_slots=16, max_prompt_length=FLAGS.prompt, max_total_length=total,
                        record_routes=moe)  # fmt: skip
    engine = Engine(graphdef, params, bf16, ecfg, mesh)
    rng = np.random.default_rng(FLAGS.seed)
    prompts = rng.integers(0, cfg.vocab_size, (n, FLAGS.prompt))
    reqs = [
        GenerationRequest(request_id=i, prompt=prompts[i].tolist(), max_new_tokens=FLAGS.new,
                          forced_length=FLAGS.new, sampling=SamplingParams(temperature=1.0),
                          seed=i)
        for i in range(n)
    ]  # fmt: skip
    t0 = time.perf_counter()
    samples = engine.run(reqs)
    model = nnx.merge(graphdef, params)

    @jax.jit
    def train_logp(seq, routes):
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = jnp.ones_like(inputs, jnp.float32)
        return model.token_logprobs(inputs, targets, mask, routes=routes)[0]

    @jax.jit
    def own_routes(seq):
        inputs = seq[:, :-1]
        return model.expert_choices(inputs, jnp.ones_like(inputs))[0]

    gaps, replayed, flips, decisions = [], [], 0, 0
    for s in samples:
        seq = jnp.asarray(np.concatenate([s.prompt, s.response])[None].astype(np.int32))
        start = len(s.prompt) - 1
        gaps.append(np.asarray(train_logp(seq, None))[0, start:] - s.logprobs)
        if moe:
            routes = jnp.asarray(s.routes)[None]
            replayed.append(np.asarray(train_logp(seq, routes))[0, start:] - s.logprobs)
            # the f32 trainer's own choice against the bf16 engine's record, every
            # (fed position, layer)
            same = np.sort(np.asarray(own_routes(seq)), -1) == np.sort(s.routes, -1)
            flips += int((~same.all(-1)).sum())
            decisions += same.shape[0] * same.shape[1]
    out = _stats(np.concatenate(gaps))
    if moe:
        out["routing_flipped"] = round(flips / max(decisions, 1), 5)
        out["replay"] = _stats(np.concatenate(replayed))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {out}", flush=True)
    return out


def main(argv) -> None:
    del argv
    n = 16 if FLAGS.quick else FLAGS.prompts
    out = {"bench": "moe_mismatch", "quick": FLAGS.quick, "prompts": n, "new": FLAGS.new}
    for name, cfg in MODELS.items():
        out[name] = measure(name, cfg, n)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
