"""Compile reports: each planned program compiled for its devices, its memory and cost per
device read off the compiler, and the verdict against the chip's HBM (`HBM_GIB`).

Per executable: peak memory per device (`memory_analysis().peak_memory_in_bytes`: what
must fit), its arguments, outputs and temporaries, FLOPs and bytes accessed per device
(`cost_analysis`), compile seconds, and the verdict. A program that cannot fit fails to
compile with RESOURCE_EXHAUSTED: reported as the verdict with the compiler's message.

`REPORT_CACHE` (the CLI's `--report_cache`) keeps every compile's report in a JSONL file
keyed by the lowered program, the device kind and the compiler's versions: a search run
again reads what it compiled before, so one stopped part way resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import pathlib
import re
import time
from typing import Any

import jax
import numpy as np

from streamrl_podplan.programs import (
    GIB,
    Knobs,
    Program,
    generation_programs,
    model_config,
    training_programs,
)

# HBM per chip (per device as JAX sees it: v5p and v4 megacore = one device per chip).
# H100 SXM: the 84,942,979,072 bytes its spec declares. XLA:GPU neither refuses a program
# too big for it nor analyses cost: the verdict is the peak against this figure, and the
# search keeps the roofline's own costs (scales of 1).
HBM_GIB = {"v4": 32, "v5p": 95, "v5e": 16, "v5litepod": 16, "v6e": 32, "h100": 79.1}


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
    depth = model_config(k).num_layers
    acc = lambda probe: plan_training(probe, devices, hbm, apply=False)[0]
    cost = lambda r: (r["flops"], r["bytes_accessed"])
    if depth % 2 == 0:
        one = scanned or acc(dataclasses.replace(k, scan_layers=True, scan_unroll=1))
        (f1, b1), (f2, b2) = cost(one), cost(acc(dataclasses.replace(k, scan_unroll=2)))
        return f1 + (f2 - f1) * (depth - 1), b1 + (b2 - b1) * (depth - 1)
    shallow = [acc(dataclasses.replace(k, layers=n, scan_layers=False)) for n in (2, 4)]
    (f2, b2), (f4, b4) = map(cost, shallow)
    return f2 + (f4 - f2) / 2 * (depth - 2), b2 + (b4 - b2) / 2 * (depth - 2)
