"""Pipeline throughput of the four modes on the length-replay workload (one process).

  python tools/bench_pipeline.py --quick          # tiny model, <= 5 min on 2 cores
  python tools/bench_pipeline.py --variant=smollm2 --steps=6

Every mode runs the same config (configs/length_replay.py: forced, paper-shaped
response lengths; same prompts, seeds and model) and differs only in
`pipeline.mode`. Per mode: samples/s over the steps after the first (the
first includes compilation), and the ratio to `colocated`.

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
streamrl_jax/simulation/profiles.py): decode seconds per step and per prefilled
prompt (least squares over the instance's chunk spans), trainer seconds per
token (micro-batch spans / their tokens), optimizer and weight-sync seconds,
the colocated side's scale factors, and the replayed lengths from
samples.jsonl. It then predicts every mode's samples/s with the same
discrete-event schedules the pod simulator uses and reports the relative
error against the measured rates (`sim_rel_error`, `sim_max_abs_rel_error`).
`python tools/simulate.py --profile=DIR/profile.json` re-runs the prediction.

Last line: JSON with `stream_sync_over_colocated`, `stream_async_over_colocated`,
`async_efficiency_vs_bound` and the per-mode figures. Traces stay in --workdir.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time

from absl import app, flags

_CPU = flags.DEFINE_integer("cpu_devices", 2, "Host CPU devices (generation 1 + training 1).")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny model, 3 steps per mode (<= 5 min).")
_VARIANT = flags.DEFINE_string("variant", "tiny", "configs/length_replay.py variant.")
_STEPS = flags.DEFINE_integer("steps", 0, "Steps per mode (0 = config default / quick).")
_MODES = flags.DEFINE_list(
    "modes", "colocated,disaggregated_batch,stream_sync,stream_async", "Modes to run."
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_pipeline", "Traces and metrics per mode.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(mode: str, steps: int):
    from streamrl_jax import config as config_lib

    spec = importlib.util.spec_from_file_location(
        "length_replay", os.path.join(_ROOT, "configs", "length_replay.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config(_VARIANT.value).to_dict()
    cd["pipeline"]["mode"] = mode
    if steps:
        cd["pipeline"]["steps"] = steps
    return config_lib.from_config_dict(cd)


def _stage_times(trace_path: str, steps: int) -> tuple[float, float]:
    """Mean T_gen and T_train per step (steps >= 1) from a disaggregated_batch trace.

    Step b: its generation runs from the landing of W_b to its first micro-batch
    (first chunk to last chunk of the instance tracks in that window); its training
    is its micro-batches, its optimizer step and the transfer of W_{b+1}.
    """
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    by = lambda pid_name: [e for e in spans if names[e["pid"]] == pid_name]  # noqa: E731
    gen = sorted((e["ts"], e["ts"] + e["dur"]) for e in by("generation"))
    opt = {int(e["name"].split()[1]): e for e in by("trainer") if e["name"].startswith("step ")}
    sync = {int(e["name"][1:]): e for e in by("weight_sync")}
    micro = [e for e in by("trainer") if e["name"] == "accumulate"]
    t_gen, t_train = [], []
    for b in range(1, steps):
        if b not in opt or b not in sync or b + 1 not in sync:
            continue
        lo, hi = sync[b]["ts"] + sync[b]["dur"], opt[b]["ts"] + opt[b]["dur"]
        prev_opt_end = opt[b - 1]["ts"] + opt[b - 1]["dur"]
        mine = [e for e in micro if prev_opt_end < e["ts"] < hi]
        first = min((e["ts"] for e in mine), default=hi)
        g = [(s, e) for s, e in gen if lo <= s < first]
        if g:
            t_gen.append(max(e for _, e in g) - min(s for s, _ in g))
        t_train.append(sum(e["dur"] for e in mine) + opt[b]["dur"] + sync[b + 1]["dur"])
    mean = lambda xs: sum(xs) / len(xs) / 1e6 if xs else float("nan")  # noqa: E731
    return mean(t_gen), mean(t_train)


def _spans(trace_path: str, after_step: int = 1) -> dict[str, list[dict]]:
    """X spans by process name ("generation", "trainer", "weight_sync", ...), keeping
    only those that start after the optimizer span of step `after_step - 1` (the first
    step includes compilation)."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    opt = sorted(
        e["ts"] + e["dur"]
        for e in spans
        if names[e["pid"]] == "trainer" and e["name"].startswith("step ")
    )
    t0 = opt[after_step - 1] if after_step and len(opt) >= after_step else 0.0
    out: dict[str, list[dict]] = {}
    for e in spans:
        if e["ts"] >= t0:
            out.setdefault(names[e["pid"]], []).append(e)
    return out


def _stage_costs(trace_path: str) -> dict[str, float]:
    """Per-stage unit costs measured in one run's trace (seconds)."""
    import numpy as np

    sp = _spans(trace_path)
    chunks = [e for e in sp.get("generation", []) if e["args"].get("steps", 0) > 0]
    steps = np.array([e["args"]["steps"] for e in chunks], dtype=np.float64)
    pre = np.array([e["args"]["prefilled"] for e in chunks], dtype=np.float64)
    dur = np.array([e["dur"] for e in chunks], dtype=np.float64) / 1e6
    # dur = per_step * steps + per_prefill * prefilled (host overhead folds into per_step).
    coef = np.linalg.lstsq(np.stack([steps, pre], axis=1), dur, rcond=None)[0]
    per_prefill = max(float(coef[1]), 0.0)
    per_step = float((dur.sum() - per_prefill * pre.sum()) / steps.sum())
    micro = [e for e in sp.get("trainer", []) if e["name"] == "accumulate"]
    opt = [e for e in sp.get("trainer", []) if e["name"].startswith("step ")]
    sync = sp.get("weight_sync", [])
    return {
        "per_step_s": per_step,
        "per_prefill_s": per_prefill,
        "train_s_per_token": sum(e["dur"] for e in micro)
        / 1e6
        / max(sum(e["args"]["tokens"] for e in micro), 1),
        "optimizer_s": sum(e["dur"] for e in opt) / 1e6 / max(len(opt), 1),
        "weight_sync_s": sum(e["dur"] for e in sync) / 1e6 / max(len(sync), 1),
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
        "measured_samples_per_s": measured,
    }


def main(argv: list[str]) -> None:
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", _CPU.value)
    from absl import logging

    from streamrl_jax import run as run_lib
    from streamrl_jax.rewards.base import RewardResult

    logging.set_verbosity(logging.WARNING)

    def no_reward(text, metadata):  # lengths are forced: rewards do not matter here
        return RewardResult(score=0.0, correct=False, extracted_answer=None, format_ok=False)

    steps = _STEPS.value or (3 if _QUICK.value else 0)  # 4 steps took 346 s: over 5 min
    out: dict = {"bench": "pipeline", "variant": _VARIANT.value, "quick": _QUICK.value}
    per_mode = {}
    t_start = time.time()
    for mode in _MODES.value:
        cfg = _config(mode, steps)
        workdir = os.path.join(_WORKDIR.value, mode)
        shutil.rmtree(workdir, ignore_errors=True)  # logs append; a checkpoint would resume
        result = run_lib.run(cfg, workdir, reward_fn=no_reward)
        rows = result.steps[1:]  # the first step includes compilation
        n = cfg.pipeline.prompts_per_step * cfg.pipeline.group_size
        sps = n * len(rows) / sum(r["step_s"] for r in rows)
        per_mode[mode] = {
            "samples_per_s": round(sps, 4),
            "step_s": [round(r["step_s"], 3) for r in result.steps],
            "train_busy": round(sum(r["train_busy"] for r in rows) / len(rows), 3),
        }
        print(f"{mode}: {sps:.3f} samples/s", file=sys.stderr, flush=True)
        if mode == "disaggregated_batch":
            t_gen, t_train = _stage_times(os.path.join(workdir, "trace.json"), len(result.steps))
            out["samples_per_step"] = n
            out["t_gen_s"], out["t_train_s"] = round(t_gen, 3), round(t_train, 3)
            out["bound_overlap_sps"] = round(n / max(t_gen, t_train), 4)
            out["bound_serial_sps"] = round(n / (t_gen + t_train), 4)
    out["modes"] = per_mode
    base = per_mode.get("colocated", {}).get("samples_per_s")
    for mode in ("disaggregated_batch", "stream_sync", "stream_async"):
        if base and mode in per_mode:
            out[f"{mode}_over_colocated"] = round(per_mode[mode]["samples_per_s"] / base, 3)
    if "bound_overlap_sps" in out and "stream_async" in per_mode:
        async_sps = per_mode["stream_async"]["samples_per_s"]
        out["async_efficiency_vs_bound"] = round(async_sps / out["bound_overlap_sps"], 3)
    if {"colocated", "disaggregated_batch"} <= set(per_mode):
        from streamrl_jax.simulation import profiles

        profile = _profile(
            cfg, _WORKDIR.value, {m: v["samples_per_s"] for m, v in per_mode.items()}
        )
        path = os.path.join(_WORKDIR.value, "profile.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(profile, f)
        pred = profiles.predict(profile, modes=tuple(per_mode))
        out["sim_predicted_sps"] = {
            m: round(v, 4) for m, v in pred["predicted_samples_per_s"].items()
        }
        out["sim_rel_error"] = {m: round(v, 3) for m, v in pred["rel_error"].items()}
        out["sim_max_abs_rel_error"] = round(max(abs(v) for v in pred["rel_error"].values()), 3)
        out["profile"] = path
    out["wall_s"] = round(time.time() - t_start, 1)
    out["machine"] = f"{os.cpu_count()} CPU cores, {_CPU.value} host devices, one process"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    app.run(main)
