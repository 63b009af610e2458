"""Pod configurations checked by the real compiler: the project's own executables compiled
ahead of time for a TPU topology that is not attached, with their memory per device.

    pip install "jax[tpu]==0.10.2"   # libtpu 0.0.42.1: compile-only TPU devices, offline
    PYTHONPATH=. python tools/plan_pod.py --model=qwen3_0.6b_shape --topology=v5p:2x2x1 \
        --train_devices=4 --rows=8 --seq=2048          # one configuration
    PYTHONPATH=. python tools/plan_pod.py --search ...   # the knobs searched (`search`)
    PYTHONPATH=. python tools/plan_pod.py --quick        # a small search, minutes

`--report_cache=FILE` keeps every compile's report (keyed by the lowered program, the
device kind and the compiler's versions): a search run again reads what it compiled
before, so a search stopped part way resumes where it stopped. Compiles at PAPER.md's
shapes are long and large on the host: Qwen2.5-7B's trainer at TP 4 for a v6e took 27
minutes and ~17 GB of host memory on one core, so run one such search at a time on a
machine of 24 GB (two were: the kernel killed one).

The devices of `--topology` (`jax.experimental.topologies.get_topology_desc`) split into a
training mesh (the first `--train_devices`, ("fsdp", "tp") with `--tp`) and generation
instances of `--instance_tp` devices on the rest. On them it lowers and compiles, from
ShapeDtypeStructs carrying the roles' shardings (no array is ever made):

* the policy trainer's `accumulate` (one micro-batch of `--rows` x `--seq`, its grads
  into the donated accumulator) and `apply` (AdamW on the accumulated grads): the
  trainer's own shardings, donation, `--remat` policy and `--sequence_parallel`,
  `--dtype` compute over `--param_dtype` master weights;
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
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
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

from streamrl_jax.config import AlgorithmSection
from streamrl_jax.generation import decoder, executables
from streamrl_jax.generation.admission import build_admission
from streamrl_jax.generation.engine_config import GATE_UP_LAYOUTS, KEY_LAYOUTS, EngineConfig
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.scheduling import lengths
from streamrl_jax.trainer import TrainerConfig, make_policy_trainer
from streamrl_jax.trainer.batch import abstract_batch
from streamrl_podplan.shapes import SHAPES
from streamrl_podplan.shapes import model_config as shape_config
from streamrl_podplan.simulation import compiled, hardware, simulator, stages
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.scenario import Scenario

FLAGS = flags.FLAGS
# Compile-only: no chip is claimed, so processes need not queue on libtpu's lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GIB = 1 << 30
# HBM per chip (per device as JAX sees it: v5p and v4 megacore = one device per chip).
# H100 SXM: the 84,942,979,072 bytes its spec declares. XLA:GPU neither refuses a program
# too big for it nor analyses cost: the verdict is the peak against this figure, and the
# search keeps the roofline's own costs (scales of 1).
HBM_GIB = {"v4": 32, "v5p": 95, "v5e": 16, "v5litepod": 16, "v6e": 32, "h100": 79.1}


# "tiny": the tests' two-layer model at TPU tile sizes (every dimension a multiple of 128,
# so that tile padding does not blur a hand count of its bytes).
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=2,
            num_kv_heads=1, head_dim=128)  # fmt: skip


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

    @classmethod
    def from_flags(cls) -> Knobs:
        probe = ("layers", "scan_layers", "scan_unroll")  # set by `training_cost`, not by flags
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in probe]
        return cls(**{name: FLAGS[name].value for name in fields})


def _abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves (arrays or structs) placed by `shardings` (a
    pytree prefix of `tree`)."""

    def place(sharding, subtree):  # a sharding may stand for a whole subtree (a prefix)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree
        )

    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)
    return jax.tree.map(place, shardings, tree, is_leaf=is_sharding)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of `tree`'s ShapeDtypeStructs (each by its sharding)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape)) * x.dtype.itemsize  # a PRNG key type has one too
    return total


_NEEDS = re.compile(r"required for [^(]*\((\d+(?:\.\d+)?)([GMK])\)")
_UNIT = {"G": GIB, "M": 1 << 20, "K": 1 << 10}


def _report(role: str, name: str, lowered: Any, hbm: float, t0: float, inputs: int) -> dict:
    """Compiles `lowered` and reads its memory and cost per device.

    `inputs`: bytes per device of everything passed in. Inputs the program does not read
    are pruned by jit, so they are not among its arguments, yet they occupy the chip all
    the same (the optimizer moments during `accumulate`): `need` counts them on top of the
    compiler's peak, and the verdict is `need` against the HBM."""
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (the compiler's verdict on a program that cannot fit)
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        first = text.splitlines()[0][:400]
        m = _NEEDS.search(first)
        need = float(m.group(1)) * _UNIT[m.group(2)] if m else float("nan")
        print(f"{role:>10s} {name:>12s}: DOES NOT FIT ({first})", flush=True)
        return {"role": role, "executable": name, "fits": False, "error": first,
                "need_gib": round(need / GIB, 3), "hbm_gib": hbm,
                "compile_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    peak = m.peak_memory_in_bytes
    unread = max(0, inputs - m.argument_size_in_bytes)
    need = peak + unread
    out = {
        "role": role,
        "executable": name,
        "compile_s": round(time.perf_counter() - t0, 1),
        "peak_bytes": int(peak),
        "arguments_bytes": int(m.argument_size_in_bytes),
        "unread_bytes": int(unread),
        "need_bytes": int(need),
        "peak_gib": round(peak / GIB, 3),
        "arguments_gib": round(m.argument_size_in_bytes / GIB, 3),
        "unread_inputs_gib": round(unread / GIB, 3),
        "outputs_gib": round(m.output_size_in_bytes / GIB, 3),
        "temporaries_gib": round(m.temp_size_in_bytes / GIB, 3),
        "aliased_gib": round(m.alias_size_in_bytes / GIB, 3),
        "need_gib": round(need / GIB, 3),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "tflops": round(float(cost.get("flops", 0.0)) / 1e12, 3),
        "bytes_accessed_gib": round(float(cost.get("bytes accessed", 0.0)) / GIB, 3),
        "hbm_gib": hbm,
        "fits": need <= hbm * GIB,
        "headroom_gib": round(hbm - need / GIB, 3),
    }
    print(
        f"{role:>10s} {name:>12s}: needs {out['need_gib']:8.2f} GiB of {hbm} (peak "
        f"{out['peak_gib']:.2f}: args {out['arguments_gib']:.2f}, temps "
        f"{out['temporaries_gib']:.2f}; unread inputs {out['unread_inputs_gib']:.2f}), "
        f"{out['tflops']:.2f} TFLOP, compiled in {out['compile_s']} s: "
        f"{'fits' if out['fits'] else 'DOES NOT FIT'}",
        flush=True,
    )
    return out


def verdict(role: str, reports: list[dict]) -> str:
    """One line per role: fits, or which executable needs how much more than the chip has."""
    worst = max(reports, key=lambda r: (not r["fits"], r["need_gib"]))
    need, hbm = worst["need_gib"], worst["hbm_gib"]
    if worst["fits"]:
        return f"{role}: fits ({worst['executable']} needs {need:.2f} GiB of {hbm} GiB)"
    at_least = "at least " if "error" in worst else ""
    return (
        f"{role}: DOES NOT FIT: {worst['executable']} needs {at_least}{need:.2f} GiB of "
        f"{hbm} GiB per device ({at_least}{need - hbm:.2f} GiB over)"
    )


def _model_cfg(k: Knobs, **overrides: Any) -> model_config.ModelConfig:
    """A shape of tools/model_shapes.py, "tiny" (the tests' model) or an HF config.json;
    `k.layers` deep when set, its blocks scanned (`k.scan_unroll` a step) or not by
    `k.scan_layers`."""
    overrides = {**overrides, "scan_layers": k.scan_layers, "scan_unroll": k.scan_unroll}
    if k.model == "tiny":
        cfg = model_config.tiny(**{**TINY, **overrides})
    elif k.model in SHAPES:
        cfg = shape_config(k.model, **overrides)
    else:
        with open(k.model) as f:
            cfg = model_config.from_hf_config(json.load(f), **overrides)
    if k.layers:
        windows = cfg.layer_windows[: k.layers] if cfg.layer_windows else ()
        cfg = dataclasses.replace(cfg, num_layers=k.layers, layer_windows=windows)
    return cfg


def training_cost(
    k: Knobs, devices: np.ndarray, hbm: float, scanned: dict | None = None
) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per device of `accumulate` at the model's full depth.

    XLA's cost analysis counts a loop body once, and the trainer scans its blocks. At an
    even depth the body is read off two compiles of the whole model, scanned with one
    block a step (`scanned`: its report, when the fit check has it) and with two: their
    difference is a block (every block costs the same), carried to the depth. At an odd
    depth, off two shallow compiles with the blocks unrolled (2 and 4 deep; one block
    alone fuses differently at its ends), carried linearly."""
    depth = _model_cfg(k).num_layers
    acc = lambda probe: plan_training(probe, devices, hbm, apply=False)[0]
    cost = lambda r: (r["flops"], r["bytes_accessed"])
    if depth % 2 == 0:
        one = scanned or acc(dataclasses.replace(k, scan_layers=True, scan_unroll=1))
        (f1, b1), (f2, b2) = cost(one), cost(acc(dataclasses.replace(k, scan_unroll=2)))
        return f1 + (f2 - f1) * (depth - 1), b1 + (b2 - b1) * (depth - 1)
    shallow = [acc(dataclasses.replace(k, layers=n, scan_layers=False)) for n in (2, 4)]
    (f2, b2), (f4, b4) = map(cost, shallow)
    return f2 + (f4 - f2) / 2 * (depth - 2), b2 + (b4 - b2) / 2 * (depth - 2)


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


# `--report_cache`: a JSONL file of reports keyed by what was compiled (`_cache_key`), so
# that a search stopped part way (a 7B TP 4 trainer compiles for 10-25 minutes on one core
# for a v6e) resumes without compiling again what it already has.
REPORT_CACHE: pathlib.Path | None = None


def _cache_key(lowered: Any, p: Program, hbm: float) -> str:
    """What decides a report: the lowered program (its shardings and mesh size are in the
    text), the device kind it compiles for, the compiler's versions, the inputs and HBM."""
    leaf = next(x for x in jax.tree.leaves(p.args) if getattr(x, "sharding", None) is not None)
    kind = leaf.sharding.mesh.devices.flat[0].device_kind
    h = hashlib.sha256(lowered.as_text().encode())
    h.update(f"|{kind}|{jax.__version__}|{_libtpu_version()}|{p.inputs}|{hbm}".encode())
    return h.hexdigest()


def _libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _cached(key: str) -> dict | None:
    if REPORT_CACHE is None or not REPORT_CACHE.exists():
        return None
    for line in REPORT_CACHE.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill: the rest still counts
            continue
        if isinstance(entry, dict) and entry.get("key") == key:
            return entry["report"]
    return None


def plan_programs(programs: list[Program], hbm: float) -> list[dict]:
    """Lowers and compiles each program; its report (`_report`) against `hbm` GiB (read
    from `REPORT_CACHE` instead when that program was compiled before)."""
    out = []
    for p in programs:
        t0 = time.perf_counter()
        lowered = p.fn.lower(*p.args, **p.kwargs)
        key = _cache_key(lowered, p, hbm) if REPORT_CACHE is not None else ""
        report = _cached(key) if key else None
        if report is not None:
            print(
                f"{p.role:>10s} {p.name:>12s}: needs {report['need_gib']:8.2f} GiB of {hbm} "
                f"(from {REPORT_CACHE}, compiled in {report['compile_s']} s then)",
                flush=True,
            )
        else:
            report = _report(p.role, p.name, lowered, hbm, t0, p.inputs)
            if key:
                REPORT_CACHE.parent.mkdir(parents=True, exist_ok=True)
                with REPORT_CACHE.open("a") as f:
                    f.write(json.dumps({"key": key, "report": report}) + "\n")
        out.append(report)
    return out


def plan_training(k: Knobs, devices: np.ndarray, hbm: float, apply: bool = True) -> list[dict]:
    """The policy trainer's accumulate and apply (unless not `apply`) on a ("fsdp", "tp")
    mesh of `devices`, compiled and reported."""
    return plan_programs(training_programs(k, devices, apply), hbm)


def plan_generation(k: Knobs, devices: np.ndarray, hbm: float) -> list[dict]:
    """One generation instance's prefill and decode chunk on a ("tp",) mesh of `devices`,
    jitted as `Engine` jits them, compiled and reported."""
    return plan_programs(generation_programs(k, devices), hbm)


def training_programs(k: Knobs, devices: np.ndarray, apply: bool = True) -> list[Program]:
    """The policy trainer's `accumulate` (and `apply`): its own jits, shardings, donation."""
    tp = k.tp
    mesh = Mesh(devices.reshape(len(devices) // tp, tp), ("fsdp", "tp"))
    cfg = _model_cfg(
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
    trainer = make_policy_trainer(cfg, tcfg, mesh)
    seed = jax.ShapeDtypeStruct((), jnp.int32, sharding=trainer.scalar_sharding)
    state = _abstract(jax.eval_shape(trainer._init, seed), trainer.state_shardings)
    acc = _abstract(jax.eval_shape(trainer._init_acc), trainer.acc_shardings)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=trainer.batch_sharding),
        abstract_batch(k.rows, k.seq),
    )
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=trainer.scalar_sharding)
    sp = ", sequence parallel" if k.sequence_parallel else ""
    print(
        f"training: {cfg.num_params() / 1e9:.2f}B parameters on {dict(mesh.shape)}{sp}", flush=True
    )
    resident = bytes_per_device((state, acc))
    inputs = resident + bytes_per_device((batch, scalar))
    out = [Program("training", "accumulate", trainer._accumulate, (state, acc, batch, scalar),
                   {}, inputs)]  # fmt: skip
    if apply:
        out.append(Program("training", "apply", trainer._apply, (state, acc, scalar), {},
                           resident + 4))  # fmt: skip
    return out


def generation_programs(k: Knobs, devices: np.ndarray) -> list[Program]:
    """One generation instance's prefill and decode chunk, as `Engine` jits them."""
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
    weights = _abstract(weights, decoder.weight_shardings(weights, mesh, parts_major))
    init, place = executables.slot_state(
        cfg, ecfg.num_slots, ecfg.max_total_length, ecfg.max_stop_ids,
        ecfg.keys_positions_minor(platform),
    )  # fmt: skip
    state_sh, repl = place(mesh)
    abstract = jax.eval_shape(init)
    state = _abstract(abstract, state_sh)
    prefill, chunk, *_ = executables.jitted(
        cfg, ecfg.chunk_steps, state_sh, repl, (), ecfg.attention(platform),
        gate_up_parts_major=parts_major,
    )  # fmt: skip
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
    resident = bytes_per_device((weights, state))
    return [
        Program("generation", "prefill", prefill, (weights, state, adm), {},
                resident + bytes_per_device(adm)),
        Program("generation", "decode_chunk", chunk, (weights, state, rows),
                {"seq": ecfg.max_total_length}, resident + bytes_per_device(rows)),
    ]  # fmt: skip


# The simulator's hardware presets for the chips plan_pod compiles for.
SIM_HARDWARE = {"v5p": "tpu_v5p", "v5e": "tpu_v5e", "v5litepod": "tpu_v5e", "v6e": "tpu_v6e"}


def sim_model(cfg: model_config.ModelConfig, name: str) -> hardware.Model:
    """The simulator's description of `cfg` (dense shapes)."""
    return hardware.Model(
        name=name, layers=cfg.num_layers, d_model=cfg.hidden_size, n_heads=cfg.num_heads,
        n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, d_ff=cfg.intermediate_size,
        vocab=cfg.vocab_size, tied_embeddings=cfg.tie_embeddings, qkv_bias=cfg.qkv_bias,
    )  # fmt: skip


def _first_fit(candidates, plan) -> tuple[Any, list[dict]] | None:
    """The first of `candidates` whose `plan(candidate)` reports fit in every executable."""
    for c in candidates:
        reports = plan(c)
        if all(r["fits"] for r in reports):
            return c, reports
    return None


def _with_slots(costs: Any, slots: int) -> Any:
    """`costs` (roofline or compiled) for an instance of `slots` slots."""
    if isinstance(costs, compiled.CompiledCosts):
        return dataclasses.replace(costs, base=dataclasses.replace(costs.base, slots=slots))
    return dataclasses.replace(costs, slots=slots)


def _at_most(scenario: Scenario, slots: int, **changes: Any) -> Scenario:
    """`scenario` (with `changes`) at `slots` an instance, or fewer where the simulator's
    own KV count holds fewer."""
    free = dataclasses.replace(scenario, max_batch=None, **changes)
    return dataclasses.replace(free, max_batch=min(slots, free.slots))


def search(base: Knobs, devices: np.ndarray, hbm: float, hw_name: str, s: dict) -> dict:
    """The knob search: for each training TP and micro-batch rows per replica the cheapest
    remat policy that fits, for each instance TP the most KV slots that fit, on the
    compiled split; then every fitting pair simulated (stream_async and colocated,
    `s["algorithm"]`, the paper's length trace) with the compiled costs
    (`simulation.compiled`), each with at most the compiled slots: stream_async with as
    many as the simulator's own KV count holds (`slots`; a compile that fits one more
    than that count is not refused), colocated with the slots the trainer's resident
    state leaves (None where nothing fits beside it); the plan with the shortest
    predicted step."""
    n = len(devices)
    n_train = s["train_devices"]
    train_dev, gen_dev = devices[:n_train], devices[n_train:]
    trains = []
    per_replica = s["rows_per_replica"]
    per_replica = [per_replica] if isinstance(per_replica, int) else list(per_replica)
    for tp in s["tps"]:
        if n_train % tp:
            continue
        for rpr in per_replica:  # micro-batch rows per data replica
            rows = (n_train // tp) * rpr
            knobs = [dataclasses.replace(base, tp=tp, rows=rows, remat=r) for r in s["remats"]]
            got = _first_fit(knobs, lambda k: plan_training(k, train_dev, hbm))
            if got:
                trains.append(got)
    gens = []
    for itp in s["instance_tps"]:
        if itp > len(gen_dev):
            continue
        knobs = [dataclasses.replace(base, instance_tp=itp, slots=x) for x in s["slots"]]
        got = _first_fit(knobs, lambda k: plan_generation(k, gen_dev[: k.instance_tp], hbm))
        if got:
            gens.append(got)
    # The trainer's cost probe last: what fits is known (and printed) before its compiles,
    # the longest of a search.
    analysed = train_dev.flat[0].platform == "tpu" and s.get("train_cost", "probe") == "probe"
    trains = [
        (k, r, training_cost(k, train_dev, hbm, r[0]) if analysed and gens else (0, 0))
        for k, r in trains
    ]
    cfg = _model_cfg(base)
    model = sim_model(cfg, base.model)
    hw = hardware.get_hardware(hw_name)
    # The paper's response lengths, prompts no longer than the compiled ones: a sample
    # (prompt + response) fits the compiled cache, as the simulator's slot check asks.
    trace = lengths.paper_trace(base.max_len - base.max_prompt)
    trace = dataclasses.replace(
        trace, prompt_max=base.max_prompt, prompt_median=min(trace.prompt_median, base.max_prompt)
    )
    plans = []
    for tk, treports, (train_flops, train_bytes) in trains:
        _, app_ = treports
        for gk, greports in gens:
            pre, chunk = greports
            compiled_ = compiled.Compiled(
                decode_flops=chunk["flops"], decode_bytes=chunk["bytes_accessed"],
                prefill_flops=pre["flops"], prefill_bytes=pre["bytes_accessed"],
                train_flops=train_flops, train_bytes=train_bytes,
                apply_bytes=app_["bytes_accessed"], instance_tp=gk.instance_tp,
                slots=gk.slots, max_len=gk.max_len, prefill_batch=gk.prefill_batch,
                max_prompt=gk.max_prompt, train_devices=n_train, rows=tk.rows, seq=tk.seq,
            )  # fmt: skip
            params = CostParams()
            base_costs = stages.RooflineCosts(
                model=model, hw=hw, tp=gk.instance_tp, slots=gk.slots, algorithm=s["algorithm"],
                params=params,
            )  # fmt: skip
            if chunk["flops"]:  # training's may be missing: `--train_cost=roofline`
                costs = compiled.CompiledCosts.from_compiled(base_costs, compiled_)
                scales = {
                    "decode": round(costs.decode_scale, 2),
                    "prefill": round(costs.prefill_scale, 2),
                    "train": round(costs.train_scale, 2) if train_flops else None,
                }
            else:  # no cost analysis (XLA:GPU): the roofline's own costs
                costs, scales = base_costs, None
            try:  # the compile says the slots fit; the simulator's own count may hold fewer
                scenario = Scenario(
                    mode="stream_async", model=model, hw=hw, devices=n, trace=trace,
                    global_batch=s["global_batch"], algorithm=s["algorithm"],
                    gen_tp=gk.instance_tp, split_granularity=s["granularity"],
                    iterations=4, warmup=1,
                    params=dataclasses.replace(params, kv_memory_fraction=1.0),
                )  # fmt: skip
                scenario = _at_most(scenario, gk.slots)
                a = simulator.simulate(scenario, _with_slots(costs, scenario.max_batch))
            except ValueError as e:
                print(f"not simulated (TP {gk.instance_tp} x {gk.slots} slots): {e}", flush=True)
                continue
            try:  # Colocated, the trainer's state stays on the same chips: its instances
                # hold what is left of the compiled slots (the compiled costs' scales apply
                # at any batch: `simulation.compiled`), or nothing fits beside it.
                colo = _at_most(scenario, gk.slots, mode="colocated")
                c = simulator.simulate(colo, _with_slots(costs, colo.max_batch))
            except ValueError as e:
                print(f"colocated not simulated (TP {gk.instance_tp}): {e}", flush=True)
                colo = c = None
            plans.append({
                "train": {"tp": tk.tp, "remat": tk.remat, "rows": tk.rows,
                          "sequence_parallel": tk.sequence_parallel,
                          "need_gib": max(r["need_gib"] for r in treports)},
                "generation": {"instance_tp": gk.instance_tp, "slots": gk.slots,
                               "need_gib": max(r["need_gib"] for r in greports)},
                "scales": scales,
                "compiled": dataclasses.asdict(compiled_) if scales else None,
                "gen_devices": a.gen_devices, "train_devices": a.train_devices,
                "step_s": round(a.iteration_s, 1), "slots": scenario.max_batch,
                "colocated_step_s": None if c is None else round(c.iteration_s, 1),
                "colocated_slots": None if colo is None else colo.max_batch,
                "async_over_colocated": None if c is None
                else round(a.samples_per_s / c.samples_per_s, 2),
            })  # fmt: skip
    best = min(plans, key=lambda p: p["step_s"]) if plans else None
    return {"plans": plans, "chosen": best, "fits": best is not None,
            "training_fits": bool(trains), "generation_fits": bool(gens)}  # fmt: skip


def _topology(name: str, chip_config: str | None) -> tuple[np.ndarray, float, str]:
    """(devices, HBM GiB per device, the simulator's hardware) of a topology name: a TPU
    slice ("v5p:4x4x2", "v6e:8x8") or H100 nodes ("h100:4x8": 4 nodes of 8, compiled
    against `specs/h100_sxm.txtpb` by jax-cuda12-plugin, no GPU needed)."""
    family, _, shape = name.partition(":")
    if family == "h100":
        nodes, _, per_node = shape.partition("x")
        spec = (pathlib.Path(__file__).parent / "specs" / "h100_sxm.txtpb").read_text()
        try:
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=spec, topology=f"1x{int(nodes)}x{int(per_node)}"
            )
        except Exception as e:  # noqa: BLE001  (no CUDA plugin, or a shape it refuses)
            sys.exit(
                f"tools/plan_pod.py: no GPU compiler for --topology={name!r} (pip install "
                f"jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2): {str(e).splitlines()[0]}"
            )
        return np.array(topo.devices), HBM_GIB["h100"], "h100"
    chip = chip_config or ("megacore" if family in ("v5p", "v4") else "default")
    try:
        topo = topologies.get_topology_desc(
            topology_name=name, platform="tpu", chip_config_name=chip
        )
    except Exception as e:  # noqa: BLE001  (no libtpu, or a topology it does not know)
        sys.exit(
            f"tools/plan_pod.py: no TPU compiler for --topology={name!r} "
            f"(pip install 'jax[tpu]==0.10.2' brings libtpu): {str(e).splitlines()[0]}"
        )
    return np.array(topo.devices), HBM_GIB.get(family, 0), SIM_HARDWARE.get(family, "tpu_v5p")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv) -> None:
    del argv
    global REPORT_CACHE
    REPORT_CACHE = pathlib.Path(FLAGS.report_cache) if FLAGS.report_cache else None
    t0 = time.perf_counter()
    settings = QUICK if FLAGS.quick else [(FLAGS.model, FLAGS.topology, {})]
    results = []
    for model, topology, overrides in settings:
        devices, hbm, hw_name = _topology(topology, FLAGS.chip_config)
        n_train = FLAGS.train_devices or len(devices) // 2
        if not 0 < n_train < len(devices) or n_train % FLAGS.tp:
            sys.exit(f"--train_devices={n_train}: 1 .. {len(devices) - 1}, a multiple of --tp")
        knobs = dataclasses.replace(Knobs.from_flags(), model=model, **overrides.get("knobs", {}))
        print(f"== {model} on {topology}: {len(devices)} devices, {n_train} training", flush=True)
        result = {"model": model, "topology": topology, "devices": len(devices),
                  "train_devices": n_train, "hardware": hw_name,
                  "knobs": dataclasses.asdict(knobs)}  # fmt: skip
        if FLAGS.search or FLAGS.quick:
            space = {
                "train_devices": n_train, "tps": _ints(FLAGS.tps), "remats": FLAGS.remats,
                "rows_per_replica": _ints(FLAGS.rows_per_replica),
                "instance_tps": _ints(FLAGS.instance_tps),
                "slots": _ints(FLAGS.slot_options), "global_batch": FLAGS.global_batch,
                "granularity": FLAGS.granularity, "algorithm": FLAGS.algorithm,
                "train_cost": FLAGS.train_cost,
                **overrides.get("space", {}),
            }  # fmt: skip
            result.update(search(knobs, devices, hbm, hw_name, space))
            chosen = result["chosen"]
            print(f"chosen: {json.dumps(chosen)}" if chosen else "chosen: nothing fits", flush=True)
        else:
            training = plan_training(knobs, devices[:n_train], hbm)
            rest = devices[n_train:]
            generation = plan_generation(knobs, rest[: FLAGS.instance_tp], hbm)
            for line in (verdict("training", training), verdict("generation", generation)):
                print(line, flush=True)
            result.update({
                "instances": len(rest) // FLAGS.instance_tp,
                "training": training, "generation": generation,
                "verdicts": [verdict("training", training), verdict("generation", generation)],
                "fits": all(r["fits"] for r in training + generation),
            })  # fmt: skip
        results.append(result)
    print(json.dumps({"tool": "plan_pod", "wall_s": round(time.perf_counter() - t0, 1),
                      "settings": results}))  # fmt: skip


# --quick: one small search that compiles in minutes on a 2-core machine.
QUICK = [("smollm2_shape", "v5p:2x2x1", {
    "knobs": {"seq": 1024, "max_len": 2048, "max_prompt": 256, "chunk_steps": 8},
    "space": {"tps": [1], "remats": ["dots_attention", "full"], "instance_tps": [1],
              "slots": [64], "global_batch": 128, "granularity": 1},
})]  # fmt: skip


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
    flags.DEFINE_bool(
        "sequence_parallel",
        False,
        "model.sequence_parallel: the training residual stream sharded over tp along the "
        "sequence between blocks (activations kept for the backward 1/tp).",
    )
    flags.DEFINE_string("generate_dtype", "bfloat16", "Generation weights and KV cache dtype.")
    flags.DEFINE_integer("slots", 64, "KV slots of a generation instance.")
    flags.DEFINE_integer("max_prompt", 512, "Longest prompt.")
    flags.DEFINE_integer("max_len", 4096, "KV cache length (prompt + response).")
    flags.DEFINE_integer("chunk_steps", 16, "Decode steps per chunk.")
    flags.DEFINE_integer("prefill_batch", 8, "Prompts per prefill call.")
    flags.DEFINE_enum(
        "key_layout", "auto", list(KEY_LAYOUTS), "EngineConfig.key_layout of the KV cache's keys."
    )
    flags.DEFINE_enum(
        "gate_up_layout",
        "auto",
        list(GATE_UP_LAYOUTS),
        "EngineConfig.gate_up_layout of the generation weights.",
    )
    flags.DEFINE_string(
        "report_cache",
        None,
        "A JSONL file of compile reports: programs compiled before are read from it, new "
        "ones appended (a long search resumes where it stopped).",
    )
    flags.DEFINE_bool("search", False, "Search the knobs below instead of one configuration.")
    flags.DEFINE_bool("quick", False, "A small search of a small shape (minutes).")
    flags.DEFINE_string("tps", "1,4", "--search: training TP degrees to try.")
    flags.DEFINE_list(
        "remats",
        ["dots_attention", "minimal", "full"],
        "--search: remat policies, cheapest first (the first that fits wins).",
    )
    flags.DEFINE_string(
        "rows_per_replica",
        "1",
        "--search: micro-batch rows per data replica to try (e.g. 1,2: each a training plan).",
    )
    flags.DEFINE_string("instance_tps", "1,2,4", "--search: devices per generation instance.")
    flags.DEFINE_string(
        "slot_options",
        "256,128,64,32",
        "--search: KV slots per instance, most first (the first that fits wins).",
    )
    flags.DEFINE_enum(
        "train_cost",
        "probe",
        ["probe", "roofline"],
        "--search: the trainer's cost from compiles with 1 and 2 blocks a step (`probe`: "
        "a second whole-model compile, too big for 24 GB of host memory at 7B TP 4 for a "
        "v6e) or the roofline's own (`roofline`; generation's stays compiled).",
    )
    flags.DEFINE_integer("global_batch", 512, "--search: samples per training step (simulated).")
    flags.DEFINE_integer("granularity", None, "--search: device-split step (default: a host).")
    flags.DEFINE_enum(
        "algorithm",
        "grpo",
        ["grpo", "ppo"],
        "--search: the simulated algorithm (PPO: a critic trained as well).",
    )


if __name__ == "__main__":
    _define_flags()
    app.run(main)
