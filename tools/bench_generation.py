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
the bandwidth measured in the same run by a large jitted reduction (the higher of a
probe before and one after the timed work).

    python tools/bench_generation.py --quick          # <= 5 min on 2 CPU cores
    python tools/bench_generation.py --models=tiny    # tiny random model only

The last line of stdout is JSON with `continuous_over_static` (static makespan /
continuous makespan), `bucket_cost_bound` (the same ratio from decode cost alone, each
step priced at the measured step time of its decode batch bucket: the ceiling once the
step cost follows the active batch) and `decode_vs_roofline` (step time / roofline time) of
the headline model (SmolLM2 when it is available, else tiny), plus every
model's details.

`--group=G` runs only the shared-prompt prefill benchmark instead (`bench_groups`):
`--groups` prompts x G samples on two engines that differ only in `share_prefill`,
alternated in one process; its JSON line has `shared_prefill_speedup` (prefill
seconds per group, off / on), `shared_prefill_makespan_ratio` (a GRPO-style batch
with long-tail forced lengths, off / on) and `bitwise_equal` (the two engines' samples).

    python tools/bench_generation.py --group=8 --models=smollm2
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.engine_config import CPU_DOTS, DECODE_ATTENTION
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.model.loader import single_device_mesh
from streamrl_podplan.shapes import SHAPES
from streamrl_podplan.shapes import model_config as shape_config

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Small sizes (<= 5 minutes on 2 CPU cores).")
flags.DEFINE_list(
    "models",
    ["tiny", "smollm2"],
    "Models to run: tiny, smollm2 (the shipped GGUF), smollm2_shape / smollm2_1.7b_shape "
    "(SmolLM2-135M's / -1.7B's shapes with random weights: step times without a model file, "
    "e.g. on an accelerator).",
)
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_integer(
    "bandwidth_mib", 512, "Size of the bandwidth probe's array (larger on an accelerator)."
)
flags.DEFINE_integer("chunk_steps", None, "Decode steps per host round trip (default per model).")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (lengths are forced anyway).")
flags.DEFINE_integer("repeats", 2, "Alternating runs per mode (best kept); SmolLM2 --quick uses 1.")
flags.DEFINE_integer("prefill_batch", None, "Prompts per prefill call (default per model).")
flags.DEFINE_list("hf_batches", ["1", "8", "16"], "Batch sizes of the engine-vs-HF comparison.")
flags.DEFINE_bool("hf", True, "Compare SmolLM2 tokens/s with HF transformers `generate`.")
flags.DEFINE_list(
    "roofline_batches",
    [],
    "Without HF: time the last model's decode step against the roofline at these batches.",
)
flags.DEFINE_string("hf_child", None, "Internal: run the HF baseline on these prompts (.npz).")
flags.DEFINE_string(
    "hf_python",
    None,
    "The Python that runs the HF baseline (default: this one). An environment without torch "
    '(Python 3.12 here, docs/first_run.md "JAX versions") names one that has it; that '
    "interpreter imports this checkout through PYTHONPATH, not this one's sys.path.",
)
flags.DEFINE_enum(
    "cpu_dots",
    "auto",
    list(CPU_DOTS),
    "EngineConfig.cpu_dots of every engine (the decode chunk's matmul library on CPU).",
)
flags.DEFINE_enum(
    "decode_attention",
    "auto",
    list(DECODE_ATTENTION),
    "EngineConfig.decode_attention of every engine (elementwise on CPU by default).",
)
flags.DEFINE_bool(
    "makespan",
    True,
    "The continuous-vs-static makespan of each model; False: only the "
    "roofline sweep (--roofline_batches) of the last one.",
)
flags.DEFINE_integer("group", 0, "Run only the shared-prefill benchmark with this group size.")
flags.DEFINE_integer("groups", 8, "--group: prompts per batch.")
flags.DEFINE_integer("group_slots", 16, "--group: engine slots.")
flags.DEFINE_integer("group_prompt", 64, "--group: prompt tokens (one bucket).")
flags.DEFINE_integer("group_max_len", 128, "--group: longest forced response of the GRPO batch.")
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
# Random weights in a real model's shapes (streamrl_podplan/shapes.py).
_SIZES.update({(m, q): _SIZES[("smollm2", q)] for m in SHAPES for q in (True, False)})
_MODELS = ("tiny", "smollm2", *SHAPES)


def long_tail_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    """n lengths at evenly spaced quantiles of the trace, shuffled; min 1, max max_len."""
    u = (np.arange(n) + 0.5) / n
    lengths = np.interp(u, _TRACE_Q, _TRACE_L) * max_len
    lengths = np.clip(np.round(lengths), 1, max_len).astype(int)
    lengths[-1] = max_len  # the trace's max is reached
    return np.random.default_rng(seed).permutation(lengths)


def make_requests(
    lengths, max_prompt: int, vocab: int, seed: int, greedy: bool = False
) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed + 1)
    sampling = SamplingParams.greedy() if greedy else SamplingParams(temperature=FLAGS.temperature)
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


def bucket_cost_bound(lengths, num_slots: int, chunk: int, step_s: dict[int, float]) -> float:
    """continuous_over_static from decode cost alone: the static and continuous (refill at
    chunk boundaries, FIFO) schedules of `lengths`, each step priced at `step_s` of the
    batch bucket covering its running slots (no prefill or host cost). With a constant
    step cost this is `scheduled_steps`' ratio; with decode buckets the static batch's
    long tail runs at small-batch cost, which lowers it."""
    buckets = sorted(step_s)

    def cost(running: int) -> float:
        return step_s[next(b for b in buckets if b >= running)] if running else 0.0

    static = 0.0
    for i in range(0, len(lengths), num_slots):
        batch = lengths[i : i + num_slots]
        for t in range(-(-int(batch.max()) // chunk) * chunk):
            static += cost(int(np.sum(batch > t)))
    queue, left, cont = [int(n) for n in lengths], [0] * num_slots, 0.0
    while queue or any(left):
        for k in range(num_slots):
            if not left[k] and queue:
                left[k] = queue.pop(0)
        for _ in range(chunk):
            cont += cost(sum(n > 0 for n in left))
            left = [max(n - 1, 0) for n in left]
    return static / cont


def bucket_step_times(engine: Engine, cfg: EngineConfig, vocab: int) -> dict[int, float]:
    """Seconds per decode step with `b` slots running, for each decode batch bucket b
    (steady state: one chunk after the prefill chunk; greedy)."""
    return {
        b: decode_step_time(engine, cfg, vocab, chunks=1, greedy=True, running=b)
        for b in cfg.decode_shapes().batch_buckets
    }


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


def nbytes(tree) -> int:
    """Bytes of every array in `tree`."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def add_roofline(result: dict, bandwidth: float) -> None:
    """Adds the roofline of `result`'s decode step: (the weight bytes a step must read + the
    KV bytes it attends) / `bandwidth`, and the step (and matmul floor, where measured)
    over it. A mixture of experts' step must read only the experts its tokens were routed
    to (`read_bytes`: `moe_read_bytes`), not all of `param_bytes`."""
    weights = result.get("read_bytes", result["param_bytes"])
    roofline_s = (weights + result["kv_bytes"]) / bandwidth
    result["roofline_step_ms"] = round(roofline_s * 1e3, 3)
    result["decode_vs_roofline"] = round(result["decode_step_ms"] / 1e3 / roofline_s, 2)
    if "dot_floor_ms" in result:
        result["dot_floor_vs_roofline"] = round(result["dot_floor_ms"] / 1e3 / roofline_s, 2)


def moe_read_bytes(engine: Engine, samples) -> dict:
    """The weight bytes a mixture of experts' decode step must read: everything but the
    experts, plus in each layer the experts at least one of the step's tokens went to
    (counted from the samples' recorded routes at the decode positions, where every slot
    decodes in lockstep), averaged over the steps."""
    cfg, layers = engine.model_cfg, engine.weights["layers"]
    experts = ("experts_gate", "experts_up", "experts_down")
    expert_bytes = sum(nbytes([w[name] for name in experts]) for w in layers)
    per_expert = expert_bytes / (cfg.num_layers * cfg.num_experts)
    start = min(len(s.prompt) for s in samples)  # the first decode step's fed position
    stop = min(len(s.prompt) + s.num_tokens - 1 for s in samples)
    routes = np.stack([s.routes[start:stop] for s in samples])  # [B, steps, L, k]
    b, steps, num_layers, k = routes.shape
    per_step = routes.transpose(1, 2, 0, 3).reshape(steps, num_layers, b * k)
    used = np.mean([[len(np.unique(x)) for x in step] for step in per_step])  # per layer
    return {
        "read_bytes": int(nbytes(engine.weights) - expert_bytes + used * per_expert * num_layers),
        "experts_read_per_layer": round(float(used), 2),
        "num_experts": cfg.num_experts,
    }


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


def decode_step_time(
    engine: Engine,
    cfg: EngineConfig,
    vocab: int,
    chunks: int = 4,
    greedy: bool = False,
    running: int | None = None,
    samples: list | None = None,
) -> float:
    """Seconds per decode step with `running` slots active (default every slot; steady
    state, after warm-up), sampling at `--temperature` (or greedy); the requests'
    samples appended to `samples` when given."""
    n = step_response_length(cfg, chunks)
    if n > cfg.max_total_length - cfg.max_prompt_length:
        raise ValueError(f"decode_step_time: {n} steps do not fit the engine's context")
    count = cfg.num_slots if running is None else running
    reqs = make_requests([n] * count, cfg.max_prompt_length, vocab, seed=7, greedy=greedy)
    engine.submit(reqs)
    engine.step()  # prefill + first chunk
    t = time.perf_counter()
    for _ in range(chunks):
        engine.step()
    elapsed = time.perf_counter() - t
    drained = engine.run()  # every request outlasts the timed chunks
    if samples is not None:
        samples.extend(drained)
    return elapsed / (chunks * cfg.chunk_steps)


def bench_model(name: str, quick: bool) -> dict:
    size = _SIZES[(name, quick)]
    num_requests, num_slots, max_len, max_prompt = (
        size.num_requests,
        size.num_slots,
        size.max_len,
        size.max_prompt,
    )
    mesh = single_device_mesh()
    t_load = time.perf_counter()
    cfg, graphdef, params, stop_ids = load_model(name, mesh, max_prompt + max_len)
    load_s = time.perf_counter() - t_load
    ecfg = EngineConfig(
        cpu_dots=FLAGS.cpu_dots,
        decode_attention=FLAGS.decode_attention,
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
    bucket_s = bucket_step_times(continuous, ecfg, cfg.vocab_size)
    bound = bucket_cost_bound(lengths, num_slots, ecfg.chunk_steps, bucket_s)
    step_s = decode_step_time(continuous, ecfg, cfg.vocab_size, chunks=step_chunks)

    param_bytes = nbytes(params)
    cache = continuous.cache
    # The step reads its length bucket of every layer's cache (attention is masked inside
    # it); `decode_step_time`'s requests fill at most max_prompt + their response length.
    filled = max_prompt + step_response_length(ecfg, step_chunks)
    _, attended = ecfg.decode_shapes().pick(range(num_slots), [filled])
    kv_bytes = nbytes((cache.k, cache.v)) * attended // cache.max_length
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
        # the same with each step priced at its batch bucket's measured step time
        "bucket_cost_bound": round(bound, 3),
        "bucket_step_ms": {str(b): round(v * 1e3, 2) for b, v in bucket_s.items()},
        "repeats": repeats,
        "chunk_steps": ecfg.chunk_steps,
        "prefill_batch": ecfg.prefill_batch,
        "decode_step_ms": round(step_s * 1e3, 3),
        "param_bytes": int(param_bytes),
        "kv_bytes": int(kv_bytes),
        "attended_length": attended,
        "decode_buckets": ecfg.decode_buckets,
    }
    logging.info("%s: %s", name, result)
    print(
        f"{name:8s} continuous {cont_s:7.2f} s ({tokens / cont_s:8.1f} tok/s)  "
        f"static {static_s:7.2f} s ({tokens / static_s:8.1f} tok/s)  "
        f"ratio {static_s / cont_s:.2f}x  decode step {step_s * 1e3:.2f} ms",
        flush=True,
    )
    return result


def load_model(name: str, mesh: Mesh, max_total: int):
    """(model config, graphdef, params, stop ids): tiny random, SmolLM2 from its GGUF, or
    a real model's shapes with random weights (streamrl_podplan/shapes.py)."""
    if name == "tiny" or name in SHAPES:
        if name in SHAPES:
            cfg = shape_config(name, max_position_embeddings=max_total)
        else:
            cfg = model_config.tiny(max_position_embeddings=max_total)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(cfg)))
        return cfg, graphdef, jax.jit(lambda: nnx.state(llama.create(cfg, seed=0)))(), ()
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    return pre.cfg, pre.graphdef, pre.params, tuple(pre.cfg.eos_token_ids)


def group_requests(vocab: int, seed: int, lengths=None) -> list[GenerationRequest]:
    """`--groups` fresh random prompts x `--group` seeds, group by group (as
    `data.make_requests`); one token each, or the forced `lengths`."""
    rng = np.random.default_rng([FLAGS.seed, seed])
    out = []
    for g in range(FLAGS.groups):
        prompt = rng.integers(100, vocab, size=FLAGS.group_prompt).tolist()
        for m in range(FLAGS.group):
            n = 1 if lengths is None else int(lengths[g * FLAGS.group + m])
            out.append(
                GenerationRequest(
                    request_id=f"{seed}/{g}/{m}",
                    prompt=prompt,
                    max_new_tokens=n,
                    forced_length=n,
                    sampling=SamplingParams(temperature=1.0),
                    seed=1000 * g + m,
                )
            )
    return out


def bench_groups(name: str) -> dict:
    """Shared-prompt prefill on vs off (two engines of one configuration, alternated).

    Each repeat runs, on each engine, `--groups` x `--group` one-token requests (every
    sample ends at admission: the prefill calls and seconds per group) and then a
    GRPO-style batch of new prompts with long-tail forced lengths (makespan). Every run
    has prompts no engine has seen (a slot keeps serving as a fork source until reused).
    """
    mesh = single_device_mesh()
    max_total = FLAGS.group_prompt + FLAGS.group_max_len
    cfg, graphdef, params, stop_ids = load_model(name, mesh, max_total)
    base = EngineConfig(
        cpu_dots=FLAGS.cpu_dots,
        decode_attention=FLAGS.decode_attention,
        num_slots=FLAGS.group_slots,
        max_prompt_length=FLAGS.group_prompt,
        max_total_length=max_total,
        chunk_steps=FLAGS.chunk_steps or 8,
        prefill_batch=FLAGS.prefill_batch or 4,
        min_bucket=FLAGS.group_prompt,
        stop_ids=stop_ids,
    )
    engines = {
        share: Engine(graphdef, params, cfg, dataclasses.replace(base, share_prefill=share), mesh)
        for share in (False, True)
    }
    lengths = long_tail_lengths(FLAGS.groups * FLAGS.group, FLAGS.group_max_len, FLAGS.seed)
    for e in engines.values():  # compile prefill, fork and chunk
        e.run(group_requests(cfg.vocab_size, 0, lengths=[2] * len(lengths)))
    best = {share: {"prefill_s": float("inf"), "makespan_s": float("inf")} for share in engines}
    keys = ("prefill_calls", "prefill_rows", "forked")
    equal, loads = True, []
    for rep in range(1, FLAGS.repeats + 1):  # alternated so machine noise hits both
        samples = {}
        for share, e in engines.items():
            for kind, reqs in (
                ("prefill_s", group_requests(cfg.vocab_size, 2 * rep)),
                ("makespan_s", group_requests(cfg.vocab_size, 2 * rep + 1, lengths)),
            ):
                before = e.metrics()
                t = time.perf_counter()
                out = e.run(reqs)
                best[share][kind] = min(best[share][kind], time.perf_counter() - t)
                tag = "" if kind == "prefill_s" else "grpo_"
                best[share].update({tag + k: e.metrics()[k] - before[k] for k in keys})
                if tag:
                    samples[share] = {s.request_id: s for s in out}
        a, b = samples[False], samples[True]
        equal &= a.keys() == b.keys() and all(
            np.array_equal(getattr(a[k], f), getattr(b[k], f))
            for k in a
            for f in ("response", "logprobs", "sampling_logprobs")
        )
        loads.append(round(os.getloadavg()[0], 2))
    g = FLAGS.groups
    rows = {
        ("on" if share else "off"): {
            "prefill_calls_per_group": r["prefill_calls"] / g,
            "prefill_rows_per_group": r["prefill_rows"] / g,
            "forked_per_group": r["forked"] / g,
            "prefill_ms_per_group": round(r["prefill_s"] / g * 1e3, 1),
            "grpo_makespan_s": round(r["makespan_s"], 3),
            "grpo_prefill_calls": r["grpo_prefill_calls"],
            "grpo_forked": r["grpo_forked"],
        }
        for share, r in best.items()
    }
    for k, r in rows.items():
        print(f"share_prefill {k:3s}: {r}", flush=True)
    return {
        "bench": "shared_prefill",
        "model": name,
        "group": FLAGS.group,
        "groups": g,
        "slots": FLAGS.group_slots,
        "prompt_len": FLAGS.group_prompt,
        "prefill_batch": base.prefill_batch,
        "max_len": FLAGS.group_max_len,
        "grpo_tokens": int(lengths.sum()),
        "repeats": FLAGS.repeats,
        "shared_prefill_speedup": round(best[False]["prefill_s"] / best[True]["prefill_s"], 3),
        "shared_prefill_makespan_ratio": round(
            best[False]["makespan_s"] / best[True]["makespan_s"], 3
        ),
        "bitwise_equal": bool(equal),
        "compile_count": engines[True].compile_count(),
        "load_avg": loads,
        **rows,
    }


def dot_floor_s(weights: dict, batch: int, options: tuple = (), repeats: int = 5) -> float:
    """Seconds of the decode step's matmuls alone at `batch`: per layer x @ qkv,
    x @ o, x @ gate_up, x @ down on the engine's own weights, then x @ lm_head, as one
    jitted chain (no attention, norms, sampling or cache). What this backend's GEMM
    takes for the step's weight reads at this batch: the floor the step can reach.
    `options`: the engine's decode compiler options (its matmul library)."""
    e = weights["lm_head"].shape[0]

    def chain(w, x):
        for p in w["layers"]:
            qkv = x @ p["qkv"].reshape(e, -1)
            o = p["o"].reshape(-1, e)  # the heads' width H D (Qwen3, Gemma 3: not E)
            x = x + qkv[:, : o.shape[0]] @ o
            gu = x @ p["gate_up"].reshape(e, -1)
            x = x + gu[:, : gu.shape[1] // 2] @ p["down"]
        return x @ w["lm_head"]

    fn = jax.jit(chain, compiler_options=dict(options) or None)
    x = jnp.full((batch, e), 0.01, jnp.float32)
    fn(weights, x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(weights, x).block_until_ready()  # deliberate sync: timing
        best = min(best, time.perf_counter() - t)
    return best


def _hf_child(spec_path: str) -> None:
    """`--hf_child`: HF `generate` on the prompts in `spec_path`, best of repeats, as JSON.

    A process of its own at torch's default thread count: in the benchmark's process,
    straight after JAX work, torch at 2 threads ran several times slower than alone
    (XLA's pool and torch's contend; docs/benchmarks/generation.md), so an in-process
    baseline would flatter the engine.
    """
    import torch
    import transformers

    from streamrl_jax.model.defaults import smollm2_gguf_path

    spec = np.load(spec_path)
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    out = {"torch_threads": torch.get_num_threads(), "batches": {}}
    for key in sorted(spec.files, key=lambda k: int(k[1:])):
        ids = torch.as_tensor(spec[key])

        def run(ids=ids):
            with torch.no_grad():
                return hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=_HF_NEW,
                    min_new_tokens=_HF_NEW,
                    do_sample=False,
                    pad_token_id=0,
                )

        run()  # warm-up
        best = float("inf")
        for _ in range(_HF_REPEATS):
            t = time.perf_counter()
            gen = run()
            best = min(best, time.perf_counter() - t)
        out["batches"][key[1:]] = {"seconds": best, "tokens": gen[:, ids.shape[1] :].tolist()}
    print("HF_RESULT " + json.dumps(out), flush=True)


def _run_hf_child(prompts: dict[int, np.ndarray]) -> dict:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "prompts.npz")
        np.savez(spec, **{f"b{b}": p for b, p in prompts.items()})
        python = FLAGS.hf_python or sys.executable
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [root] if FLAGS.hf_python else sys.path  # another Python: not our site-packages
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        proc = subprocess.run(
            [python, os.path.abspath(__file__), f"--hf_child={spec}"],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
            check=False,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HF_RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"HF baseline process failed (rc {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1][len("HF_RESULT ") :])


def _batch_engine_config(batch: int) -> EngineConfig:
    """An engine of `batch` slots for `_HF_PROMPT`-token prompts and `_HF_NEW` new tokens,
    prefilled in one call (`engine_over_hf`, `roofline_sweep`)."""
    return EngineConfig(
        cpu_dots=FLAGS.cpu_dots,
        decode_attention=FLAGS.decode_attention,
        num_slots=batch,
        max_prompt_length=_HF_PROMPT,
        max_total_length=_HF_PROMPT + _HF_NEW,
        chunk_steps=16,
        prefill_batch=batch,
        min_bucket=_HF_PROMPT,
    )


def engine_over_hf(batches: list[int]) -> dict:
    """Tokens/s of the engine over HF transformers `generate` (torch, CPU) on SmolLM2 f32,
    and the engine's decode step against the memory roofline at the same batches.

    Same weights (both load the packaged GGUF and dequantise it to f32), same random
    prompts of `_HF_PROMPT` tokens, exactly `_HF_NEW` greedy new tokens per prompt,
    all prompts of a batch at once; time includes the prefill for both. HF runs in a
    process of its own at torch's default threads (`_hf_child`), between the engine's
    two timed rounds, so machine noise hits both; best of `_HF_REPEATS` each, after a
    warm-up (compilation) run.

    The step is timed with every slot active, greedy and at `--temperature`; `main`
    sets it against the roofline (`add_roofline`).
    """
    mesh = single_device_mesh()
    model_cfg, graphdef, params, _ = load_model("smollm2", mesh, _HF_PROMPT + _HF_NEW)
    rng = np.random.default_rng(FLAGS.seed + 2)
    prompts = {b: rng.integers(100, model_cfg.vocab_size, size=(b, _HF_PROMPT)) for b in batches}
    engines, reqs, eng_s, samples = {}, {}, {}, {}
    for b in batches:
        engines[b] = Engine(graphdef, params, model_cfg, _batch_engine_config(b), mesh)
        reqs[b] = [
            GenerationRequest(
                request_id=i,
                prompt=p.tolist(),
                max_new_tokens=_HF_NEW,
                forced_length=_HF_NEW,
                sampling=SamplingParams.greedy(),
            )
            for i, p in enumerate(prompts[b])
        ]
        engines[b].run(reqs[b])  # compile
        eng_s[b] = float("inf")

    def engine_round():
        for b in batches:
            t = time.perf_counter()
            samples[b] = engines[b].run(reqs[b])
            eng_s[b] = min(eng_s[b], time.perf_counter() - t)

    engine_round()
    hf = _run_hf_child(prompts)
    engine_round()
    out = {}
    for b in batches:
        engine, tokens = engines[b], b * _HF_NEW
        hf_s = hf["batches"][str(b)]["seconds"]
        ours = np.stack([s.response for s in sorted(samples[b], key=lambda s: s.request_id)])
        theirs = np.asarray(hf["batches"][str(b)]["tokens"])
        out[b] = {
            "engine_tokens_per_s": round(tokens / eng_s[b], 1),
            "hf_tokens_per_s": round(tokens / hf_s, 1),
            "engine_over_hf": round(hf_s / eng_s[b], 2),
            # Greedy f32 on two stacks: rows agree until a near-tie flips an argmax.
            "same_tokens_fraction": float(np.mean(ours == theirs)),
            "hf_torch_threads": hf["torch_threads"],
            **step_figures(engine, model_cfg.vocab_size, b),
        }
        print(
            f"batch {b:3d}: engine {tokens / eng_s[b]:7.1f} tok/s  HF {tokens / hf_s:7.1f} tok/s"
            f"  engine/HF {hf_s / eng_s[b]:.2f}x  (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return out


def step_figures(engine: Engine, vocab: int, batch: int) -> dict:
    """The decode step of `engine` (every slot active; greedy and sampled), the matmuls
    alone at `batch`, and the bytes a step reads: what `add_roofline` needs."""
    step_s = decode_step_time(engine, engine.cfg, vocab, chunks=1, greedy=True)
    samples: list = []
    sampled_s = decode_step_time(engine, engine.cfg, vocab, chunks=1, samples=samples)
    cache = engine.cache
    out = {
        "decode_step_ms": round(step_s * 1e3, 3),
        "sampled_step_ms": round(sampled_s * 1e3, 3),
        "param_bytes": nbytes(engine.weights),
        "kv_bytes": nbytes((cache.k, cache.v)),
        "load_avg": round(os.getloadavg()[0], 2),
    }
    if engine.model_cfg.num_experts:  # the roofline of the experts the tokens chose
        out.update(moe_read_bytes(engine, samples))
    else:  # the dense matmuls alone (`dot_floor_s` chains the dense layout's weights)
        floor = dot_floor_s(engine.weights, batch, engine.decode_options)
        out["dot_floor_ms"] = round(floor * 1e3, 3)
    return out


def roofline_sweep(name: str, batches: list[int]) -> dict:
    """`--roofline_batches` (no HF): `name`'s decode step at each batch, greedy, every slot
    active, a `_HF_PROMPT`-token prompt and `_HF_NEW` positions of cache, as in
    `engine_over_hf`."""
    mesh = single_device_mesh()
    model_cfg, graphdef, params, _ = load_model(name, mesh, _HF_PROMPT + _HF_NEW)
    out = {}
    for b in batches:
        ecfg = dataclasses.replace(
            _batch_engine_config(b), record_routes=bool(model_cfg.num_experts)
        )
        engine = Engine(graphdef, params, model_cfg, ecfg, mesh)
        out[b] = step_figures(engine, model_cfg.vocab_size, b)
    return out


def main(argv):
    del argv
    if FLAGS.group:
        print(json.dumps(bench_groups(FLAGS.models[-1])))
        return
    if FLAGS.hf_child:
        _hf_child(FLAGS.hf_child)
        return
    probes = [measure_bandwidth(FLAGS.bandwidth_mib)]
    print(
        f"memory bandwidth (jitted {FLAGS.bandwidth_mib} MiB reduction): "
        f"{probes[0] / 1e9:.2f} GB/s",
        flush=True,
    )
    results = {}
    for name in FLAGS.models:
        if name not in _MODELS:
            raise ValueError(f"--models: unknown model {name!r} ({', '.join(_MODELS)})")
        if not FLAGS.makespan:
            continue
        try:
            results[name] = bench_model(name, FLAGS.quick)
        except FileNotFoundError as e:  # SmolLM2 GGUF not installed
            logging.warning("skipping %s: %s", name, e)
    versus_hf = {}
    if FLAGS.hf and "smollm2" in results:
        versus_hf = engine_over_hf([int(b) for b in FLAGS.hf_batches])
    elif FLAGS.roofline_batches:
        versus_hf = roofline_sweep(FLAGS.models[-1], [int(b) for b in FLAGS.roofline_batches])
    # The roofline's denominator: the best of a probe before and one after the timed work
    # (the machine's bandwidth drifts between runs, docs/benchmarks/generation.md "The
    # bandwidth probe bracketed"; the higher reading is the stricter roofline).
    probes.append(measure_bandwidth(FLAGS.bandwidth_mib))
    bandwidth = max(probes)
    print(
        "memory bandwidth probes: "
        + " / ".join(f"{p / 1e9:.2f}" for p in probes)
        + f" GB/s, roofline at {bandwidth / 1e9:.2f}",
        flush=True,
    )
    for r in [*results.values(), *versus_hf.values()]:
        add_roofline(r, bandwidth)
    for b, r in versus_hf.items():
        floor = r.get("dot_floor_vs_roofline")
        experts = r.get("experts_read_per_layer")
        print(
            f"batch {b:3d}: step {r['decode_step_ms']:.1f} ms vs roofline "
            f"{r['roofline_step_ms']:.1f} ms ({r['decode_vs_roofline']:.2f}x"
            + (f"; matmuls alone {floor:.2f}x" if floor is not None else "")
            + (f"; {experts:.1f} of {r['num_experts']} experts a layer" if experts else "")
            + ")",
            flush=True,
        )
    head = next((results[m] for m in reversed(_MODELS) if m in results), {})
    out = {
        "bench": "generation",
        "quick": FLAGS.quick,
        "headline_model": head.get("model", FLAGS.models[-1]),
        "cpu_dots": FLAGS.cpu_dots,
        "decode_attention": FLAGS.decode_attention,
        "continuous_over_static": head.get("continuous_over_static"),
        "bucket_cost_bound": head.get("bucket_cost_bound"),
        "decode_vs_roofline": head.get("decode_vs_roofline"),
        **{
            f"engine_over_hf_b{b}": r["engine_over_hf"]
            for b, r in versus_hf.items()
            if "engine_over_hf" in r
        },
        **{f"decode_vs_roofline_b{b}": r["decode_vs_roofline"] for b, r in versus_hf.items()},
        "versus_hf": {str(b): r for b, r in versus_hf.items()},
        "load_avg": round(os.getloadavg()[0], 2),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "bandwidth_GBps": round(bandwidth / 1e9, 2),
        "bandwidth_probes_GBps": [round(p / 1e9, 2) for p in probes],
        "models": results,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
