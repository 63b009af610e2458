"""Pod configurations checked by the real compiler: the project's own executables compiled
ahead of time for a TPU topology (or H100 nodes) that is not attached, with their memory
per device.

    pip install "jax[tpu]==$JAX_VERSION"   # libtpu (0.0.42.1 for jax 0.10.2, 0.0.50.1 for
                                            # 0.12.0.1): compile-only TPU devices, offline
    python -m streamrl_podplan.plan --model=qwen3_0.6b_shape --topology=v5p:2x2x1 \
        --train_devices=4 --rows=8 --seq=2048          # one configuration
    python -m streamrl_podplan.plan --model=/path/to/hf_model ...   # a model's config.json
    python -m streamrl_podplan.plan --search ...       # the knobs searched (`search`)
    python -m streamrl_podplan.plan --quick            # a small search, minutes

`--model` is a preset shape (`shapes.SHAPES`), "tiny", or a Hugging Face model directory
or its `config.json` (no weight is read). The devices of `--topology`
(`jax.experimental.topologies.get_topology_desc`) split into a training mesh (the first
`--train_devices`, ("fsdp", "tp") with `--tp`) and generation instances of
`--instance_tp` devices on the rest. On them it compiles the programs of `programs.py`
and reports each (`reports.py`); `--search` searches the knobs and simulates the pod
with the compiled costs (`search.py`). The last line is JSON.

`--report_cache=FILE` keeps every compile's report: a search run again reads what it
compiled before, so a search stopped part way resumes where it stopped. Compiles at
PAPER.md's shapes are long and large on the host: Qwen2.5-7B's trainer at TP 4 for a v6e
took 27 minutes and ~17 GB of host memory on one core, so run one such search at a time
on a machine of 24 GB (two were: the kernel killed one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
from absl import app, flags
from jax.experimental import topologies

from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine_config import GATE_UP_LAYOUTS, KEY_LAYOUTS
from streamrl_jax.model.config import REMAT_POLICIES
from streamrl_podplan import reports, shapes
from streamrl_podplan.programs import Knobs
from streamrl_podplan.search import SIM_HARDWARE, search, sim_model

FLAGS = flags.FLAGS
# Compile-only: no chip is claimed, so processes need not queue on libtpu's lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _knobs_from_flags() -> Knobs:
    """`Knobs` of the flags of the same names (the cost probe's own fields left)."""
    probe = ("layers", "scan_layers", "scan_unroll")  # set by `training_cost`, not by flags
    names = [f.name for f in dataclasses.fields(Knobs) if f.name not in probe]
    return Knobs(**{name: FLAGS[name].value for name in names})


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
                f"streamrl_podplan.plan: no GPU compiler for --topology={name!r} (pip install "
                f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}): "
                f"{str(e).splitlines()[0]}"
            )
        return np.array(topo.devices), reports.HBM_GIB["h100"], "h100"
    chip = chip_config or ("megacore" if family in ("v5p", "v4") else "default")
    try:
        topo = topologies.get_topology_desc(
            topology_name=name, platform="tpu", chip_config_name=chip
        )
    except Exception as e:  # noqa: BLE001  (no libtpu, or a topology it does not know)
        sys.exit(
            f"streamrl_podplan.plan: no TPU compiler for --topology={name!r} "
            f"(pip install 'jax[tpu]=={jax.__version__}' brings libtpu): {str(e).splitlines()[0]}"
        )
    return (
        np.array(topo.devices),
        reports.HBM_GIB.get(family, 0),
        SIM_HARDWARE.get(family, "tpu_v5p"),
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv) -> None:
    del argv
    reports.REPORT_CACHE = pathlib.Path(FLAGS.report_cache) if FLAGS.report_cache else None
    t0 = time.perf_counter()
    settings = QUICK if FLAGS.quick else [(FLAGS.model, FLAGS.topology, {})]
    results = []
    for model, topology, overrides in settings:
        try:  # a model that is none, a config.json the loader refuses, or a MoE to search
            cfg = shapes.model_config(model)  # (the simulator's cost model is dense): refused
            if FLAGS.search or FLAGS.quick:  # before any compile
                sim_model(cfg, model)
        except (ValueError, UserError) as e:
            sys.exit(f"--model={model}: {e}")
        devices, hbm, hw_name = _topology(topology, FLAGS.chip_config)
        n_train = FLAGS.train_devices or len(devices) // 2
        if not 0 < n_train < len(devices) or n_train % FLAGS.tp:
            sys.exit(f"--train_devices={n_train}: 1 .. {len(devices) - 1}, a multiple of --tp")
        knobs = dataclasses.replace(_knobs_from_flags(), model=model, **overrides.get("knobs", {}))
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
            training = reports.plan_training(knobs, devices[:n_train], hbm)
            rest = devices[n_train:]
            generation = reports.plan_generation(knobs, rest[: FLAGS.instance_tp], hbm)
            verdicts = [
                reports.verdict("training", training),
                reports.verdict("generation", generation),
            ]
            for line in verdicts:
                print(line, flush=True)
            result.update({
                "instances": len(rest) // FLAGS.instance_tp,
                "training": training, "generation": generation, "verdicts": verdicts,
                "fits": all(r["fits"] for r in training + generation),
            })  # fmt: skip
        results.append(result)
    print(json.dumps({"tool": "streamrl_podplan.plan", "wall_s": round(time.perf_counter() - t0, 1),
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
        "model",
        "qwen3_0.6b_shape",
        f"A shape ({', '.join(shapes.SHAPES)}), tiny, or a Hugging Face model directory or its "
        "config.json (the user's own model: its shapes, no weights).",
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
    flags.DEFINE_string("remat", "dots_attention", f"model.remat: {REMAT_POLICIES}.")
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
