"""Pod configurations checked by the real compiler: the project's own executables compiled
ahead of time for a TPU topology that is not attached, with their memory per device.

First slice of issue 40's plan tool: one configuration per run, no knob search yet.

    pip install "jax[tpu]==0.10.2"   # libtpu 0.0.42.1: compile-only TPU devices, offline
    PYTHONPATH=. python tools/plan_pod.py --model=qwen3_0.6b_shape --topology=v5p:2x2x1 \
        --train_devices=4 --rows=8 --seq=2048

The devices of `--topology` (`jax.experimental.topologies.get_topology_desc`) split into a
training mesh (the first `--train_devices`, ("fsdp", "tp") with `--tp`) and generation
instances of `--instance_tp` devices on the rest. On them it lowers and compiles, from
ShapeDtypeStructs carrying the roles' shardings (no array is ever made):

* the policy trainer's `accumulate` (one micro-batch of `--rows` x `--seq`, its grads
  into the donated accumulator) and `apply` (AdamW on the accumulated grads): the
  trainer's own shardings, donation and `--remat` policy, `--dtype` compute over
  `--param_dtype` master weights;
* one generation instance's prefill (`--prefill_batch` prompts of `--max_prompt`) and
  decode chunk (`--slots` slots, `--chunk_steps` steps, a KV cache of `--max_len`), in
  `--generate_dtype`, exactly as `Engine` jits them (`generation/executables.py`).

Per executable: peak memory per device (`memory_analysis().peak_memory_in_bytes`: what
must fit), its arguments, outputs and temporaries, FLOPs and bytes accessed per device
(`cost_analysis`), compile seconds, and the verdict against the chip's HBM (`HBM_GIB`).
A program that cannot fit fails to compile with RESOURCE_EXHAUSTED: reported as the
verdict with the compiler's message. The last line is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh
from model_shapes import SHAPES  # tools/, beside this file
from model_shapes import model_config as shape_config

from streamrl_jax.config import AlgorithmSection
from streamrl_jax.generation import decoder, executables
from streamrl_jax.generation.admission import build_admission
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.trainer import TrainerConfig, make_policy_trainer
from streamrl_jax.trainer.batch import abstract_batch

FLAGS = flags.FLAGS

GIB = 1 << 30
# HBM per chip (per device as JAX sees it: v5p and v4 megacore = one device per chip).
HBM_GIB = {"v4": 32, "v5p": 95, "v5e": 16, "v5litepod": 16, "v6e": 32}


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One configuration to compile (the flags of the same names)."""

    model: str = "qwen3_0.6b_shape"
    tp: int = 1
    instance_tp: int = 1
    rows: int = 8
    seq: int = 2048
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: str = "dots_attention"
    generate_dtype: str = "bfloat16"
    slots: int = 64
    max_prompt: int = 512
    max_len: int = 4096
    chunk_steps: int = 16
    prefill_batch: int = 8

    @classmethod
    def from_flags(cls) -> Knobs:
        return cls(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(cls)})


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves (arrays or structs) placed by `shardings` (a
    pytree prefix of `tree`)."""

    def place(sharding, subtree):  # a sharding may stand for a whole subtree (a prefix)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree
        )

    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)
    return jax.tree.map(place, shardings, tree, is_leaf=is_sharding)


def _report(name: str, lowered: Any, hbm: float, t0: float) -> dict:
    """Compiles `lowered` and reads its memory and cost per device."""
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (the compiler's verdict on a program that cannot fit)
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        first = text.splitlines()[0][:400]
        print(f"{name:>16s}: DOES NOT FIT ({first})", flush=True)
        return {"executable": name, "fits": False, "error": first}
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    peak = m.peak_memory_in_bytes
    out = {
        "executable": name,
        "compile_s": round(time.perf_counter() - t0, 1),
        "peak_bytes": int(peak),
        "arguments_bytes": int(m.argument_size_in_bytes),
        "peak_gib": round(peak / GIB, 3),
        "arguments_gib": round(m.argument_size_in_bytes / GIB, 3),
        "outputs_gib": round(m.output_size_in_bytes / GIB, 3),
        "temporaries_gib": round(m.temp_size_in_bytes / GIB, 3),
        "aliased_gib": round(m.alias_size_in_bytes / GIB, 3),
        "tflops": round(float(cost.get("flops", 0.0)) / 1e12, 3),
        "bytes_accessed_gib": round(float(cost.get("bytes accessed", 0.0)) / GIB, 3),
        "hbm_gib": hbm,
        "fits": peak <= hbm * GIB,
        "headroom_gib": round(hbm - peak / GIB, 3),
    }
    print(
        f"{name:>16s}: peak {out['peak_gib']:8.2f} GiB of {hbm} (args {out['arguments_gib']:.2f}, "
        f"temps {out['temporaries_gib']:.2f}), {out['tflops']:.2f} TFLOP, "
        f"compiled in {out['compile_s']} s: {'fits' if out['fits'] else 'DOES NOT FIT'}",
        flush=True,
    )
    return out


def _model_cfg(k: Knobs, **overrides: Any) -> model_config.ModelConfig:
    """A shape of tools/model_shapes.py, "tiny" (the tests' model) or an HF config.json."""
    if k.model == "tiny":
        return model_config.tiny(**overrides)
    if k.model in SHAPES:
        return shape_config(k.model, **overrides)
    with open(k.model) as f:
        return model_config.from_hf_config(json.load(f), **overrides)


def plan_training(k: Knobs, devices: np.ndarray, hbm: float) -> list[dict]:
    """The policy trainer's accumulate and apply on a ("fsdp", "tp") mesh of `devices`."""
    tp = k.tp
    mesh = Mesh(devices.reshape(len(devices) // tp, tp), ("fsdp", "tp"))
    cfg = _model_cfg(
        k,
        max_position_embeddings=max(k.seq, k.max_len),
        dtype=k.dtype,
        param_dtype=k.param_dtype,
        remat=k.remat,
    )
    tcfg = TrainerConfig(
        algorithm=AlgorithmSection(), seq_buckets=(k.seq,), batch_buckets=(k.rows,)
    )
    trainer = make_policy_trainer(cfg, tcfg, mesh)
    seed = jax.ShapeDtypeStruct((), jnp.int32, sharding=trainer.scalar_sharding)
    state = _abstract(jax.eval_shape(trainer._init, seed), trainer.state_shardings)
    acc = _abstract(jax.eval_shape(trainer._init_acc), trainer.acc_shardings)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=trainer.batch_sharding),
        abstract_batch(k.rows, k.seq),
    )
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=trainer.scalar_sharding)
    print(f"training: {cfg.num_params() / 1e9:.2f}B parameters on {dict(mesh.shape)}", flush=True)
    out = []
    t0 = time.perf_counter()
    out.append(_report("accumulate", trainer._accumulate.lower(state, acc, batch, scalar), hbm, t0))
    t0 = time.perf_counter()
    out.append(_report("apply", trainer._apply.lower(state, acc, scalar), hbm, t0))
    return out


def plan_generation(k: Knobs, devices: np.ndarray, hbm: float) -> list[dict]:
    """One generation instance's prefill and decode chunk on a ("tp",) mesh of `devices`,
    jitted as `Engine` jits them."""
    mesh = Mesh(devices, ("tp",))
    dt = k.generate_dtype
    cfg = _model_cfg(k, max_position_embeddings=k.max_len, dtype=dt, param_dtype=dt)
    ecfg = EngineConfig(
        num_slots=k.slots,
        max_prompt_length=k.max_prompt,
        max_total_length=k.max_len,
        chunk_steps=k.chunk_steps,
        prefill_batch=k.prefill_batch,
        decode_buckets=False,
    )
    graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.create(cfg)))
    weights = jax.eval_shape(
        lambda p: decoder.from_training_layout(graphdef, p, cfg, ecfg.weight_dtype), params
    )
    weights = _abstract(weights, decoder.weight_shardings(weights, mesh))
    init, place = executables.slot_state(
        cfg, ecfg.num_slots, ecfg.max_total_length, ecfg.max_stop_ids
    )
    state_sh, repl = place(mesh)
    abstract = jax.eval_shape(init)
    state = _abstract(abstract, state_sh)
    platform = devices.flat[0].platform
    prefill, chunk, *_ = executables.jitted(
        cfg, ecfg.chunk_steps, state_sh, repl, (), ecfg.attention(platform)
    )
    adm = build_admission(
        [], ecfg.max_prompt_length, n=ecfg.prefill_batch, num_slots=ecfg.num_slots,
        max_stop_ids=ecfg.max_stop_ids,
    )  # fmt: skip
    adm = _abstract(adm, jax.tree.map(lambda _: repl, adm))
    rows = jax.ShapeDtypeStruct((ecfg.num_slots,), jnp.int32, sharding=repl)
    kv = (
        2
        * cfg.num_layers
        * ecfg.num_slots
        * ecfg.max_total_length
        * cfg.num_kv_heads
        * cfg.head_dim
    )
    print(
        f"generation: instance of {len(devices)} device(s), {ecfg.num_slots} slots x "
        f"{ecfg.max_total_length} positions ({kv * jnp.dtype(dt).itemsize / GIB:.2f} GiB KV)",
        flush=True,
    )
    out = []
    t0 = time.perf_counter()
    out.append(_report("prefill", prefill.lower(weights, state, adm), hbm, t0))
    t0 = time.perf_counter()
    lowered = chunk.lower(weights, state, rows, seq=ecfg.max_total_length)
    out.append(_report("decode_chunk", lowered, hbm, t0))
    return out


def main(argv) -> None:
    del argv
    family = FLAGS.topology.split(":")[0]
    chip = FLAGS.chip_config or ("megacore" if family in ("v5p", "v4") else "default")
    t0 = time.perf_counter()
    try:
        topo = topologies.get_topology_desc(
            topology_name=FLAGS.topology, platform="tpu", chip_config_name=chip
        )
    except Exception as e:  # noqa: BLE001  (no libtpu, or a topology it does not know)
        sys.exit(
            f"tools/plan_pod.py: no TPU compiler for --topology={FLAGS.topology!r} "
            f"(pip install 'jax[tpu]==0.10.2' brings libtpu): {str(e).splitlines()[0]}"
        )
    devices = np.array(topo.devices)
    hbm = HBM_GIB.get(family, 0)
    n_train = FLAGS.train_devices or len(devices) // 2
    if not 0 < n_train < len(devices) or n_train % FLAGS.tp:
        sys.exit(f"--train_devices={n_train}: 1 .. {len(devices) - 1}, a multiple of --tp")
    print(f"{FLAGS.topology}: {len(devices)} devices ({time.perf_counter() - t0:.1f} s)")
    knobs = Knobs.from_flags()
    training = plan_training(knobs, devices[:n_train], hbm)
    rest = devices[n_train:]
    generation = plan_generation(knobs, rest[: FLAGS.instance_tp], hbm)
    result = {
        "tool": "plan_pod",
        "model": FLAGS.model,
        "topology": FLAGS.topology,
        "devices": len(devices),
        "train_devices": n_train,
        "instances": len(rest) // FLAGS.instance_tp,
        "knobs": dataclasses.asdict(knobs),
        "training": training,
        "generation": generation,
        "fits": all(r["fits"] for r in training + generation),
    }  # fmt: skip
    print(json.dumps(result))


def _define_flags() -> None:
    """The flags (defined when run as a tool, not at import: tests import the planners)."""
    flags.DEFINE_string(
        "model", "qwen3_0.6b_shape", f"A shape ({', '.join(SHAPES)}) or an HF config.json."
    )
    flags.DEFINE_string(
        "topology", "v5p:2x2x1", "TPU topology name, e.g. v5p:2x2x1, v5e:4x4, v6e:4x4."
    )
    flags.DEFINE_string(
        "chip_config", None, "chip_config_name (default: megacore on v5p/v4, default elsewhere)."
    )
    flags.DEFINE_integer("train_devices", None, "Devices of the training mesh (default: half).")
    flags.DEFINE_integer("tp", 1, "Tensor parallelism inside the training mesh.")
    flags.DEFINE_integer("instance_tp", 1, "Devices per generation instance.")
    flags.DEFINE_integer(
        "rows", 8, "Rows of a training micro-batch (over the whole training mesh)."
    )
    flags.DEFINE_integer("seq", 2048, "Columns of a training micro-batch.")
    flags.DEFINE_string("dtype", "bfloat16", "Training compute dtype.")
    flags.DEFINE_string("param_dtype", "float32", "Training master-weight dtype.")
    flags.DEFINE_string("remat", "dots_attention", f"model.remat: {model_config.REMAT_POLICIES}.")
    flags.DEFINE_string("generate_dtype", "bfloat16", "Generation weights and KV cache dtype.")
    flags.DEFINE_integer("slots", 64, "KV slots of a generation instance.")
    flags.DEFINE_integer("max_prompt", 512, "Longest prompt.")
    flags.DEFINE_integer("max_len", 4096, "KV cache length (prompt + response).")
    flags.DEFINE_integer("chunk_steps", 16, "Decode steps per chunk.")
    flags.DEFINE_integer("prefill_batch", 8, "Prompts per prefill call.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
