"""Decode step time vs active count and filled length, with and without decode buckets.

One engine instance of SmolLM2-135M f32 (the packaged GGUF) with `--slots`
KV rows of `--max_total` positions. For each active count a (`--actives`)
and each prompt length (`--prompts`: short, in the smallest length bucket;
long, in the last one), `a` requests with forced long responses are admitted
into the idle engine and `--chunks` steady-state chunks are timed (the first
chunk, which carries the prefill, is not). Both modes run the same requests,
modes alternated per point, best of `--repeats`:

* `full`: `decode_buckets=False`, every slot over the whole cache every step
  (the engine before compaction);
* `bucketed`: the smallest (batch, length) bucket covering the active slots.

It also times the gather/scatter of the compacted chunk: the jitted chunk on
an idle engine (no row active: the loop exits at once) at each bucket vs the
full shape, whose difference is the copy per chunk.

    PYTHONPATH=. python tools/bench_decode_active.py   # ~5 min on 2 quiet cores
    PYTHONPATH=. python tools/bench_decode_active.py --quick

The last line of stdout is JSON: per-step [wall, process CPU] ms per (prompt,
active, mode), the idle chunk ms per bucket and the load average.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_integer("slots", 16, "KV-cache rows (decode batch without compaction).")
flags.DEFINE_integer("max_total", 256, "KV-cache positions.")
flags.DEFINE_integer("chunk_steps", 8, "Decode steps per chunk.")
flags.DEFINE_integer("chunks", 2, "Timed chunks per point.")
flags.DEFINE_integer("repeats", 2, "Alternating repeats per point (best kept).")
flags.DEFINE_list("prompts", ["24", "200"], "Prompt lengths to run.")
flags.DEFINE_list("actives", ["1", "4", "16"], "Active counts to run (<= --slots).")
flags.DEFINE_bool("quick", False, "One repeat, the short prompt only (<= 5 minutes).")


def step_ms(engine: Engine, prompt_len: int, active: int, vocab: int) -> tuple[float, float]:
    """(wall, process CPU) milliseconds per decode step with `active` slots running (steady
    state). On a CPU shared with other jobs the process CPU time is the steadier of the
    two: other jobs stretch wall time, not this process's work."""
    cfg = engine.cfg
    n = cfg.chunk_steps * (FLAGS.chunks + 2)
    rng = np.random.default_rng(prompt_len * 1000 + active)
    reqs = [
        GenerationRequest(
            request_id=i,
            prompt=rng.integers(100, vocab, size=prompt_len).tolist(),
            max_new_tokens=n,
            forced_length=n,
            sampling=SamplingParams.greedy(),
        )
        for i in range(active)
    ]
    engine.submit(reqs)
    engine.step()  # prefill + first chunk
    t, c = time.perf_counter(), time.process_time()
    for _ in range(FLAGS.chunks):
        engine.step()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    engine.run()  # drain
    steps = FLAGS.chunks * cfg.chunk_steps
    return wall / steps * 1e3, cpu / steps * 1e3


def copy_ms(engine: Engine, rows: int, seq: int, reps: int = 5) -> float:
    """Milliseconds of one idle chunk call at shape (rows, seq): gather + scatter + dispatch
    (`Engine.idle_chunk`, which also places the row indices: a few bytes)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        engine.idle_chunk(rows, seq)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv):
    del argv

    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained, single_device_mesh

    mesh = single_device_mesh()
    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    prompts = [int(p) for p in FLAGS.prompts]
    if FLAGS.quick:
        prompts = prompts[:1]
    base = EngineConfig(
        num_slots=FLAGS.slots,
        max_prompt_length=max(prompts),
        max_total_length=FLAGS.max_total,
        chunk_steps=FLAGS.chunk_steps,
        prefill_batch=4,
        min_bucket=min(prompts),
        min_decode_length=64,
    )
    full_cfg = dataclasses.replace(base, decode_buckets=False)
    engines = {
        mode: Engine(pre.graphdef, pre.params, pre.cfg, cfg, mesh)
        for mode, cfg in (("full", full_cfg), ("bucketed", base))
    }
    actives = [int(a) for a in FLAGS.actives]
    results, vocab = {}, pre.cfg.vocab_size
    for p in prompts:
        for a in actives:
            for engine in engines.values():
                step_ms(engine, p, a, vocab)  # warm-up: compiles this point's shapes
            best = {mode: np.array([np.inf, np.inf]) for mode in engines}
            for _ in range(1 if FLAGS.quick else FLAGS.repeats):
                for mode, engine in engines.items():
                    best[mode] = np.minimum(best[mode], step_ms(engine, p, a, vocab))
            results[f"p{p}_a{a}"] = {m: np.round(v, 2).tolist() for m, v in best.items()}
            ratio = best["full"] / best["bucketed"]
            print(
                f"prompt {p:4d} active {a:3d}: ms/step wall (cpu): "
                f"full {best['full'][0]:7.2f} ({best['full'][1]:7.2f})  "
                f"bucketed {best['bucketed'][0]:7.2f} ({best['bucketed'][1]:7.2f})  "
                f"full/bucketed {ratio[0]:.2f}x ({ratio[1]:.2f}x)  "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    bucketed = engines["bucketed"]
    shapes = bucketed.cfg.decode_shapes()
    n = base.chunk_steps * (FLAGS.chunks + 2)
    used = {shapes.pick([0], [p + n])[1] for p in prompts}
    copies = {"full": round(copy_ms(bucketed, base.num_slots, base.max_total_length), 3)}
    for seq in sorted(used):
        for a in actives:
            copies[f"b{a}_s{seq}"] = round(copy_ms(bucketed, a, seq), 3)
    print(f"idle chunk call (gather + scatter + dispatch), ms: {copies}", flush=True)
    out = {
        "bench": "decode_active",
        "slots": base.num_slots,
        "max_total": base.max_total_length,
        "chunk_steps": base.chunk_steps,
        "step_ms": results,
        "idle_chunk_ms": copies,
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
