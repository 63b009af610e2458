"""Generation engine benchmark: continuous vs static batching on a long-tail length replay.

Workload: `num_requests` prompts whose response lengths are *forced* to a
trace with the paper's long-tail shape (StreamRL, 20K setting: median ~0.16,
mean ~0.25, P90 ~0.62, P99 ~0.95, max 1.0 of the maximum length), scaled to
`--max_len`. The same requests run on the same engine configuration twice:

* continuous batching: freed slots are refilled at once (`refill=True`);
* static batching (baseline): admit a full batch, wait until every sample of
  it finishes, then admit the next (`refill=False`).

It also times one decode step with every slot active and compares it with the
memory roofline: (weight bytes + KV-cache bytes read per step) / bandwidth,
the bandwidth measured in the same run by a large jitted reduction.

    python tools/bench_generation.py --quick          # <= 5 min on 2 CPU cores
    python tools/bench_generation.py --models=tiny    # tiny random model only

The last line of stdout is JSON with `continuous_over_static` (static makespan /
continuous makespan) and `decode_vs_roofline` (step time / roofline time) of
the headline model (SmolLM2 when it is available, else tiny), plus every
model's details.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import AxisType, Mesh

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Small sizes (<= 5 minutes on 2 CPU cores).")
flags.DEFINE_list("models", ["tiny", "smollm2"], "Models to run: tiny, smollm2.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_integer("chunk_steps", None, "Decode steps per host round trip (default per model).")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (lengths are forced anyway).")
flags.DEFINE_integer("repeats", 2, "Alternating runs per mode (best kept); SmolLM2 --quick uses 1.")
flags.DEFINE_integer("prefill_batch", None, "Prompts per prefill call (default per model).")
flags.DEFINE_list("hf_batches", ["1", "8", "16"], "Batch sizes of the engine-vs-HF comparison.")
flags.DEFINE_bool("hf", True, "Compare SmolLM2 tokens/s with HF transformers `generate`.")
flags.DEFINE_bool(
    "decode_buckets", True, "Decode the active (batch, length) bucket; False: every slot, always."
)

# The HF comparison: greedy, a fixed prompt length and a fixed number of new tokens.
_HF_PROMPT, _HF_NEW, _HF_REPEATS = 24, 64, 2

# Quantile function of the paper's length trace, as fractions of the max length.
_TRACE_Q = np.array([0.0, 0.5, 0.75, 0.9, 0.99, 1.0])
_TRACE_L = np.array([0.01, 0.16, 0.30, 0.625, 0.95, 1.0])


@dataclasses.dataclass(frozen=True)
class Size:
    """One model's workload and engine shape."""

    num_requests: int
    num_slots: int
    max_len: int  # longest forced response (the trace's max)
    max_prompt: int  # prompts are max_prompt // 2 .. max_prompt tokens, one bucket
    chunk_steps: int
    prefill_batch: int


# On this CPU a SmolLM2 prefill call costs about one decode step whatever its
# batch (weight-read bound), so it prefills in batches of 4; the tiny model is
# dispatch bound and prefills one prompt per call.
_SIZES = {
    ("tiny", True): Size(128, 16, 256, 32, 8, 1),
    ("tiny", False): Size(512, 32, 448, 64, 8, 1),
    ("smollm2", True): Size(48, 8, 64, 8, 4, 4),
    ("smollm2", False): Size(96, 16, 256, 32, 8, 4),
}


def long_tail_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    """n lengths at evenly spaced quantiles of the trace, shuffled; min 1, max max_len."""
    u = (np.arange(n) + 0.5) / n
    lengths = np.interp(u, _TRACE_Q, _TRACE_L) * max_len
    lengths = np.clip(np.round(lengths), 1, max_len).astype(int)
    lengths[-1] = max_len  # the trace's max is reached
    return np.random.default_rng(seed).permutation(lengths)


def make_requests(lengths, max_prompt: int, vocab: int, seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed + 1)
    sampling = SamplingParams(temperature=FLAGS.temperature)
    return [
        GenerationRequest(
            request_id=i,
            prompt=rng.integers(
                0, vocab, size=int(rng.integers(max_prompt // 2, max_prompt + 1))
            ).tolist(),
            max_new_tokens=int(n),
            forced_length=int(n),
            sampling=sampling,
            seed=seed * 100_003 + i,
        )
        for i, n in enumerate(lengths)
    ]


def scheduled_steps(lengths, num_slots: int, chunk: int) -> tuple[int, int]:
    """Decode steps of (static, continuous FIFO) schedules, counted in whole chunks;
    their ratio is what the engine could reach with zero prefill and host cost."""
    static = sum(int(lengths[i : i + num_slots].max()) for i in range(0, len(lengths), num_slots))
    free = [0] * num_slots
    for n in lengths:
        t = heapq.heappop(free) if free else 0
        heapq.heappush(free, t + -(-int(n) // chunk) * chunk)
    return static, max(free)


def measure_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes/s of a jitted full reduction over a large float32 array (best of reps)."""
    x = jax.jit(lambda: jnp.ones((mib * 2**18,), jnp.float32))()
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()  # deliberate sync: timing
        best = min(best, time.perf_counter() - t)
    return x.size * 4 / best


def makespan(engine: Engine, requests) -> tuple[float, int]:
    t = time.perf_counter()
    samples = engine.run(requests)
    elapsed = time.perf_counter() - t
    assert all(
        s.num_tokens == r.forced_length
        for s, r in zip(sorted(samples, key=lambda s: s.request_id), requests, strict=True)
    )
    return elapsed, sum(s.num_tokens for s in samples)


def step_response_length(cfg: EngineConfig, chunks: int) -> int:
    """Forced response length of `decode_step_time`'s requests (they outlast its chunks)."""
    return cfg.chunk_steps * (chunks + 2) + 1


def decode_step_time(engine: Engine, cfg: EngineConfig, vocab: int, chunks: int = 4) -> float:
    """Seconds per decode step with every slot active (steady state, after warm-up)."""
    n = step_response_length(cfg, chunks)
    reqs = make_requests([n] * cfg.num_slots, cfg.max_prompt_length, vocab, seed=7)
    engine.submit(reqs)
    engine.step()  # prefill + first chunk
    t = time.perf_counter()
    for _ in range(chunks):
        engine.step()
    elapsed = time.perf_counter() - t
    engine.run()  # drain
    return elapsed / (chunks * cfg.chunk_steps)


def bench_model(name: str, quick: bool, bandwidth: float) -> dict:
    size = _SIZES[(name, quick)]
    num_requests, num_slots, max_len, max_prompt = (
        size.num_requests,
        size.num_slots,
        size.max_len,
        size.max_prompt,
    )
    mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",), axis_types=(AxisType.Auto,))
    t_load = time.perf_counter()
    if name == "tiny":
        cfg = model_config.tiny(max_position_embeddings=max_prompt + max_len)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(cfg)))
        init = jax.jit(lambda: nnx.state(llama.create(cfg, seed=0)))
        params = init()
        stop_ids: tuple[int, ...] = ()
    else:
        from streamrl_jax.model.defaults import smollm2_gguf_path
        from streamrl_jax.model.loader import load_pretrained

        pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
        cfg, graphdef, params = pre.cfg, pre.graphdef, pre.params
        stop_ids = tuple(cfg.eos_token_ids)
    load_s = time.perf_counter() - t_load
    ecfg = EngineConfig(
        num_slots=num_slots,
        max_prompt_length=max_prompt,
        max_total_length=max_prompt + max_len,
        chunk_steps=FLAGS.chunk_steps or size.chunk_steps,
        prefill_batch=FLAGS.prefill_batch or size.prefill_batch,
        min_bucket=max_prompt,
        stop_ids=stop_ids,
        decode_buckets=FLAGS.decode_buckets,
    )
    lengths = long_tail_lengths(num_requests, max_len, FLAGS.seed)
    requests = make_requests(lengths, max_prompt, cfg.vocab_size, FLAGS.seed)
    continuous = Engine(graphdef, params, cfg, ecfg, mesh)
    static = Engine(graphdef, params, cfg, EngineConfig(**{**ecfg.__dict__, "refill": False}), mesh)
    t = time.perf_counter()
    continuous.run(make_requests([3] * num_slots, max_prompt, cfg.vocab_size, 1))  # compile
    # one request per prompt bucket so every prefill shape is compiled before timing
    continuous.run(
        [GenerationRequest(request_id=b, prompt=[1] * b, max_new_tokens=1) for b in ecfg.buckets()]
    )
    continuous.compile_decode_shapes()  # every (batch, length) bucket, shared with `static`
    compile_s = time.perf_counter() - t
    repeats = 1 if (quick and name == "smollm2") else FLAGS.repeats
    cont_s = static_s = float("inf")
    for _ in range(repeats):  # alternate the modes so machine noise hits both
        c, tokens = makespan(continuous, requests)
        st, _ = makespan(static, requests)
        cont_s, static_s = min(cont_s, c), min(static_s, st)
    ideal_static, ideal_cont = scheduled_steps(lengths, num_slots, ecfg.chunk_steps)
    step_chunks = 2 if quick else 4
    step_s = decode_step_time(continuous, ecfg, cfg.vocab_size, chunks=step_chunks)

    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    cache = continuous._state.cache
    # The step reads its length bucket of every layer's cache (attention is masked inside
    # it); `decode_step_time`'s requests fill at most max_prompt + their response length.
    filled = max_prompt + step_response_length(ecfg, step_chunks)
    _, attended = ecfg.decode_shapes().pick(range(num_slots), [filled])
    kv_bytes = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v))
    kv_bytes = kv_bytes * attended // cache.max_length
    roofline_s = (param_bytes + kv_bytes) / bandwidth
    result = {
        "model": name,
        "num_requests": num_requests,
        "num_slots": num_slots,
        "max_len": max_len,
        "lengths": {
            "median": float(np.median(lengths)),
            "mean": float(np.mean(lengths)),
            "p90": float(np.percentile(lengths, 90)),
            "p99": float(np.percentile(lengths, 99)),
            "max": int(lengths.max()),
        },
        "tokens": tokens,
        "load_s": round(load_s, 2),
        "compile_s": round(compile_s, 2),
        "continuous_makespan_s": round(cont_s, 3),
        "static_makespan_s": round(static_s, 3),
        "continuous_tokens_per_s": round(tokens / cont_s, 1),
        "static_tokens_per_s": round(tokens / static_s, 1),
        "continuous_over_static": round(static_s / cont_s, 3),
        "scheduled_steps_ratio": round(ideal_static / ideal_cont, 3),
        "repeats": repeats,
        "chunk_steps": ecfg.chunk_steps,
        "prefill_batch": ecfg.prefill_batch,
        "decode_step_ms": round(step_s * 1e3, 3),
        "roofline_step_ms": round(roofline_s * 1e3, 3),
        "decode_vs_roofline": round(step_s / roofline_s, 2),
        "param_bytes": int(param_bytes),
        "kv_bytes": int(kv_bytes),
        "attended_length": attended,
        "decode_buckets": ecfg.decode_buckets,
    }
    logging.info("%s: %s", name, result)
    print(
        f"{name:8s} continuous {cont_s:7.2f} s ({tokens / cont_s:8.1f} tok/s)  "
        f"static {static_s:7.2f} s ({tokens / static_s:8.1f} tok/s)  "
        f"ratio {static_s / cont_s:.2f}x  decode step {step_s * 1e3:.2f} ms "
        f"vs roofline {roofline_s * 1e3:.2f} ms ({step_s / roofline_s:.1f}x)",
        flush=True,
    )
    return result


def engine_over_hf(batches: list[int]) -> dict:
    """Tokens/s of the engine over HF transformers `generate` (torch, CPU) on SmolLM2 f32.

    Same process, same weights (both load the packaged GGUF and dequantise it to
    f32), same random prompts of `_HF_PROMPT` tokens, exactly `_HF_NEW` greedy new
    tokens per prompt, all prompts of a batch at once; best of `_HF_REPEATS` after
    a warm-up (compilation) run. Time includes the prefill for both.
    """
    import torch
    import transformers

    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",), axis_types=(AxisType.Auto,))
    pre = load_pretrained(path, mesh=mesh)
    rng = np.random.default_rng(FLAGS.seed + 2)
    # Run right after the engine, torch at 2 threads measured 4-20x slower than alone
    # (XLA:CPU's pool still spinning); at 1 thread it matched its solo b1 speed.
    threads = 1
    torch.set_num_threads(threads)
    out = {}
    for b in batches:
        prompts = rng.integers(100, pre.cfg.vocab_size, size=(b, _HF_PROMPT))
        ecfg = EngineConfig(
            num_slots=b,
            max_prompt_length=_HF_PROMPT,
            max_total_length=_HF_PROMPT + _HF_NEW,
            chunk_steps=16,
            prefill_batch=b,
            min_bucket=_HF_PROMPT,
        )
        engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
        reqs = [
            GenerationRequest(
                request_id=i,
                prompt=p.tolist(),
                max_new_tokens=_HF_NEW,
                forced_length=_HF_NEW,
                sampling=SamplingParams.greedy(),
            )
            for i, p in enumerate(prompts)
        ]
        ids = torch.as_tensor(prompts)

        def run_hf(ids=ids):
            with torch.no_grad():
                return hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=_HF_NEW,
                    min_new_tokens=_HF_NEW,
                    do_sample=False,
                    pad_token_id=0,
                )

        engine.run(reqs)  # compile
        run_hf()  # warm-up
        eng_s = hf_s = float("inf")
        for _ in range(_HF_REPEATS):  # alternate so machine noise hits both
            t = time.perf_counter()
            samples = engine.run(reqs)
            eng_s = min(eng_s, time.perf_counter() - t)
            t = time.perf_counter()
            hf_out = run_hf()
            hf_s = min(hf_s, time.perf_counter() - t)
        ours = np.stack([s.response for s in sorted(samples, key=lambda s: s.request_id)])
        theirs = hf_out[:, _HF_PROMPT:].numpy()
        tokens = b * _HF_NEW
        out[b] = {
            "engine_tokens_per_s": round(tokens / eng_s, 1),
            "hf_tokens_per_s": round(tokens / hf_s, 1),
            "engine_over_hf": round(hf_s / eng_s, 2),
            # Greedy f32 on two stacks: rows agree until a near-tie flips an argmax.
            "same_tokens_fraction": float(np.mean(ours == theirs)),
            "load_avg": round(os.getloadavg()[0], 2),
            "hf_torch_threads": threads,
        }
        print(
            f"batch {b:3d}: engine {tokens / eng_s:7.1f} tok/s  HF {tokens / hf_s:7.1f} tok/s  "
            f"engine/HF {hf_s / eng_s:.2f}x  (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return out


def main(argv):
    del argv
    bandwidth = measure_bandwidth()
    print(f"memory bandwidth (jitted 512 MiB reduction): {bandwidth / 1e9:.2f} GB/s", flush=True)
    results = {}
    for name in FLAGS.models:
        if name not in ("tiny", "smollm2"):
            raise ValueError(f"--models: unknown model {name!r} (tiny, smollm2)")
        try:
            results[name] = bench_model(name, FLAGS.quick, bandwidth)
        except FileNotFoundError as e:  # SmolLM2 GGUF not installed
            logging.warning("skipping %s: %s", name, e)
    versus_hf = {}
    if FLAGS.hf and "smollm2" in results:
        versus_hf = engine_over_hf([int(b) for b in FLAGS.hf_batches])
    head = results.get("smollm2") or results.get("tiny")
    out = {
        "bench": "generation",
        "quick": FLAGS.quick,
        "headline_model": head["model"],
        "continuous_over_static": head["continuous_over_static"],
        "decode_vs_roofline": head["decode_vs_roofline"],
        **{f"engine_over_hf_b{b}": r["engine_over_hf"] for b, r in versus_hf.items()},
        "versus_hf": {str(b): r for b, r in versus_hf.items()},
        "load_avg": round(os.getloadavg()[0], 2),
        "bandwidth_GBps": round(bandwidth / 1e9, 2),
        "models": results,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
