"""int8 rollout vs float32 rollout: engine tokens/s on SmolLM2-135M, and the log-prob gap.

Two engines on the same weights (the packaged GGUF, dequantised to f32), one
with `weight_dtype="int8"` (generation/quant.py), one with the f32 copy; per
batch size, the same random prompts of `--prompt` tokens, exactly `--new`
greedy new tokens each, all at once; the two engines alternate `--repeats`
times after a warm-up run (best kept), so machine noise hits both. Time
includes the prefill.

The log-prob gap: the int8 engine's recorded behaviour log-probs against the
f32 model's log-probs of the same tokens (`Llama.token_logprobs`, what the
trainer computes), mean and max absolute difference over the largest batch:
the mismatch the trainer's TIS weight corrects.

    PYTHONPATH=. python tools/bench_int8.py                 # batches 1, 8, 16
    PYTHONPATH=. python tools/bench_int8.py --quick         # 2 repeats, <= 5 minutes
    PYTHONPATH=. python tools/bench_int8.py --batches=1,8   # fewer
    PYTHONPATH=. python tools/bench_int8.py --chain         # matmul variants only

`--chain` times, instead, SmolLM2's MLP shapes (30 x (576x1536, 1536x576),
random weights) under the ways an int8 weight can be multiplied on XLA:CPU:
f32 weights, weight-only dequantisation (`x @ q.astype(f32) * s`), bf16
weights upcast, and `quant.einsum`'s W8A8 (int8 x int8 -> int32), alternated,
best of `--repeats` x 7 (why W8A8: docs/generation.md, "int8 rollout").

The last line of stdout is JSON: `int8_over_f32_b{B}` (int8 tokens/s over f32
tokens/s) per batch, the tokens/s, the greedy token agreement, the log-prob gap
and the load average.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "8", "16"], "Decode batch sizes (slots = prompts).")
flags.DEFINE_integer("prompt", 24, "Prompt tokens.")
flags.DEFINE_integer("new", 64, "Forced new tokens per prompt.")
flags.DEFINE_integer("repeats", 3, "Alternating timed runs per engine (best kept).")
flags.DEFINE_bool("quick", False, "2 repeats (<= 5 minutes on 2 CPU cores).")
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_bool("chain", False, "Time the matmul variants on SmolLM2's MLP chain only.")


def chain() -> dict:
    """ms per pass of the MLP chain per variant and batch (best of repeats x 7)."""
    import jax.numpy as jnp

    from streamrl_jax.generation import quant

    layers, e, m = 30, 576, 1536
    rng = np.random.default_rng(FLAGS.seed)
    f32 = [
        (
            jnp.asarray(rng.standard_normal((e, m)) * 0.05, jnp.float32),
            jnp.asarray(rng.standard_normal((m, e)) * 0.05, jnp.float32),
        )
        for _ in range(layers)
    ]
    int8 = [(quant.quantize(a, (0,)), quant.quantize(b, (0,))) for a, b in f32]
    bf16 = [(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) for a, b in f32]

    def run(mm):
        def f(x, ws):
            for a, b in ws:
                x = x + mm(jax.nn.silu(mm(x, a)), b)
            return x

        return jax.jit(f)

    variants = {
        "f32": (run(lambda x, w: x @ w), f32),
        "int8_dequant": (run(lambda x, w: (x @ w.q.astype(x.dtype)) * w.scale), int8),
        "bf16_upcast": (run(lambda x, w: x @ w.astype(x.dtype)), bf16),
        "int8_w8a8": (run(lambda x, w: quant.einsum("ne,ef->nf", x, w)), int8),
    }
    out = {}
    for b in [int(x) for x in FLAGS.batches]:
        x = jnp.asarray(rng.standard_normal((b, e)), jnp.float32)
        best = {}
        for name, (f, ws) in variants.items():
            f(x, ws).block_until_ready()  # compile
            best[name] = float("inf")
        for _ in range(_repeats()):  # alternate so machine noise hits every variant
            for name, (f, ws) in variants.items():
                for _ in range(7):
                    t = time.perf_counter()
                    f(x, ws).block_until_ready()  # deliberate sync: timing
                    best[name] = min(best[name], time.perf_counter() - t)
        out[f"chain_b{b}_ms"] = {k: round(v * 1e3, 2) for k, v in best.items()}
        print(f"batch {b:3d}: " + "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in best.items()))
    return out


def _logprob_gap(pre, samples) -> dict:
    """|int8 behaviour log-prob - f32 model log-prob| over every response token."""
    from flax import nnx

    @jax.jit
    def f32_logp(params, seq):
        inputs, targets = seq[:, :-1], seq[:, 1:]
        mask = (inputs >= 0).astype(np.float32)
        return nnx.merge(pre.graphdef, params).token_logprobs(inputs, targets, mask)[0]

    seqs = np.stack([np.concatenate([s.prompt, s.response]) for s in samples]).astype(np.int32)
    want = np.asarray(jax.device_get(f32_logp(pre.params, seqs)))[:, FLAGS.prompt - 1 :]
    got = np.stack([s.logprobs for s in samples])
    diff = np.abs(got - want)
    return {"mean_abs": round(float(diff.mean()), 5), "max_abs": round(float(diff.max()), 4)}


def _repeats() -> int:
    return min(FLAGS.repeats, 2) if FLAGS.quick else FLAGS.repeats


def main(argv):
    del argv
    if FLAGS.chain:
        print(json.dumps({"load_avg": round(os.getloadavg()[0], 2), **chain()}))
        return
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained, single_device_mesh

    mesh = single_device_mesh()
    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    rng = np.random.default_rng(FLAGS.seed)
    out: dict = {"load_avg_start": round(os.getloadavg()[0], 2)}
    last_int8 = None
    for b in [int(x) for x in FLAGS.batches]:
        prompts = rng.integers(100, pre.cfg.vocab_size, size=(b, FLAGS.prompt))
        reqs = [
            GenerationRequest(
                request_id=i,
                prompt=p.tolist(),
                max_new_tokens=FLAGS.new,
                forced_length=FLAGS.new,
                sampling=SamplingParams.greedy(),
            )
            for i, p in enumerate(prompts)
        ]
        engines = {}
        for wd in ("auto", "int8"):
            ecfg = EngineConfig(
                num_slots=b,
                max_prompt_length=FLAGS.prompt,
                max_total_length=FLAGS.prompt + FLAGS.new,
                chunk_steps=16,
                prefill_batch=b,
                min_bucket=FLAGS.prompt,
                weight_dtype=wd,
            )
            engines[wd] = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
            engines[wd].run(reqs)  # compile
        best = {wd: float("inf") for wd in engines}
        samples = {}
        for _ in range(_repeats()):
            for wd, engine in engines.items():
                t = time.perf_counter()
                got = engine.run(reqs)
                best[wd] = min(best[wd], time.perf_counter() - t)
                samples[wd] = sorted(got, key=lambda s: s.request_id)
        tokens = b * FLAGS.new
        f32_tps, int8_tps = tokens / best["auto"], tokens / best["int8"]
        same = np.mean(
            [np.mean(a.response == c.response) for a, c in zip(*samples.values(), strict=True)]
        )
        out[f"b{b}"] = {
            "f32_tokens_per_s": round(f32_tps, 1),
            "int8_tokens_per_s": round(int8_tps, 1),
            "same_greedy_tokens_fraction": round(float(same), 3),
            "load_avg": round(os.getloadavg()[0], 2),
        }
        out[f"int8_over_f32_b{b}"] = round(int8_tps / f32_tps, 2)
        last_int8 = samples["int8"]
        print(
            f"batch {b:3d}: f32 {f32_tps:7.1f} tok/s  int8 {int8_tps:7.1f} tok/s  "
            f"int8/f32 {int8_tps / f32_tps:.2f}x  same greedy tokens {same:.2f}  "
            f"(load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    out["int8_logprob_gap"] = _logprob_gap(pre, last_int8)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
