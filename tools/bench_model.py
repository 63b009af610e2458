"""Model throughput on this machine: training fwd+bwd FLOP/s vs a measured matmul peak, decode.

    python tools/bench_model.py --quick     # <= 5 min on 2 CPU cores
    python tools/bench_model.py             # longer sequences, more repeats
    PYTHONPATH=. python tools/bench_model.py --quick --model=moe_1b_a400m_shape  # a shape

`--model` takes a checkpoint or one of streamrl_podplan/shapes.py's real shapes with random
weights (Qwen3, Llama 3.2, Gemma 3, a 32-expert MoE). For a mixture of experts the
credited FLOPs are the selected experts' (`ModelConfig.flops_per_token`), so the fraction
of peak counts what a grouped kernel must compute, not what XLA:CPU's dense `ragged_dot`
computes (every expert: docs/model.md).

* Peak: a jitted float32 [N, N] @ [N, N] matmul, 2 N^3 FLOPs, best of several.
* Train: `jax.grad` of the mean token log-prob (the training forward, chunked
  vocabulary projection) at batch B, length T: the headline is B=2, T=512, the
  quickstart's micro-batch as the trainer runs it (two packed rows, one shared-
  prompt group of 8 each, trainer/packing.py); B=2, T=128 (the rows before packing)
  and, without --quick, B=4, T=256 are reported beside it. Achieved FLOPs are
  `3 * ModelConfig.flops_per_token(T // 2) * B * T` (fwd + 2x for bwd; T // 2
  is the mean causal attention context).
* Runs with glibc's malloc on transparent huge pages, as `python -m streamrl_jax.launch`
  does (`STREAMRL_MALLOC_HUGEPAGES=0` to compare without).
* Matmul floor: the headline shape's GEMMs alone (`matmul_floor_time`): the fraction of
  peak they reach is the ceiling for the train step's fraction on this backend.
* Decode: one jitted decode step of the engine's decoder (`generation/decoder.py`:
  its weight layout, KV cache, decode attention form and XLA options as a default
  `EngineConfig` picks them on this platform; cache donated) for batch 1 and 8 after a
  64-token prefill into a 512-long KV cache.

The last line printed is JSON (`train_flops_fraction_of_peak`, `decode_step_ms`, ...).
"""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from streamrl_jax.generation import decoder
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.model import llama
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained
from streamrl_podplan.shapes import SHAPES
from streamrl_podplan.shapes import model_config as shape_config

_MODEL = flags.DEFINE_string(
    "model",
    None,
    "HF directory, .gguf, or a real model's shape with random weights (streamrl_podplan/shapes.py: "
    f"{', '.join(SHAPES)}); default: SmolLM2-135M.",
)
_QUICK = flags.DEFINE_bool("quick", False, "Short run (<= 5 min on 2 CPU cores).")
_TRAIN_SHAPES = flags.DEFINE_list(
    "train_shapes",
    None,
    "Training shapes BxT, the first the headline (default 2x512,2x128; without --quick also "
    "4x256), e.g. 1x128 for a model of a billion parameters on this CPU.",
)
_CAUSAL_BLOCK = flags.DEFINE_integer(
    "causal_block",
    None,
    "ModelConfig.causal_block for the training step (0: the whole masked [T, T] "
    "attention square); default: the model's default.",
)


def _best_time(fn, repeats: int) -> float:
    """Best wall time of `fn()` (which must block) over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _shape_model(name: str, overrides: dict):
    """A real model's shape with random weights, as `load_pretrained` returns a model."""
    import types

    cfg = shape_config(name, max_position_embeddings=1024, **overrides)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(cfg)))
    params = jax.jit(lambda: nnx.state(llama.create(cfg, seed=0)))()
    return types.SimpleNamespace(cfg=cfg, graphdef=graphdef, params=params)


def matmul_peak(n: int, repeats: int) -> float:
    """Float32 FLOP/s of one large jitted matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    seconds = _best_time(lambda: mm(a, b).block_until_ready(), repeats)
    return 2 * n**3 / seconds


def train_step_time(pre, batch: int, length: int, repeats: int) -> float:
    tokens = jax.random.randint(jax.random.key(2), (batch, length), 0, pre.cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    mask = jnp.ones_like(tokens)

    @jax.jit
    def grad_fn(params):
        def loss(p):
            logp, _ = nnx.merge(pre.graphdef, p).token_logprobs(tokens, targets, mask)
            return -jnp.mean(logp)

        return jax.grad(loss)(params)

    return _best_time(lambda: jax.block_until_ready(grad_fn(pre.params)), repeats)


def matmul_floor_time(cfg, batch: int, length: int, repeats: int) -> float:
    """The training step's matmuls alone: the best time XLA:CPU takes for the GEMMs a
    fwd+bwd at [batch, length] must run, at their own shapes, with nothing else.

    Per layer the forward's projections (q, k, v, o, gate, up, down: [M, E] x [E, N],
    M = batch * length) and dense attention ([T, D] x [D, T] scores and [T, T] x [T, D]
    values per head), each with its two backward GEMMs (dX = dY W^T, dW = X^T dY); then
    the vocabulary projection and its two. Distinct weights for all layers, as in the
    model. Its credited FLOPs over this time, over the peak, is the fraction of peak a
    trainer made of nothing but these GEMMs would reach: the ceiling for
    `train_flops_fraction_of_peak` on this backend. A mixture of experts' MLP counts as
    one [M, E] x [E, k I] projection per matrix: the FLOPs of the k selected experts'
    rows, as a grouped kernel would run them (the router's [E, X] is left out).
    """
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    if cfg.num_experts:  # the experts a token goes to as one matmul (an ideal grouped one)
        f = cfg.experts_per_token * cfg.moe_intermediate_size
    h, k, v, n = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.num_layers
    m = batch * length
    keys = iter(jax.random.split(jax.random.key(4), 16 * cfg.num_layers + 16))

    def rnd(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32)

    widths = [(e, h * d), (e, k * d), (e, k * d), (h * d, e), (e, f), (e, f), (f, e)]
    weights = [[rnd(a, b) for a, b in widths] for _ in range(n)]
    acts = {a: rnd(m, a) for a in {a for a, _ in widths}}
    grads = {b: rnd(m, b) for b in {b for _, b in widths}}
    # Attention's operands differ per layer (XLA would compute identical einsums once):
    # q, k, v, dO [B*H, T, D]; P, dS [B*H, T, T] (k and v repeated per query head).
    heads = [
        [rnd(batch * h, length, d) for _ in range(4)]
        + [rnd(batch * h, length, length) for _ in range(2)]
        for _ in range(n)
    ]
    embed, x_last, g_logits = rnd(e, v), rnd(m, e), rnd(m, v)

    @jax.jit
    def gemms(weights, acts, grads, heads, embed, x_last, g_logits):
        out = []
        for layer, (q, kk, vv, do, probs, dscores) in zip(weights, heads, strict=True):
            for w, (a, b) in zip(layer, widths, strict=True):
                out += [acts[a] @ w, grads[b] @ w.T, acts[a].T @ grads[b]]
            out += [
                jnp.einsum("btd,bsd->bts", q, kk),  # S = Q K^T
                jnp.einsum("bts,bsd->btd", probs, vv),  # O = P V
                jnp.einsum("btd,bsd->bts", do, vv),  # dP = dO V^T
                jnp.einsum("bts,btd->bsd", probs, do),  # dV = P^T dO
                jnp.einsum("bts,bsd->btd", dscores, kk),  # dQ = dS K
                jnp.einsum("bts,btd->bsd", dscores, q),  # dK = dS^T Q
            ]
        out += [x_last @ embed, g_logits @ embed.T, x_last.T @ g_logits]
        return out

    args = (weights, acts, grads, heads, embed, x_last, g_logits)
    return _best_time(lambda: jax.block_until_ready(gemms(*args)), repeats)


def decode_step_time(pre, batch: int, steps: int, prompt: int = 64, cache_len: int = 512):
    """Seconds of one greedy decode step of the engine's decoder at `batch` (every slot
    active), after a `prompt`-token prefill into a `cache_len`-long cache."""
    cfg = pre.cfg
    platform = jax.devices()[0].platform
    engine_cfg = EngineConfig()
    attention = engine_cfg.attention(platform)
    options = dict(engine_cfg.decode_compiler_options(platform, cfg.hidden_size)) or None
    weights = jax.jit(lambda p: decoder.from_training_layout(pre.graphdef, p, cfg))(pre.params)

    @jax.jit
    def prefill(weights, tokens):
        cache = decoder.init_cache(cfg, batch, cache_len)
        lengths = jnp.full((batch,), prompt, jnp.int32)
        model = decoder.GenModel(weights, cfg)
        return model.prefill(tokens, lengths, cache, jnp.arange(batch))[:2]

    @jax.jit(donate_argnums=2, compiler_options=options)
    def step(weights, tok_B, cache):
        model = decoder.GenModel(weights, cfg, attention)
        logits, cache, _ = model.decode(tok_B, cache, jnp.ones(tok_B.shape, bool))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    tokens = jax.random.randint(jax.random.key(3), (batch, prompt), 0, cfg.vocab_size)
    logits, cache = prefill(weights, tokens)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tok, cache = step(weights, tok, cache)  # compile
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(steps):  # each step depends on the last: a true sequential decode
        tok, cache = step(weights, tok, cache)
    jax.block_until_ready(tok)  # deliberate sync: end of the timed region
    return (time.perf_counter() - t0) / steps


def main(argv) -> None:
    del argv
    quick = _QUICK.value
    path = _MODEL.value or smollm2_gguf_path()
    t0 = time.perf_counter()
    overrides = {} if _CAUSAL_BLOCK.value is None else {"causal_block": _CAUSAL_BLOCK.value}
    pre = _shape_model(path, overrides) if path in SHAPES else load_pretrained(path, **overrides)
    load_s = time.perf_counter() - t0
    cfg = pre.cfg
    n = 2048
    peak = matmul_peak(n, repeats=3 if quick else 10)
    print(f"matmul peak (f32 {n}^3): {peak / 1e9:.1f} GFLOP/s")

    # The quickstart's micro-batch as the trainer runs it: 2 packed rows of one shared-
    # prompt group each (127 + 8 x 49 = 519 tokens, bucketed to 512 here), and the
    # short rows this bench measured before packing (B=2, T=128) for comparison.
    shapes = [(2, 512), (2, 128)] if quick else [(2, 512), (4, 256), (2, 128)]
    if _TRAIN_SHAPES.value:
        shapes = [tuple(int(x) for x in s.split("x")) for s in _TRAIN_SHAPES.value]
    train = {}
    for batch, length in shapes:
        train_s = train_step_time(pre, batch, length, repeats=2 if quick else 5)
        train[(batch, length)] = (train_s, 3 * cfg.flops_per_token(length // 2) * batch * length)
    batch, length = shapes[0]
    floor_s = matmul_floor_time(cfg, batch, length, repeats=2 if quick else 5)
    # Re-measure the peak after the train steps and keep the best: on a shared machine
    # a single measurement under someone else's load understates it.
    peak = max(peak, matmul_peak(n, repeats=3 if quick else 10))
    for (batch, length), (train_s, flops) in train.items():
        print(
            f"train fwd+bwd B={batch} T={length}: {train_s * 1e3:.0f} ms/step, "
            f"{batch * length / train_s:.0f} tokens/s, {flops / train_s / 1e9:.1f} GFLOP/s "
            f"({flops / train_s / peak:.1%} of the {peak / 1e9:.1f} GFLOP/s peak)"
        )
    batch, length = shapes[0]
    train_s, flops = train[shapes[0]]
    train_flops = flops / train_s
    print(
        f"matmul floor B={batch} T={length}: {floor_s * 1e3:.0f} ms "
        f"({flops / floor_s / peak:.1%} of peak: the ceiling), "
        f"the train step is {train_s / floor_s:.2f}x it"
    )
    steps = 10 if quick else 50
    decode_b1 = decode_step_time(pre, 1, steps)
    decode_b8 = decode_step_time(pre, 8, steps)
    print(f"decode step: batch 1 {decode_b1 * 1e3:.1f} ms, batch 8 {decode_b8 * 1e3:.1f} ms")
    result = {
        "model": path.rsplit("/", 1)[-1],
        "params": cfg.num_params(),
        "load_s": round(load_s, 1),
        "machine": f"{platform.processor() or platform.machine()} x{jax.device_count()} "
        f"{jax.devices()[0].platform}",
        "matmul_peak_gflops": round(peak / 1e9, 2),
        "train_batch": batch,
        "train_seq_len": length,
        "train_tokens_per_s": round(batch * length / train_s, 1),
        "train_gflops": round(train_flops / 1e9, 2),
        "train_flops_fraction_of_peak": round(train_flops / peak, 4),
        "matmul_floor_ms": round(floor_s * 1e3, 1),
        "matmul_floor_fraction_of_peak": round(flops / floor_s / peak, 4),
        "train_over_matmul_floor": round(train_s / floor_s, 3),
        "fraction_of_peak_by_shape": {
            f"B{b}xT{t}": round(f / s / peak, 4) for (b, t), (s, f) in train.items()
        },
        "decode_step_ms": round(decode_b1 * 1e3, 2),
        "decode_step_ms_b8": round(decode_b8 * 1e3, 2),
        "decode_tokens_per_s_b8": round(8 / decode_b8, 1),
        "quick": quick,
        "causal_block": cfg.causal_block,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        # Other processes' load inflates every time above; report it with the numbers.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    from streamrl_jax.launch import reexec_with_malloc_hugepages

    reexec_with_malloc_hugepages()  # the allocator the trainer runs with (docs/trainer.md)
    app.run(main)
