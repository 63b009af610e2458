"""Pod-scale simulator CLI: "what will this do on my pod", before any GPU hour.

    python -m streamrl_podplan.simulate --model=qwen2.5-7b --hardware=h800 --devices=32 \
        --max_len=20000
    python -m streamrl_podplan.simulate --mode=stream_async --trace_out=/tmp/t.json --per_sample
    python -m streamrl_podplan.simulate --calibrate   # PAPER.md Fig. 8, 9 settings x 2 ratios
    python -m streamrl_podplan.simulate --profile=profile.json  # measured stage profiles
    python -m streamrl_podplan.simulate --scoring   # a reward model: a third stage or not

Prints one line per mode (samples/s, devices per stage, busy shares, bubbles by cause) and,
last, one JSON line. With --calibrate the table of predicted vs paper ratios comes first and
the last line is JSON with `within_15pct` (of the 18 ratios) and `max_rel_error`.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import (
    calibrate,
    compiled,
    hardware,
    profiles,
    scoring,
    simulator,
    trace,
)
from streamrl_podplan.simulation.scenario import INFLIGHT, MODES, Scenario

_MODE = flags.DEFINE_enum(
    "mode", "all", ["all", *MODES, INFLIGHT], "Mode to simulate, or all (the four and inflight)."
)
_MODEL = flags.DEFINE_enum("model", "qwen2.5-7b", sorted(hardware.MODELS), "Policy model.")
_HW = flags.DEFINE_enum("hardware", "h800", sorted(hardware.HARDWARE), "Accelerator.")
_DEVICES = flags.DEFINE_integer("devices", 32, "Accelerators in the pod.")
_MAX_LEN = flags.DEFINE_integer("max_len", 20_000, "Max response length (paper trace scaled).")
_FIXED_LEN = flags.DEFINE_integer("fixed_len", None, "Every response exactly this long.")
_BATCH = flags.DEFINE_integer("global_batch", 1024, "Samples per training step.")
_ALGO = flags.DEFINE_enum("algorithm", "ppo", ["ppo", "grpo"], "RL algorithm (FLOP factor).")
_GEN_DEVICES = flags.DEFINE_integer("gen_devices", None, "Generation devices; None: Alg. 1.")
_GRANULARITY = flags.DEFINE_integer("split_granularity", None, "Split step; None: one node.")
_TP = flags.DEFINE_integer("gen_tp", None, "Generation tensor parallel; None: auto.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", None, "KV slots per instance; None: auto.")
_DISPATCH = flags.DEFINE_enum("dispatch", "auto", ["auto", "random", "skew_aware"], "Dispatch.")
_RECALL = flags.DEFINE_float("ranker_recall", 0.87, "Ranker recall@20% (skew-aware dispatch).")
_STALENESS = flags.DEFINE_integer("staleness", 1, "stream_async policy lag.")
_ITERS = flags.DEFINE_integer("iterations", 5, "Training steps simulated.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Steps excluded from throughput.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of lengths and dispatch.")
_TRACE_OUT = flags.DEFINE_string("trace_out", None, "Chrome/Perfetto trace path (mode != all).")
_PER_SAMPLE = flags.DEFINE_bool("per_sample", False, "Trace one span per sample.")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "Run the Fig. 8 calibration.")
_SCORING = flags.DEFINE_bool(
    "scoring",
    False,
    "A reward model of the policy's size on the training devices or as a third stage "
    "(simulation/scoring.py), on the paper's 7B/32, 32B/64 and 72B/128 H800 settings, "
    "10K and 20K traces.",
)
_SCORER_FORWARDS = flags.DEFINE_list(
    "scorer_forwards", ["1", "2"], "--scoring: forwards per trace (1: judge, 2: implicit PRM)."
)
_PROFILE = flags.DEFINE_string("profile", None, "Measured-profile JSON (docs/podplan.md).")
_COMPILED = flags.DEFINE_string(
    "compiled", None,
    "A `streamrl_podplan.plan --search` output (its JSON line): every stage scaled to the chosen "
    "plan's compiled costs (simulation/compiled.py); its instance TP and slots are used. "
    "With --calibrate: comma-separated outputs, one per model (its instance, and its "
    "costs where compiled for a TPU).",
)  # fmt: skip


def _scenario(mode: str) -> Scenario:
    trace_ = (
        lengths.fixed_trace(_FIXED_LEN.value)
        if _FIXED_LEN.value
        else lengths.paper_trace(_MAX_LEN.value)
    )
    return Scenario(
        mode=mode,
        model=hardware.get_model(_MODEL.value),
        hw=hardware.get_hardware(_HW.value),
        devices=_DEVICES.value,
        trace=trace_,
        global_batch=_BATCH.value,
        algorithm=_ALGO.value,
        gen_devices=_GEN_DEVICES.value,
        split_granularity=_GRANULARITY.value,
        gen_tp=_TP.value,
        max_batch=_MAX_BATCH.value,
        dispatch=_DISPATCH.value,
        ranker_recall=_RECALL.value,
        staleness=_STALENESS.value,
        iterations=_ITERS.value,
        warmup=_WARMUP.value,
        seed=_SEED.value,
    )


def _compiled_costs(base: Scenario, path: str):
    """(scenario with the plan's instance, `CompiledCosts`) from a plan's JSON line."""
    chosen = _plan_settings(path)[0].get("chosen") or {}
    if not chosen.get("compiled"):
        raise SystemExit(
            f"--compiled={path}: its chosen plan has no compiled costs (nothing fits, or a "
            "compiler without cost analysis: XLA:GPU)"
        )
    c = compiled.Compiled(**chosen["compiled"])
    base = dataclasses.replace(base, gen_tp=c.instance_tp, max_batch=c.slots)
    return base, compiled.CompiledCosts.from_compiled(simulator.roofline_costs(base), c)


# A plan's chip -> the calibration's hardware: an H100 compile stands for the paper's
# H800 (the same 80 GB card; it is the memory the compile checked). Outputs that did not
# record their hardware name it by their topology's chip.
_CALIBRATION_HW = {"h100": "h800", "v5p": "tpu_v5p", "v5e": "tpu_v5e", "v6e": "tpu_v6e"}


def _instances(paths: str) -> dict[str, calibrate.Instance]:
    """Each model's generation instance from `python -m streamrl_podplan.plan --search` outputs."""
    out = {}
    for path in paths.split(","):
        for setting in _plan_settings(path):
            chosen = setting.get("chosen")
            if not chosen:
                raise SystemExit(f"--compiled={path}: {setting.get('model')}: nothing fits")
            c = chosen.get("compiled")
            max_len = c["max_len"] if c else setting.get("knobs", {}).get("max_len")
            if not max_len:
                raise SystemExit(
                    f"--compiled={path}: no max_len (the plan had not recorded its knobs)"
                )
            model = setting["model"].removesuffix("_shape").replace("_", "-")
            hw = setting.get("hardware") or setting.get("topology", "").split(":")[0]
            out[model] = calibrate.Instance(
                hw=_CALIBRATION_HW.get(hw, hw),
                instance_tp=chosen["generation"]["instance_tp"],
                slots=chosen["generation"]["slots"],
                max_len=max_len,
                compiled=compiled.Compiled(**c) if c else None,
            )
    return out


def _plan_settings(path: str) -> list[dict]:
    with open(path) as f:
        lines = [line for line in f if line.startswith("{")]
    if not lines:
        raise SystemExit(f"--compiled={path}: no JSON line (streamrl_podplan.plan --search's last)")
    return json.loads(lines[-1]).get("settings") or [{}]


def _run_calibration() -> None:
    instances = _instances(_COMPILED.value) if _COMPILED.value else None
    rows = calibrate.run(seed=_SEED.value, instances=instances)
    print(calibrate.table(rows))
    s = calibrate.summary(rows)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else int(v)) for k, v in s.items()}))


# The paper's settings (PAPER.md): policy, pod size.
_PAPER_PODS = (("qwen2.5-7b", 32), ("qwen2.5-32b", 64), ("qwen2.5-72b", 128))


def _run_scoring() -> None:
    """The three-stage plans of the paper's settings (`--scoring`), a line each, then JSON."""
    rows = []
    for name, devices in _PAPER_PODS:
        for max_len in (10_000, 20_000):
            sc = Scenario(
                mode="stream_async",
                model=hardware.get_model(name),
                hw=hardware.get_hardware("h800"),
                devices=devices,
                trace=lengths.paper_trace(max_len),
                global_batch=_BATCH.value,
                algorithm=_ALGO.value,
                seed=_SEED.value,
            )
            for forwards in map(int, _SCORER_FORWARDS.value):
                row = {"model": name, "devices": devices, "max_len": max_len}
                row |= {
                    "forwards": forwards,
                    **scoring.three_stage_plan(sc, forwards=forwards).row(),
                }
                print(
                    f"{name} /{devices} {max_len // 1000}K x{forwards}: no scorer "
                    f"{row['two_stage_s']} s {row['two_split']}; on the trainer "
                    f"{row['on_trainer_s']} s ({row['on_trainer_over_two_stage']}x) "
                    f"{row['on_trainer_split']}; "
                    + (
                        "no room for a stage"
                        if row["stage_s"] is None
                        else f"stage {row['stage_s']} s ({row['stage_over_two_stage']}x) "
                        f"{row['stage_split']} times {row['stage_times_s']} "
                        f"({row['bottleneck']} slowest)"
                    )
                    + f"; best {row['best']}"
                )
                rows.append(row)
    print(json.dumps({"scoring": rows}))


def main(argv: list[str]) -> None:
    del argv
    if _SCORING.value:
        _run_scoring()
        return
    if _CALIBRATE.value:
        _run_calibration()
        return
    if _PROFILE.value:
        profile = profiles.load(_PROFILE.value)
        modes = (*MODES, INFLIGHT) if "inflight" in profile else MODES
        print(json.dumps(profiles.predict(profile, modes=modes, seed=_SEED.value)))
        return
    modes = (*MODES, INFLIGHT) if _MODE.value == "all" else (_MODE.value,)
    base, costs = _scenario(modes[0]), None
    if _COMPILED.value:
        base, costs = _compiled_costs(base, _COMPILED.value)
    results = simulator.simulate_modes(base, modes, costs)
    out = {}
    for mode, r in results.items():
        sc = dataclasses.replace(base, mode=mode)
        print(
            f"{mode:20s} {r.samples_per_s:8.3f} samples/s  {r.iteration_s:8.1f} s/step  "
            f"gen {r.gen_devices} dev ({r.n_instances} x TP{sc.tp}, {sc.slots} slots)  "
            f"train {r.train_devices} dev  "
            f"busy gen {r.busy['generation']:.2f} train {r.busy['training']:.2f}  bubbles "
            + " ".join(f"{k} {v:.3f}" for k, v in r.bubbles.items())
        )
        out[mode] = {
            "samples_per_s": r.samples_per_s,
            "iteration_s": r.iteration_s,
            "gen_devices": r.gen_devices,
            "train_devices": r.train_devices,
            "busy": r.busy,
            "bubbles": r.bubbles,
        }
    if _TRACE_OUT.value and len(results) == 1:
        trace.save(next(iter(results.values())), _TRACE_OUT.value, per_sample=_PER_SAMPLE.value)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
