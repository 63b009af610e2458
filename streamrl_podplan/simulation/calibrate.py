"""Calibration against the paper's Fig. 8 (PAPER.md): 9 settings x 2 ratios.

Each setting is Qwen2.5-{7B, 32B, 72B} on {32, 64, 128} H800, PPO, global batch 1024, with
the paper's length trace at {5K, 10K, 20K}. The compared quantities are the ratios
stream_sync / colocated and stream_async / colocated of samples/s, because they are what the
paper's claims are about and they cancel most of what a roofline cannot know about one
framework (kernel quality, launch overheads common to all modes).

Every setting uses the same `CostParams` (no per-setting factor); the only per-setting inputs
are the paper's: model, device count, length trace.

`run(instances=...)` re-runs it with each model's generation instance as
`streamrl_podplan.plan --search` compiled it (`Instance`: its TP, the slots that fit, the chip
it was compiled for, and, where the compiler analyses costs (TPU), every stage scaled to the
compiled programs' FLOPs and bytes: `compiled.CompiledCosts`).
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import compiled, cost_model, hardware, simulator, stages
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.scenario import Scenario

# (max_len, model, devices) -> (colocated, stream_sync, stream_async) samples/s, Fig. 8 (~).
PAPER_FIG8: dict[tuple[int, str, int], tuple[float, float, float]] = {
    (5_000, "qwen2.5-7b", 32): (12.89, 16.04, 21.29),
    (5_000, "qwen2.5-32b", 64): (6.02, 6.67, 7.64),
    (5_000, "qwen2.5-72b", 128): (4.08, 5.78, 7.23),
    (10_000, "qwen2.5-7b", 32): (8.02, 8.79, 10.65),
    (10_000, "qwen2.5-32b", 64): (2.89, 3.25, 3.74),
    (10_000, "qwen2.5-72b", 128): (2.40, 3.01, 3.70),
    (20_000, "qwen2.5-7b", 32): (4.78, 5.06, 5.69),
    (20_000, "qwen2.5-32b", 64): (1.83, 2.13, 2.43),
    (20_000, "qwen2.5-72b", 128): (1.51, 1.85, 2.23),
}

TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Row:
    """One Fig. 8 setting: simulated and paper samples/s and ratios."""

    max_len: int
    model: str
    devices: int
    gen_devices: int
    sim: dict[str, float]  # mode -> samples/s
    paper: tuple[float, float, float]
    instance: str = ""  # "TP x slots" of a generation instance

    @property
    def ratios(self) -> dict[str, tuple[float, float]]:
        """{"sync", "async"} -> (predicted, paper) ratio to colocated."""
        col, sync, asyn = self.paper
        c = self.sim["colocated"]
        return {
            "sync": (self.sim["stream_sync"] / c, sync / col),
            "async": (self.sim["stream_async"] / c, asyn / col),
        }


@dataclasses.dataclass(frozen=True)
class Instance:
    """A model's generation instance as `streamrl_podplan.plan --search` chose and compiled it.

    Attributes:
      hw: the simulator's hardware preset of the chip compiled for ("h800" stands for an
        H100 compile: the same 80 GB card).
      instance_tp, slots, max_len: the instance, and the KV slots of `max_len` positions
        that fit it. At another trace length the slots scale inversely (the cache is what
        fills the chip), within the simulator's own KV capacity.
      compiled: the plan's compiled figures; None where the compiler analyses no cost
        (XLA:GPU): the roofline's costs.
    """

    hw: str
    instance_tp: int
    slots: int
    max_len: int
    compiled: compiled.Compiled | None = None


def setting_scenario(
    max_len: int,
    model: str,
    devices: int,
    params: CostParams,
    seed: int = 0,
    hw: str = "h800",
    gen_tp: int | None = None,
) -> Scenario:
    """A Fig. 8 setting; `gen_tp` None: the simulator's smallest TP within one node (a
    model wider than a node needs its instance's TP given: 72B on a v5p host's 4 chips)."""
    return Scenario(
        mode="colocated",
        model=hardware.get_model(model),
        hw=hardware.get_hardware(hw),
        devices=devices,
        trace=lengths.paper_trace(max_len),
        global_batch=1024,
        algorithm="ppo",
        params=params,
        seed=seed,
        gen_tp=gen_tp,
    )


def with_instance(sc: Scenario, inst: Instance) -> tuple[Scenario, compiled.CompiledCosts | None]:
    """`sc` with `inst`'s TP and slots (scaled to `sc`'s longest sequence, within the
    simulator's KV capacity) and its compiled costs, if any."""
    sc = dataclasses.replace(sc, gen_tp=inst.instance_tp)
    cap = cost_model.max_slots(
        sc.model, sc.hw, sc.tp, sc.trace.max_seq_len, sc.params, sc.resident_per_device
    )
    slots = min(cap, inst.slots * inst.max_len // sc.trace.max_seq_len)
    if slots < 1:
        raise ValueError(
            f"Instance of {inst.instance_tp} x {sc.hw.name}: no {sc.trace.max_seq_len}-token "
            f"sequence fits ({inst.slots} slots of {inst.max_len} compiled)"
        )
    sc = dataclasses.replace(sc, max_batch=slots)
    if inst.compiled is None:
        return sc, None
    # The scales are read at the compiled point and carried to this setting's slots.
    at_compiled = stages.RooflineCosts(
        sc.model, sc.hw, inst.instance_tp, inst.slots, sc.algorithm, sc.params
    )
    costs = compiled.CompiledCosts.from_compiled(at_compiled, inst.compiled)
    return sc, dataclasses.replace(costs, base=simulator.roofline_costs(sc))


def run(
    params: CostParams | None = None, seed: int = 0, instances: dict[str, Instance] | None = None
) -> list[Row]:
    """Simulates the 9 settings (colocated, stream_sync, stream_async, disaggregated_batch),
    a model's generation instance and costs from `instances[model]` where given."""
    params = params or CostParams()
    rows = []
    for (max_len, model, devices), paper in PAPER_FIG8.items():
        inst = (instances or {}).get(model)
        hw, tp = (inst.hw, inst.instance_tp) if inst else ("h800", None)
        sc = setting_scenario(max_len, model, devices, params, seed, hw, tp)
        costs = None
        if inst is not None:
            sc, costs = with_instance(sc, inst)
        res = simulator.simulate_modes(sc, costs=costs)
        rows.append(
            Row(
                max_len=max_len,
                model=model,
                devices=devices,
                gen_devices=res["stream_sync"].gen_devices,
                sim={m: r.samples_per_s for m, r in res.items()},
                paper=paper,
                instance=f"{sc.tp} x {sc.slots}",
            )
        )
    return rows


def summary(rows: list[Row]) -> dict[str, float | int]:
    """Count of the 18 ratios within TOLERANCE and the largest relative error."""
    errors = [float(pred / ref - 1.0) for row in rows for pred, ref in row.ratios.values()]
    return {
        "within_15pct": int(sum(abs(e) <= TOLERANCE for e in errors)),
        "n_ratios": len(errors),
        "max_rel_error": max(abs(e) for e in errors),
        "mean_abs_rel_error": sum(abs(e) for e in errors) / len(errors),
    }


def table(rows: list[Row]) -> str:
    """Markdown table of predicted vs paper ratios (and absolute samples/s)."""
    out = [
        "| setting | instance TP x slots | split gen/train | sim col | paper col | sync/col sim "
        "| paper | err | async/col sim | paper | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        (ps, rs), (pa, ra) = r.ratios["sync"], r.ratios["async"]
        name = f"{r.max_len // 1000}K, {r.model.split('-')[1].upper()}/{r.devices}"
        out.append(
            f"| {name} | {r.instance} | {r.gen_devices}/{r.devices - r.gen_devices} "
            f"| {r.sim['colocated']:.2f} | {r.paper[0]:.2f} "
            f"| {ps:.3f} | {rs:.3f} | {ps / rs - 1:+.1%} "
            f"| {pa:.3f} | {ra:.3f} | {pa / ra - 1:+.1%} |"
        )
    return "\n".join(out)
