"""Pipeline throughput of the four modes and the inflight mode on the length-replay workload.

  python tools/bench_pipeline.py --quick   # tiny model, 5 steps a mode, warm; ~4 min quiet
  python tools/bench_pipeline.py --variant=smollm2 --steps=6
  python tools/bench_pipeline.py --processes            # one process per stage (~9 min)
  python tools/bench_pipeline.py --processes --quick    # the same, smaller (~3.5 min quiet)

`--processes`: the honest CPU stand-in for disaggregated hardware (DESIGN.md
§5). Each disaggregated mode runs as two processes of one `jax.distributed`
program (`launch/local.py -n 2 -g 1 --pin`: the generation process pinned to
core 0, the training process to core 1, docs/multicontroller.md); `colocated`
runs as one process that owns both cores. Every run is a real
`python -m streamrl_jax.launch` (the config's own reward); samples/s come from
its metrics.jsonl, the stage times alone from the two-process
`disaggregated_batch` trace (the stages strictly alternate, each on its own
core), `weight_sync_seconds` is the trainer's mean per-step transfer (cast,
`device_get`, checksums, wire) and `weight_receive_seconds` the generation
side's (wire, checksum, placement). The simulator's prediction is made from this
mode's own profile too (below): here the stages are independent, on separate cores, as
the simulator models them; the "inflight" mode runs as two processes as well.

Steady state by construction (`--processes`): every run sets `pipeline.precompile`,
so everything it meets compiles before its first step (each engine's decode and
prefill shapes; the trainer's micro-batch shapes, planned from the replayed lengths:
pipeline/precompile.py), and the figures leave out the first `--skip` steps (default
1: the pipeline filling) and the last (draining: stream_async's last step only
trains). Each mode reports its measured steps' `compile_s` (0.0 when nothing
compiled mid-run) and `precompile_s` (the trainer's, before its first step). (The
persistent compilation cache cannot do this here: JAX writes it from process 0 only
and the training process is process 1.) The stage times' overlap bound
(`_core_bounds`) counts each stage's work per batch on its own core: the training
process's CPU seconds per step (`process_cpu_s`: receiving and scoring samples
included) when they exceed its trace wall time. The full run: 8 prompts x 4 samples,
responses up to 256 tokens, 6 steps (`--steps`); `--quick`: 16 steps of 4 x 4, up to
128 tokens (the same length distribution), on a generation instance of 4 slots
(QUICK_SLOTS: the batch is 4x the instance's concurrency, so groups complete throughout
the generation window, as in the paper's regime), the four modes (inflight too when
`--modes` names it).

Every mode runs the same config (configs/length_replay.py: forced, paper-shaped
response lengths; same prompts, seeds and model) and differs only in
`pipeline.mode`. Per mode: samples/s over the steps after the first, and the
ratio to `colocated`.

Steady state (`--warm`, on by default in process). New micro-batch shapes compile
mid-run (the trainer's (rows, columns, loss width) buckets and the engine's decode
buckets: each costs many warm micro-batches), and in a few steps a run never stops
meeting new ones: before this flag, most of stream_async's measured seconds were the
trainer compiling (docs/benchmarks/pipeline.md, "Session 9: the trainer's compile time
shown"). So each mode first runs once unmeasured with JAX's persistent compilation cache
under `--workdir/jax_cache` (every executable kept), then again measured: the measured
run reads its executables from the cache. Each mode still reports its steps' `compile_s`
(the trainer thread's tracing, lowering and any compile that missed the cache:
`metrics.compile_seconds`; not zero warm, as every run builds new jitted functions),
`samples_per_s_ex_compile` (that taken out of the wall time) and
`inflight_over_stream_async_ex_compile`; `run_s` and `warm_run_s` are the two runs'
wall times.

Stage times "alone" come from the `disaggregated_batch` run, where the stages
strictly alternate: T_gen = generation wall time of a batch (first chunk to
last chunk of the instance tracks in its step window), T_train = trainer
wall time of a step (micro-batches, optimizer step, weight sync). Their
ideal-overlap bound is N / max(T_gen, T_train) samples/s for a perfectly
overlapped pipeline (N samples per step) and N / (T_gen + T_train) for a
serial one. In one process XLA:CPU runs all devices on one thread pool, so
in-process overlap is small here (DESIGN.md §5); the figures are reported
against the bound, and the process-per-stage figures belong to the
multi-controller benchmark.

Simulator validation (DESIGN.md / issue: pod-scale simulator): from the
`disaggregated_batch` run (stages alone) and the `colocated` run the bench
writes a measured profile, `--workdir/profile.json` (format in
streamrl_podplan/simulation/profiles.py): decode seconds per step and per prefilled
prompt (least squares over the instance's chunk spans), trainer seconds per
token (micro-batch spans / their tokens), optimizer and weight-sync seconds,
the colocated side's scale factors, and the replayed lengths from
samples.jsonl. It then predicts every mode's samples/s with the same
discrete-event schedules the pod simulator uses and reports the relative
error against the measured rates (`sim_rel_error`, `sim_max_abs_rel_error`).
`python -m streamrl_podplan.simulate --profile=DIR/profile.json` re-runs the prediction.

The "inflight" mode: stream_async with `weight_update="inflight"`
and partial rollout (`partial_budget_tokens` = max_new_tokens / 4, `max_lag` = s + 3,
so no sample is dropped); per mode the lag of the trained samples (`lag_mean`,
`lag_max`, the bound `max_lag`) and the idle generation slot-seconds after the first
step (`idle_slot_s`: slots x wall time minus the running slots of every chunk x its
duration; `idle_slot_frac`).

Last line: JSON with `stream_sync_over_colocated`, `stream_async_over_colocated`,
`inflight_over_colocated`, `inflight_over_stream_async`, `max_lag` (the bound),
`lag_mean` / `lag_max` (the inflight run's trained samples),
`async_efficiency_vs_bound` and the per-mode figures. Traces stay in --workdir.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from absl import app, flags

if TYPE_CHECKING:  # this tool imports streamrl_jax inside its functions
    from streamrl_jax.metrics import Span

_CPU = flags.DEFINE_integer("cpu_devices", 2, "Host CPU devices (generation 1 + training 1).")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny model, 5 steps per mode in process, 16 with --processes (<= 5 min)."
)
_VARIANT = flags.DEFINE_string("variant", "tiny", "configs/length_replay.py variant.")
_STEPS = flags.DEFINE_integer("steps", 0, "Steps per mode (0 = config default / quick).")
_MODES = flags.DEFINE_list(
    "modes",
    "colocated,disaggregated_batch,stream_sync,stream_async,inflight",
    "Modes to run ('inflight': stream_async with in-flight weight updates and partial "
    "rollout, INFLIGHT below).",
)
_PROMPTS = flags.DEFINE_integer(
    "prompts_per_step",
    0,
    "Prompts per step (0 = the config's 8; 4 with --processes --quick). Fewer shrink both "
    "stages; at 2 the trainer still dominates (its fixed cost per micro-batch stays; "
    'docs/benchmarks/pipeline.md, "Session 10: steady state in process").',
)
_SLOTS = flags.DEFINE_integer(
    "instance_slots",
    0,
    "Slots of the generation instance (0 = the config's 16; QUICK_SLOTS = 4 with "
    "--processes --quick), to move the stages' balance (decode cost follows the active "
    "batch: 4 slots decode the quick batch about as fast as 16; "
    'BENCHMARKS.md "Pipeline modes, process per stage").',
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_pipeline", "Traces and metrics per mode.")
_SKIP = flags.DEFINE_integer(
    "skip",
    None,
    "--processes: leading steps left out of the figures (default 1: the pipeline filling; "
    "the last step, draining, is always left out).",
)
_WARM = flags.DEFINE_bool(
    "warm",
    True,
    "In process: run every mode once unmeasured first, with JAX's persistent compilation "
    "cache under --workdir/jax_cache, so the measured run reads its executables from the "
    "cache instead of compiling new shapes mid-run (steady state).",
)
_PROCESSES = flags.DEFINE_bool(
    "processes",
    False,
    "One process per stage, each pinned to its own core, against colocated in one "
    "process owning both cores (launch/local.py --pin).",
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The "inflight" mode: stream_async (s = 1) taking new weights at the next chunk boundary,
# with partial rollout in rounds of a quarter of max_new_tokens, so a sample spans at most
# 4 rounds and max_lag = s + 3 never drops one (lengths are forced to <= max_new_tokens).
INFLIGHT_ROUNDS = 4
# --processes --quick: steps per mode; the figures are steps 1 .. QUICK_STEPS - 2.
QUICK_STEPS = 16
# --processes --quick: slots of the generation instance. A batch of 16 samples is then
# 4x what the instance holds at once, as in the paper's regime (a batch far larger than
# the instances' concurrency), so groups complete throughout the generation window
# instead of all near its end (16 slots: one wave; BENCHMARKS.md "Pipeline modes, process
# per stage").
QUICK_SLOTS = 4


def _config(mode: str, steps: int, prompts_per_step: int = 0, max_new_tokens: int = 0):
    from streamrl_jax import config as config_lib

    spec = importlib.util.spec_from_file_location(
        "length_replay", os.path.join(_ROOT, "configs", "length_replay.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config(_VARIANT.value).to_dict()
    cd["pipeline"]["mode"] = mode
    if max_new_tokens:
        cd["generation"]["max_new_tokens"] = max_new_tokens
    if mode == "inflight":
        cd["pipeline"] |= _inflight(cd["generation"]["max_new_tokens"], cd["pipeline"])
    if steps:
        cd["pipeline"]["steps"] = steps
    if prompts_per_step:
        cd["pipeline"]["prompts_per_step"] = prompts_per_step
    if slots := _slots():
        cd["mesh"]["instance_slots"] = (slots,)
    return config_lib.from_config_dict(cd)


def _slots() -> int:
    """The generation instance's slots: `--instance_slots`, else QUICK_SLOTS for
    `--processes --quick`, else 0 (the config's 16)."""
    if _SLOTS.value:
        return _SLOTS.value
    return QUICK_SLOTS if _QUICK.value and _PROCESSES.value else 0


def _inflight(max_new_tokens: int, pipeline: dict) -> dict:
    """The pipeline fields of the "inflight" mode (see INFLIGHT_ROUNDS)."""
    return {
        "mode": "stream_async",
        "weight_update": "inflight",
        "rollout": "partial",
        "partial_budget_tokens": -(-max_new_tokens // INFLIGHT_ROUNDS),
        "max_lag": pipeline.get("staleness", 1) + INFLIGHT_ROUNDS - 1,
    }


def _idle_slots(trace_path: str, slots: int, instances: int) -> dict[str, float]:
    """Idle generation slot-seconds after the first step: every instance's slots times
    the window, minus the running slots of each decode chunk times its duration."""
    sp = _spans(trace_path)
    opt = [s for s in sp.get("trainer", []) if s.name.startswith("step ")]
    chunks = sp.get("generation", [])
    if not opt or not chunks:
        return {}
    t0 = min(min(s.start for s in chunks), min(s.start for s in opt))
    window = max(s.end for s in opt) - t0
    used = sum(s.args.get("running", 0) * s.dur for s in chunks)
    idle = max(instances * slots * window - used, 0.0)
    return {
        "idle_slot_s": round(idle, 2),
        "idle_slot_frac": round(idle / (instances * slots * window), 3),
    }


def _lag(rows: list[dict], bound: int) -> dict[str, float]:
    """The lag of the trained samples (step - oldest token version): mean, max, bound."""
    n = sum(r["samples"] for r in rows)
    mean = sum(r["staleness"] * r["samples"] for r in rows if r["samples"]) / max(n, 1)
    worst = max((r["lag_max"] for r in rows if r["samples"]), default=0.0)
    return {"lag_mean": round(mean, 3), "lag_max": worst, "max_lag": bound}


def _stage_times(trace_path: str, steps: int) -> tuple[float, float]:
    """Mean T_gen and T_train per step (steps >= 1) from a disaggregated_batch trace.

    Step b: its generation runs from the landing of W_b to its first micro-batch
    (first chunk to last chunk of the instance tracks in that window); its training
    is its micro-batches, its optimizer step and the transfer of W_{b+1}.
    """
    from streamrl_jax.metrics import read_trace

    spans = read_trace(trace_path)
    by = lambda group: [s for s in spans if s.group == group]  # noqa: E731
    gen = sorted((s.start, s.end) for s in by("generation"))
    opt = {int(s.name.split()[1]): s for s in by("trainer") if s.name.startswith("step ")}
    sync = {int(s.name[1:]): s for s in by("weight_sync")}
    micro = [s for s in by("trainer") if s.name == "accumulate"]
    t_gen, t_train = [], []
    for b in range(1, steps):
        if b not in opt or b not in sync or b + 1 not in sync:
            continue
        lo, hi = sync[b].end, opt[b].end
        mine = [s for s in micro if opt[b - 1].end < s.start < hi]
        first = min((s.start for s in mine), default=hi)
        g = [(start, end) for start, end in gen if lo <= start < first]
        if g:
            t_gen.append(max(end for _, end in g) - min(start for start, _ in g))
        t_train.append(sum(s.dur for s in mine) + opt[b].dur + sync[b + 1].dur)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return mean(t_gen), mean(t_train)


def _spans(trace_path: str, after_step: int = 1) -> dict[str, list[Span]]:
    """Spans by track group ("generation", "trainer", "weight_sync", ...), keeping only
    those that start after the optimizer span of step `after_step - 1` (the first step
    includes compilation)."""
    from streamrl_jax.metrics import read_trace

    spans = read_trace(trace_path)
    opt = sorted(s.end for s in spans if s.group == "trainer" and s.name.startswith("step "))
    t0 = opt[after_step - 1] if after_step and len(opt) >= after_step else 0.0
    out: dict[str, list[Span]] = {}
    for s in spans:
        if s.start >= t0:
            out.setdefault(s.group, []).append(s)
    return out


def _stage_costs(trace_path: str) -> dict[str, float]:
    """Per-stage unit costs measured in one run's trace (seconds)."""
    import numpy as np

    sp = _spans(trace_path)
    chunks = [s for s in sp.get("generation", []) if s.args.get("steps", 0) > 0]
    steps = np.array([s.args["steps"] for s in chunks], dtype=np.float64)
    pre = np.array([s.args["prefilled"] for s in chunks], dtype=np.float64)
    dur = np.array([s.dur for s in chunks], dtype=np.float64)
    # dur = per_step * steps + per_prefill * prefilled (host overhead folds into per_step).
    coef = np.linalg.lstsq(np.stack([steps, pre], axis=1), dur, rcond=None)[0]
    per_prefill = max(float(coef[1]), 0.0)
    per_step = float((dur.sum() - per_prefill * pre.sum()) / steps.sum())
    micro = [s for s in sp.get("trainer", []) if s.name == "accumulate"]
    opt = [s for s in sp.get("trainer", []) if s.name.startswith("step ")]
    sync = sp.get("weight_sync", [])
    return {
        "per_step_s": per_step,
        "per_prefill_s": per_prefill,
        "train_s_per_token": sum(s.dur for s in micro)
        / max(sum(s.args["tokens"] for s in micro), 1),
        "optimizer_s": sum(s.dur for s in opt) / max(len(opt), 1),
        "weight_sync_s": sum(s.dur for s in sync) / max(len(sync), 1),
    }


def _profile(cfg, workdir: str, measured: dict[str, float]) -> dict:
    """The measured profile of this bench (simulation/profiles.py format)."""
    from streamrl_jax.scheduling.sample_log import read_sample_log

    disagg = _stage_costs(os.path.join(workdir, "disaggregated_batch", "trace.json"))
    coloc = _stage_costs(os.path.join(workdir, "colocated", "trace.json"))
    log = read_sample_log(os.path.join(workdir, "disaggregated_batch", "samples.jsonl"))
    log.sort(key=lambda r: (r.step, r.request_id))
    prompt = [len(r.prompt_tokens) for r in log]
    resp = [r.output_length for r in log]
    p = cfg.pipeline
    n = p.prompts_per_step * p.group_size
    mean_prompt = sum(prompt) / len(prompt)
    slots = cfg.mesh.instance_slots
    return {
        "global_batch": n,
        "iterations": len(log) // n,
        "warmup": 1,
        "gen_instances": len(slots),
        "colocated_instances": len(slots),
        "slots": slots[0],
        "dispatch": "random",
        "decode": {
            # The decode step runs all `slots` rows whatever their occupancy (fixed
            # shapes), so its cost does not depend on the running count.
            "batch_sizes": [1, slots[0]],
            "per_token_s": [disagg["per_step_s"]] * 2,
            "prefill_s_per_token": disagg["per_prefill_s"] / mean_prompt,
            "chunk_steps": cfg.generation.decode_chunk,
        },
        "train": {
            "seconds_per_token": disagg["train_s_per_token"],
            "optimizer_s": disagg["optimizer_s"],
            "min_microbatch_tokens": int(
                p.min_groups * p.group_size * (sum(prompt) + sum(resp)) / len(prompt)
            ),
        },
        "weight_sync_s": disagg["weight_sync_s"],
        # Colocated: the same process owns both devices; its run's own unit costs give
        # the scale, and its weight copy is the train -> generation switch.
        "switch_s": [0.0, coloc["weight_sync_s"]],
        "colocated_scale": {
            "decode": coloc["per_step_s"] / disagg["per_step_s"],
            "train": coloc["train_s_per_token"] / disagg["train_s_per_token"],
        },
        "lengths": {"prompt": prompt, "response": resp},
        "group_size": p.group_size,
        # a group's samples prefill their prompt once (generation/admission.py)
        "share_prefill": cfg.generation.share_prefill,
        # the "inflight" mode's settings (simulation/inflight.py)
        "inflight": {
            "budget_tokens": _inflight(cfg.generation.max_new_tokens, {})["partial_budget_tokens"],
            "staleness": p.staleness,
            # as the bench runs it: INFLIGHT_ROUNDS - 1 more steps, left out with the first
            "iterations": len(log) // n + INFLIGHT_ROUNDS - 1,
            "warmup": INFLIGHT_ROUNDS,
        },
        "measured_samples_per_s": measured,
    }


def _bounds(out: dict, n: int, trace_path: str, steps: int) -> None:
    """Stage times alone (a disaggregated_batch trace) and their overlap / serial bounds."""
    t_gen, t_train = _stage_times(trace_path, steps)
    out["samples_per_step"] = n
    out["t_gen_s"], out["t_train_s"] = round(t_gen, 3), round(t_train, 3)
    out["bound_overlap_sps"] = round(n / max(t_gen, t_train), 4)
    out["bound_serial_sps"] = round(n / (t_gen + t_train), 4)


def _core_bounds(out: dict, n: int, rows: list[dict], receive_s: float) -> None:
    """--processes: the overlap bound from each stage's work per batch on its own core.

    `t_train_s` (trace wall time from the first micro-batch to the end of the weight
    sync) leaves out the training process's share of a batch that runs inside the
    generation window in `disaggregated_batch`: receiving and scoring samples as they
    stream in. Overlapped, that work shares the training core with the trainer. Pinned to
    one core, a process cannot do a step's work in less than its CPU seconds, so the
    training stage alone is `t_train_cpu_s` (`process_cpu_s`, every thread of the
    process, mean over `rows`) when that is the larger, and the generation stage is
    `t_gen_s` plus its weight receive. `bound_overlap_sps` becomes N / max of the two;
    the wall-time bound stays as `bound_overlap_wall_sps`."""
    cpu = sum(r["process_cpu_s"] for r in rows) / len(rows)
    t_gen = out["t_gen_s"] + receive_s
    t_train = max(out["t_train_s"], cpu)
    out["t_train_cpu_s"], out["t_gen_core_s"] = round(cpu, 3), round(t_gen, 3)
    out["bound_overlap_wall_sps"] = out["bound_overlap_sps"]
    out["bound_overlap_sps"] = round(n / max(t_gen, t_train), 4)


def _compile_figures(rows: list[dict]) -> dict:
    """The measured steps' compilation (`compile_s`: the trainer thread's tracing and
    compiling, inside the step's wall time) and samples/s with it taken out of the wall
    time: new micro-batch shapes compile mid-run (seconds each here:
    docs/benchmarks/pipeline.md), which is not steady state. Generation's own compiles
    are not taken out."""
    compile_s = [r.get("compile_s", 0.0) for r in rows]
    wall = sum(r["step_s"] for r in rows) - sum(compile_s)
    samples = sum(r.get("samples", 0.0) for r in rows)
    return {
        "compile_s": [round(c, 2) for c in compile_s],
        "samples_per_s_ex_compile": round(samples / max(wall, 1e-9), 4),
    }


def _ratios(out: dict, per_mode: dict) -> None:
    """Each mode over colocated, and stream_async over the overlap bound."""
    out["modes"] = per_mode
    base = per_mode.get("colocated", {}).get("samples_per_s")
    for mode in ("disaggregated_batch", "stream_sync", "stream_async", "inflight"):
        if base and mode in per_mode:
            out[f"{mode}_over_colocated"] = round(per_mode[mode]["samples_per_s"] / base, 3)
    if "inflight" in per_mode:
        fl = per_mode["inflight"]
        if "stream_async" in per_mode:
            ratio = fl["samples_per_s"] / per_mode["stream_async"]["samples_per_s"]
            out["inflight_over_stream_async"] = round(ratio, 3)
            ex = [per_mode[m].get("samples_per_s_ex_compile") for m in ("inflight", "stream_async")]
            if all(ex):
                out["inflight_over_stream_async_ex_compile"] = round(ex[0] / ex[1], 3)
        # max_lag: the bound; lag_mean / lag_max: what the trained samples had.
        out |= {k: fl[k] for k in ("max_lag", "lag_mean", "lag_max") if k in fl}
    if "bound_overlap_sps" in out and "stream_async" in per_mode:
        async_sps = per_mode["stream_async"]["samples_per_s"]
        out["async_efficiency_vs_bound"] = round(async_sps / out["bound_overlap_sps"], 3)
        if "bound_overlap_wall_sps" in out:
            wall = out["bound_overlap_wall_sps"]
            out["async_efficiency_vs_wall_bound"] = round(async_sps / wall, 3)


def _launch(mode: str, steps: int, workdir: str, overrides: list[str]) -> None:
    """One run of `python -m streamrl_jax.launch`: two pinned processes (generation on
    core 0, training on core 1) for the disaggregated modes, one process for colocated."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl_jax.launch",
        f"--config={os.path.join(_ROOT, 'configs', 'length_replay.py')}:{_VARIANT.value}",
        f"--workdir={workdir}",
        f"--config.pipeline.mode={mode}",
        *overrides,
    ]
    if steps:
        cmd.append(f"--config.pipeline.steps={steps}")
    if mode != "colocated":
        local = [sys.executable, os.path.join(_ROOT, "launch", "local.py")]
        cmd = [*local, "-n", "2", "-g", "1", "--pin", "--timeout_s", "900", "--", *cmd]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        # Runs share programs (all generation processes, all training processes): the
        # persistent cache turns their recompilation into reads. It only shortens the
        # first step, which the figures leave out.
        JAX_COMPILATION_CACHE_DIR=os.path.join(_WORKDIR.value, "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT, timeout=1000)
    if run.returncode:
        print(run.stdout[-4000:], run.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"{mode}: {' '.join(cmd)} exited with {run.returncode}")


def _weight_receive_s(trace_path: str) -> float:
    """Mean generation-side weight arrival (wire + checksum + placement), steps >= 1."""
    spans = _spans(trace_path).get("weight_receive", [])
    return sum(s.dur for s in spans) / max(len(spans), 1)


def _simulate(out: dict, cfg, per_mode: dict) -> None:
    """With colocated and disaggregated_batch measured: writes the measured profile to
    `--workdir/profile.json` and adds the simulator's prediction of every measured mode
    (`sim_predicted_sps`, `sim_rel_error`) to `out`. `cfg`: the runs' shared settings."""
    if not {"colocated", "disaggregated_batch"} <= set(per_mode):
        return
    from streamrl_podplan.simulation import profiles

    profile = _profile(cfg, _WORKDIR.value, {m: v["samples_per_s"] for m, v in per_mode.items()})
    path = os.path.join(_WORKDIR.value, "profile.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f)
    pred = profiles.predict(profile, modes=tuple(per_mode))
    out["sim_predicted_sps"] = {m: round(v, 4) for m, v in pred["predicted_samples_per_s"].items()}
    out["sim_rel_error"] = {m: round(v, 3) for m, v in pred["rel_error"].items()}
    out["sim_max_abs_rel_error"] = round(max(abs(v) for v in pred["rel_error"].values()), 3)
    out["profile"] = path


def _process_mode(mode: str, max_new_tokens: int) -> tuple[str, list[str], int]:
    """A `--processes` mode as launched: `pipeline.mode`, the overrides it adds and the
    steps it fills first. "inflight" is the in-process mode's settings (stream_async,
    `weight_update="inflight"`, partial rollout in INFLIGHT_ROUNDS rounds, `_inflight`),
    which run with one generation and one training process; it runs INFLIGHT_ROUNDS - 1
    more steps and leaves them out, as `main` does."""
    if mode != "inflight":
        return mode, [], 0
    fields = _inflight(max_new_tokens, {})
    overrides = [f"--config.pipeline.{k}={v}" for k, v in fields.items() if k != "mode"]
    return fields["mode"], overrides, INFLIGHT_ROUNDS - 1


def main_processes() -> None:
    """`--processes` (module docstring), the "inflight" mode included (`_process_mode`);
    per disaggregated mode also the lag of the trained samples (`lag_mean`, `lag_max`,
    the bound `max_lag`), `mixed_versions` (the fraction spanning versions) and the idle
    generation slot-seconds, and `inflight_over_stream_async` etc. (`_ratios`)."""
    from streamrl_jax.metrics import read_jsonl
    from streamrl_jax.pipeline.schedules import Schedule

    steps = _STEPS.value or (QUICK_STEPS if _QUICK.value else 0)
    # Quick: every run also pays process start-up and precompiling
    # (docs/benchmarks/pipeline.md, "Session 13: steady state by construction"), so a
    # batch is 4 prompts x 4 samples instead of 8 x 4 with responses up to 128 tokens
    # instead of 256 (the same length distribution: lengths are fractions of
    # max_new_tokens) to stay within 5 minutes.
    # prompts_per_step, max_new_tokens (0: the config's)
    shape = (_PROMPTS.value or 4, 128) if _QUICK.value else (_PROMPTS.value, 0)
    overrides = [
        f"--config.{key}={value}"
        for key, value in zip(
            ("pipeline.prompts_per_step", "generation.max_new_tokens"), shape, strict=True
        )
        if value
    ]
    # Steady state by construction: everything the run meets compiles before its first
    # step (pipeline.precompile: the engine's shapes, and the trainer's micro-batch shapes
    # planned from the replayed lengths), and the figures leave out the first step (the
    # pipeline filling) and the last (draining: stream_async's last step only trains).
    overrides.append("--config.pipeline.precompile=True")
    if _slots():
        overrides.append(f"--config.mesh.instance_slots=({_slots()},)")
    out: dict = {"bench": "pipeline_processes", "variant": _VARIANT.value, "quick": _QUICK.value}
    per_mode, sync_s = {}, []
    t_start = time.time()
    modes = _MODES.value
    if _QUICK.value and not flags.FLAGS["modes"].present:
        # Quick: the four modes' ratios over more steps (inflight adds a fifth run with
        # the longest precompile: name it in --modes to run it too).
        modes = [m for m in modes if m != "inflight"]
    for mode in modes:
        cfg = _config(mode, steps, *shape)
        launched, extra, fill = _process_mode(mode, cfg.generation.max_new_tokens)
        workdir = os.path.join(_WORKDIR.value, mode)
        shutil.rmtree(workdir, ignore_errors=True)  # logs append
        t0 = time.time()
        _launch(launched, (steps or cfg.pipeline.steps) + fill, workdir, overrides + extra)
        rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step_s" in r]
        skip = _SKIP.value if _SKIP.value is not None else 1
        later = rows[skip + fill : -1]  # filling and draining left out (above)
        n = cfg.pipeline.prompts_per_step * cfg.pipeline.group_size
        # Samples trained (partial rollout trains a varying number per step).
        sps = sum(r["samples"] for r in later) / sum(r["step_s"] for r in later)
        trace = os.path.join(workdir, "trace.json")
        per_mode[mode] = {
            "samples_per_s": round(sps, 4),
            "step_s": [round(r["step_s"], 3) for r in rows],
            "samples": [int(r["samples"]) for r in rows],
            **_compile_figures(later),
            # Before the first step, not in any step_s (the trainer's precompilation).
            "precompile_s": round(max(r.get("precompile_s", 0.0) for r in rows), 1),
            "train_busy": round(sum(r["train_busy"] for r in later) / len(later), 3),
            "gen_busy": round(sum(r["gen_busy"] for r in later) / len(later), 3),
            "run_wall_s": round(time.time() - t0, 1),
        }
        if mode != "colocated":
            bound = Schedule.from_config(cfg.pipeline).max_lag
            per_mode[mode] |= _lag(later, bound) | {
                "mixed_versions": round(sum(r["mixed_versions"] for r in later) / len(later), 3),
                **_idle_slots(trace, cfg.mesh.instance_slots[0], len(cfg.mesh.instance_slots)),
            }
            sync = [r["weight_sync_s"] for r in later]
            sync_s += sync
            per_mode[mode]["weight_sync_s"] = round(sum(sync) / len(sync), 4)
            per_mode[mode]["weight_receive_s"] = round(_weight_receive_s(trace), 4)
        print(f"{mode}: {sps:.3f} samples/s", file=sys.stderr, flush=True)
        if mode == "disaggregated_batch":
            _bounds(out, n, trace, len(rows))
            _core_bounds(out, n, later, per_mode[mode]["weight_receive_s"])
    _ratios(out, per_mode)
    # The simulator's prediction from this run's profile: here the stages are separate
    # processes on separate cores, independent as the simulator models them.
    _simulate(out, _config("disaggregated_batch", steps, *shape), per_mode)
    if sync_s:
        out["weight_sync_seconds"] = round(sum(sync_s) / len(sync_s), 4)
        receive = [v["weight_receive_s"] for v in per_mode.values() if "weight_receive_s" in v]
        out["weight_receive_seconds"] = round(sum(receive) / len(receive), 4)
    out["wall_s"] = round(time.time() - t_start, 1)
    out["machine"] = (
        f"{os.cpu_count()} CPU cores; disaggregated modes: 2 processes pinned to 1 core each; "
        "colocated: 1 process, both cores"
    )
    print(json.dumps(out))


def main(argv: list[str]) -> None:
    del argv
    if _PROCESSES.value:
        main_processes()
        return
    import jax

    jax.config.update("jax_num_cpu_devices", _CPU.value)
    from absl import logging

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.pipeline.schedules import Schedule
    from streamrl_jax.rewards.base import RewardResult

    logging.set_verbosity(logging.WARNING)
    if _WARM.value:  # every executable kept, however fast it compiled
        cache = os.path.join(_WORKDIR.value, "jax_cache")
        shutil.rmtree(cache, ignore_errors=True)  # this run's programs only
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def no_reward(text, metadata):  # lengths are forced: rewards do not matter here
        return RewardResult(score=0.0, correct=False, extracted_answer=None, format_ok=False)

    # Quick: 5 steps (4 measured) a mode; warm (every executable from the cache), all five
    # modes within the --quick budget (BENCHMARKS.md "Pipeline modes, one process").
    steps = _STEPS.value or (5 if _QUICK.value else 0)
    out: dict = {"bench": "pipeline", "variant": _VARIANT.value, "quick": _QUICK.value}
    per_mode = {}
    t_start = time.time()
    for mode in _MODES.value:
        # The first step compiles; the inflight mode's first INFLIGHT_ROUNDS - 1 steps also
        # fill its rounds (a step trains the groups its round completed, and the longest
        # take INFLIGHT_ROUNDS rounds), so it runs that many more steps and leaves them out.
        fill = INFLIGHT_ROUNDS - 1 if mode == "inflight" else 0
        cfg = _config(mode, (steps or _config(mode, 0).pipeline.steps) + fill, _PROMPTS.value)
        workdir = os.path.join(_WORKDIR.value, mode)
        warm_s = None
        if _WARM.value:  # the same run, unmeasured: its executables fill the cache
            t0 = time.time()
            shutil.rmtree(workdir, ignore_errors=True)
            run_lib.run(cfg, workdir, reward_fn=no_reward)
            warm_s = round(time.time() - t0, 1)
        shutil.rmtree(workdir, ignore_errors=True)  # logs append; a checkpoint would resume
        t0 = time.time()
        result = run_lib.run(cfg, workdir, reward_fn=no_reward)
        run_s = round(time.time() - t0, 1)
        rows = result.steps[1 + fill :]
        n = cfg.pipeline.prompts_per_step * cfg.pipeline.group_size
        # Samples trained (partial rollout trains a varying number per step).
        sps = sum(r["samples"] for r in rows) / sum(r["step_s"] for r in rows)
        every = result.steps
        per_mode[mode] = {
            "samples_per_s": round(sps, 4),
            # every step, compilation and (inflight) round fill included: the other bias
            "run_samples_per_s": round(
                sum(r["samples"] for r in every) / sum(r["step_s"] for r in every), 4
            ),
            "step_s": [round(r["step_s"], 3) for r in result.steps],
            "samples": [int(r["samples"]) for r in result.steps],
            **_compile_figures(rows),
            "train_busy": round(sum(r["train_busy"] for r in rows) / len(rows), 3),
            **_lag(rows, Schedule.from_config(cfg.pipeline).max_lag),
            **_idle_slots(
                os.path.join(workdir, "trace.json"),
                cfg.mesh.instance_slots[0],
                len(cfg.mesh.instance_slots),
            ),
            "run_s": run_s,
            "warm_run_s": warm_s,
        }
        print(f"{mode}: {sps:.3f} samples/s", file=sys.stderr, flush=True)
        if mode == "disaggregated_batch":
            _bounds(out, n, os.path.join(workdir, "trace.json"), len(result.steps))
    _ratios(out, per_mode)
    _simulate(out, cfg, per_mode)
    out["wall_s"] = round(time.time() - t_start, 1)
    out["machine"] = f"{os.cpu_count()} CPU cores, {_CPU.value} host devices, one process"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    app.run(main)
