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

Last line: JSON with `stream_sync_over_colocated`, `stream_async_over_colocated`,
`async_efficiency_vs_bound` and the per-mode figures. Traces stay in --workdir.
"""

from __future__ import annotations

import importlib.util
import json
import os
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
    """Mean T_gen and T_train per step (steps >= 1) from a disaggregated_batch trace."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    gen = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if names[e["pid"]] == "generation")
    opt = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if names[e["pid"]] == "trainer" and e["name"].startswith("step ")
    )
    train = [e for e in spans if names[e["pid"]] in ("trainer", "weight_sync")]
    t_gen, t_train = [], []
    # Step b's generation happens after step b-1's optimizer span and before step b's
    # first micro-batch; its training from the first micro-batch to its optimizer end.
    for b in range(1, min(steps, len(opt))):
        lo, hi = opt[b - 1][1], opt[b][1]
        g = [(s, e) for s, e in gen if lo <= s < hi]
        first_train = min((e["ts"] for e in train if lo < e["ts"] < hi), default=hi)
        if g:
            t_gen.append(max(e for _, e in g) - min(s for s, _ in g))
        t_train.append(hi - first_train)
    mean = lambda xs: sum(xs) / len(xs) / 1e6 if xs else float("nan")  # noqa: E731
    return mean(t_gen), mean(t_train)


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
    out["wall_s"] = round(time.time() - t_start, 1)
    out["machine"] = f"{os.cpu_count()} CPU cores, {_CPU.value} host devices, one process"
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    app.run(main)
