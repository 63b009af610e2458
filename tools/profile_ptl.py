"""Per-token decode latency PTL(BS) of the generation engine, for skew-aware dispatch.

For each batch size BS an engine with BS slots decodes BS requests whose lengths are
forced long enough that every slot stays busy; after `--warmup` chunks (compilation,
prefill) the wall time of `--chunks` decode chunks is divided by the chunk's steps:

    PTL(BS) = median over chunks of (chunk wall time / chunk_steps)   [seconds per step]

Every slot emits one token per step, so PTL is the latency each sample sees per token at
that batch size (the paper's Fig. 7 curve). Writes JSON read by
`scheduling.dispatch.PTLProfile.from_json`:

    {"model": "tiny", "batch_sizes": [1, 2, 4, 8], "per_token_s": [...],
     "chunk_steps": 8, "max_total_length": 256, "device": "cpu", "per_chunk_s": {...}}

    python tools/profile_ptl.py --out=/tmp/ptl_tiny.json
    python tools/profile_ptl.py --model=smollm2 --batch_sizes=1,4,16 --out=/tmp/ptl_smol.json
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.model.loader import single_device_mesh

FLAGS = flags.FLAGS


def load_model(name: str):
    """(graphdef, params, ModelConfig) of the tiny random model or SmolLM2-135M."""
    if name == "smollm2":
        from streamrl_jax.model.defaults import smollm2_gguf_path
        from streamrl_jax.model.loader import load_pretrained

        pre = load_pretrained(smollm2_gguf_path(), mesh=single_device_mesh())
        return pre.graphdef, pre.params, pre.cfg
    cfg = model_config.tiny(max_position_embeddings=1024)
    graphdef, params = nnx.split(llama.Llama(cfg, rngs=nnx.Rngs(params=0)))
    return graphdef, params, cfg


def measure_ptl(
    graphdef,
    params,
    cfg,
    batch_sizes: list[int],
    *,
    chunk_steps: int = 8,
    chunks: int = 6,
    warmup: int = 2,
    max_total_length: int = 256,
    stat: str = "median",
) -> dict:
    """Measures PTL(BS) for each batch size; returns the profile dict (see module doc).

    `stat` reduces the chunk times: "median", or "min" (on a shared machine other jobs
    only ever add time, so the fastest chunk is the engine's own cost).
    """
    reduce = {"median": np.median, "min": np.min}[stat]
    steps_needed = chunk_steps * (chunks + warmup + 1)
    if steps_needed + 8 > max_total_length:
        raise ValueError(
            f"--max_total_length {max_total_length} is too short for {chunks + warmup} chunks "
            f"of {chunk_steps} steps"
        )
    per_token, per_chunk = [], {}
    for bs in batch_sizes:
        ecfg = EngineConfig(
            num_slots=bs,
            max_prompt_length=16,
            max_total_length=max_total_length,
            chunk_steps=chunk_steps,
            prefill_batch=min(bs, 8),
        )
        engine = Engine(graphdef, params, cfg, ecfg, single_device_mesh())
        engine.submit(
            [
                GenerationRequest(
                    request_id=i,
                    prompt=[1 + i % 7] * 8,
                    max_new_tokens=1,
                    sampling=SamplingParams.greedy(),
                    forced_length=steps_needed,
                )
                for i in range(bs)
            ]
        )
        for _ in range(warmup):
            engine.step()
        times = []
        for _ in range(chunks):
            t0 = time.perf_counter()
            engine.step()  # ends in a device_get: the chunk is complete when it returns
            times.append(time.perf_counter() - t0)
        assert engine.num_running == bs, "a slot finished early; the profile would be wrong"
        per_chunk[str(bs)] = times
        per_token.append(float(reduce(times)) / chunk_steps)
    return {
        "batch_sizes": [int(b) for b in batch_sizes],
        "per_token_s": per_token,
        "chunk_steps": chunk_steps,
        "max_total_length": max_total_length,
        "device": jax.devices()[0].platform,
        "per_chunk_s": per_chunk,
    }


def define_flags() -> None:
    """Flags of the command line (not defined on import: bench_scheduling imports this)."""
    flags.DEFINE_enum("model", "tiny", ["tiny", "smollm2"], "Model to profile.")
    flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16"], "Slot counts to measure.")
    flags.DEFINE_integer("chunk_steps", 8, "Decode steps per host round trip.")
    flags.DEFINE_integer("chunks", 6, "Timed chunks per batch size.")
    flags.DEFINE_integer("warmup", 2, "Untimed chunks per batch size (compile, prefill).")
    flags.DEFINE_integer("max_total_length", 256, "KV-cache length per slot.")
    flags.DEFINE_string("out", "/tmp/ptl_profile.json", "Output JSON path.")


def main(argv):
    del argv
    graphdef, params, cfg = load_model(FLAGS.model)
    sizes = sorted(int(b) for b in FLAGS.batch_sizes)
    prof = measure_ptl(
        graphdef,
        params,
        cfg,
        sizes,
        chunk_steps=FLAGS.chunk_steps,
        chunks=FLAGS.chunks,
        warmup=FLAGS.warmup,
        max_total_length=FLAGS.max_total_length,
    )
    prof["model"] = FLAGS.model
    with open(FLAGS.out, "w", encoding="utf-8") as f:
        json.dump(prof, f, indent=1)
    print(json.dumps({k: prof[k] for k in ("model", "batch_sizes", "per_token_s")}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
