"""What a plan compiles: the project's own programs for one configuration (`Knobs`), as
abstract arguments carrying the roles' shardings (no array is ever made).

* The policy trainer's `accumulate` (one micro-batch of `rows` x `seq`, its grads into the
  donated accumulator) and `apply` (AdamW on the accumulated grads), through
  `Trainer.programs`: the trainer's own shardings, donation, `remat` policy and
  `sequence_parallel`, `dtype` compute over `param_dtype` master weights.
* One generation instance's prefill (`prefill_batch` prompts of `max_prompt`) and decode
  chunk (`slots` slots, `chunk_steps` steps, a KV cache of `max_len`), in
  `generate_dtype`, through the engine's public builders (`generation/executables.py`:
  the jits `Engine` holds, its weight layout and slot state).

Each `Program` also counts the bytes per device of everything passed in, which a
compile's own argument size leaves out where jit prunes an input it does not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax.config import AlgorithmSection
from streamrl_jax.generation import decoder, executables
from streamrl_jax.generation.admission import build_admission
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.model import llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.sharding import placed_structs
from streamrl_jax.trainer import TrainerConfig, make_policy_trainer
from streamrl_podplan import shapes

GIB = 1 << 30


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
    sequence_parallel: bool = False
    generate_dtype: str = "bfloat16"
    slots: int = 64
    max_prompt: int = 512
    max_len: int = 4096
    chunk_steps: int = 16
    prefill_batch: int = 8
    key_layout: str = "auto"
    gate_up_layout: str = "auto"
    layers: int = 0  # 0: the model's depth; else a shallower copy (the cost probe)
    scan_layers: bool = True
    scan_unroll: int = 1


@dataclasses.dataclass(frozen=True)
class Program:
    """One executable to compile: `fn` (a jit) on abstract `args` (and static `kwargs`);
    `inputs`: bytes per device of everything passed in."""

    role: str
    name: str
    fn: Any
    args: tuple
    kwargs: dict
    inputs: int


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of `tree`'s ShapeDtypeStructs (each by its sharding)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape)) * x.dtype.itemsize  # a PRNG key type has one too
    return total


def model_config(k: Knobs, **overrides: Any) -> ModelConfig:
    """`k.model` (`shapes.model_config`: a shape, "tiny" or a Hugging Face config.json)
    with `overrides`; `k.layers` deep when set, its blocks scanned (`k.scan_unroll` a
    step) or not by `k.scan_layers`."""
    overrides = {**overrides, "scan_layers": k.scan_layers, "scan_unroll": k.scan_unroll}
    cfg = shapes.model_config(k.model, **overrides)
    if k.layers:
        windows = cfg.layer_windows[: k.layers] if cfg.layer_windows else ()
        cfg = dataclasses.replace(cfg, num_layers=k.layers, layer_windows=windows)
    return cfg


def training_programs(k: Knobs, devices: np.ndarray, apply: bool = True) -> list[Program]:
    """The policy trainer's `accumulate` (and `apply`): its own jits, shardings and
    donation (`Trainer.programs`)."""
    tp = k.tp
    mesh = Mesh(devices.reshape(len(devices) // tp, tp), ("fsdp", "tp"))
    cfg = model_config(
        k,
        max_position_embeddings=max(k.seq, k.max_len),
        dtype=k.dtype,
        param_dtype=k.param_dtype,
        remat=k.remat,
        sequence_parallel=k.sequence_parallel,
    )
    tcfg = TrainerConfig(
        algorithm=AlgorithmSection(), seq_buckets=(k.seq,), batch_buckets=(k.rows,)
    )
    steps = make_policy_trainer(cfg, tcfg, mesh).programs(k.rows, k.seq)
    state, acc, batch, scalar = steps["accumulate"].args
    sp = ", sequence parallel" if k.sequence_parallel else ""
    print(
        f"training: {cfg.num_params() / 1e9:.2f}B parameters on {dict(mesh.shape)}{sp}", flush=True
    )
    resident = bytes_per_device((state, acc))
    inputs = resident + bytes_per_device((batch, scalar))
    out = [Program("training", "accumulate", steps["accumulate"].fn, steps["accumulate"].args,
                   {}, inputs)]  # fmt: skip
    if apply:
        out.append(Program("training", "apply", steps["apply"].fn, steps["apply"].args, {},
                           resident + bytes_per_device(scalar)))  # fmt: skip
    return out


def generation_programs(k: Knobs, devices: np.ndarray) -> list[Program]:
    """One generation instance's prefill and decode chunk, as `Engine` jits them."""
    mesh = Mesh(devices, ("tp",))
    dt = k.generate_dtype
    cfg = model_config(k, max_position_embeddings=k.max_len, dtype=dt, param_dtype=dt)
    ecfg = EngineConfig(
        num_slots=k.slots,
        max_prompt_length=k.max_prompt,
        max_total_length=k.max_len,
        chunk_steps=k.chunk_steps,
        prefill_batch=k.prefill_batch,
        decode_buckets=False,
        key_layout=k.key_layout,
        gate_up_layout=k.gate_up_layout,
    )
    platform = devices.flat[0].platform
    parts_major = ecfg.gate_up_parts_major(platform)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: llama.create(cfg)))
    weights = jax.eval_shape(
        lambda p: decoder.from_training_layout(
            graphdef, p, cfg, ecfg.weight_dtype, gate_up_parts_major=parts_major
        ),
        params,
    )
    weights = placed_structs(weights, decoder.weight_shardings(weights, mesh, parts_major))
    init, place = executables.slot_state(
        cfg, ecfg.num_slots, ecfg.max_total_length, ecfg.max_stop_ids,
        ecfg.keys_positions_minor(platform),
    )  # fmt: skip
    state_sh, repl = place(mesh)
    abstract = jax.eval_shape(init)
    state = placed_structs(abstract, state_sh)
    prefill, chunk, *_ = executables.jitted(
        cfg, ecfg.chunk_steps, state_sh, repl, (), ecfg.attention(platform),
        gate_up_parts_major=parts_major,
    )  # fmt: skip
    adm = build_admission(
        [], ecfg.max_prompt_length, n=ecfg.prefill_batch, num_slots=ecfg.num_slots,
        max_stop_ids=ecfg.max_stop_ids,
    )  # fmt: skip
    adm = placed_structs(adm, jax.tree.map(lambda _: repl, adm))
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
    resident = bytes_per_device((weights, state))
    return [
        Program("generation", "prefill", prefill, (weights, state, adm), {},
                resident + bytes_per_device(adm)),
        Program("generation", "decode_chunk", chunk, (weights, state, rows),
                {"seq": ecfg.max_total_length}, resident + bytes_per_device(rows)),
    ]  # fmt: skip
