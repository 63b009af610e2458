"""The knob search: what fits, compiled, then every fitting pair of a training plan and a
generation instance simulated on the pod with the compiled costs.

For each training TP and micro-batch rows per replica the cheapest remat policy that
fits, for each instance TP the most KV slots that fit; then each pair simulated
(stream_async and colocated, the paper's length trace) with every stage of the roofline
rescaled to the compiled programs' FLOPs and bytes (`simulation.compiled`). The plan with
the shortest predicted step is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from streamrl_jax.model.config import ModelConfig
from streamrl_jax.scheduling import lengths
from streamrl_podplan import reports
from streamrl_podplan.programs import Knobs, model_config
from streamrl_podplan.simulation import compiled, hardware, simulator, stages
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.scenario import Scenario

# The simulator's hardware presets for the chips a plan compiles for.
SIM_HARDWARE = {"v5p": "tpu_v5p", "v5e": "tpu_v5e", "v5litepod": "tpu_v5e", "v6e": "tpu_v6e"}


def sim_model(cfg: ModelConfig, name: str) -> hardware.Model:
    """The simulator's description of `cfg` (dense shapes).

    Raises:
      ValueError: `cfg` has experts (the simulator's cost model is dense).
    """
    if cfg.num_experts:
        raise ValueError(
            f"model {name!r}: num_experts={cfg.num_experts}: the simulator's cost model is "
            "dense; plan a mixture of experts without --search (the fit check compiles it)"
        )
    return hardware.Model(
        name=name, layers=cfg.num_layers, d_model=cfg.hidden_size, n_heads=cfg.num_heads,
        n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, d_ff=cfg.intermediate_size,
        vocab=cfg.vocab_size, tied_embeddings=cfg.tie_embeddings, qkv_bias=cfg.qkv_bias,
    )  # fmt: skip


def _first_fit(candidates, plan) -> tuple[Any, list[dict]] | None:
    """The first of `candidates` whose `plan(candidate)` reports fit in every executable."""
    for c in candidates:
        got = plan(c)
        if all(r["fits"] for r in got):
            return c, got
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
    model = sim_model(model_config(base), base.model)  # refused before any compile
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
            got = _first_fit(knobs, lambda k: reports.plan_training(k, train_dev, hbm))
            if got:
                trains.append(got)
    gens = []
    for itp in s["instance_tps"]:
        if itp > len(gen_dev):
            continue
        knobs = [dataclasses.replace(base, instance_tp=itp, slots=x) for x in s["slots"]]
        got = _first_fit(knobs, lambda k: reports.plan_generation(k, gen_dev[: k.instance_tp], hbm))
        if got:
            gens.append(got)
    # The trainer's cost probe last: what fits is known (and printed) before its compiles,
    # the longest of a search.
    analysed = train_dev.flat[0].platform == "tpu" and s.get("train_cost", "probe") == "probe"
    trains = [
        (k, r, reports.training_cost(k, train_dev, hbm, r[0]) if analysed and gens else (0, 0))
        for k, r in trains
    ]
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
