"""Entry point of the simulator: `simulate(scenario)` and `simulate_modes(...)`.

Randomness: one `numpy.random.SeedSequence(scenario.seed)` is split into a stream for the
length draws and a stream for dispatch / ranker noise, so every mode of one seed sees the
same global batches and a run is reproducible bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import generation, stages
from streamrl_podplan.simulation.inflight import run_inflight
from streamrl_podplan.simulation.pipeline import SimResult, run_schedule
from streamrl_podplan.simulation.scenario import INFLIGHT, MODES, Scenario


def draw_batches(
    scenario: Scenario,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.random.Generator]:
    """The scenario's global batches, the "recent" lengths before batch 0, a dispatch rng."""
    len_seq, dispatch_seq = np.random.SeedSequence(scenario.seed).spawn(2)
    len_rng = np.random.default_rng(len_seq)
    # Batch -1 stands for the length history the dispatcher has seen before step 0.
    _, history = lengths.sample_lengths(scenario.trace, scenario.global_batch, len_rng)
    batches = [
        lengths.sample_lengths(scenario.trace, scenario.global_batch, len_rng)
        for _ in range(scenario.iterations)
    ]
    return batches, history, np.random.default_rng(dispatch_seq)


def roofline_costs(scenario: Scenario) -> stages.RooflineCosts:
    return stages.RooflineCosts(
        model=scenario.model,
        hw=scenario.hw,
        tp=scenario.tp,
        slots=scenario.slots,
        algorithm=scenario.algorithm,
        params=scenario.params,
    )


def plan_kwargs(scenario: Scenario) -> dict:
    return {
        "dispatch_kind": scenario.resolved_dispatch,
        "ranker_recall": scenario.ranker_recall,
        "alpha": scenario.alpha,
        "objective": scenario.dispatch_objective,
    }


def resolve_split(scenario: Scenario, costs: stages.CostSource | None = None) -> stages.Split:
    """Devices per stage: all of them when colocated, else `gen_devices` or Algorithm 1."""
    costs = costs or roofline_costs(scenario)
    batches, history, _ = draw_batches(scenario)
    probe = stages.ProbeBatch(*batches[0], history, plan_kwargs(scenario), scenario.seed)
    if not scenario.disaggregated:
        n = scenario.devices
        return stages.predict_stage_times(costs, n, n, scenario.tp, probe)
    if scenario.gen_devices is not None:
        x = scenario.gen_devices
        return stages.predict_stage_times(costs, x, scenario.devices - x, scenario.tp, probe)
    best, _ = stages.choose_split(costs, scenario.devices, scenario.granularity, scenario.tp, probe)
    return best


def simulate(scenario: Scenario, costs: stages.CostSource | None = None) -> SimResult:
    """Simulates `scenario.iterations` training steps of `scenario.mode`.

    Args:
      scenario: what to simulate.
      costs: stage cost source; None = the roofline model of the scenario's hardware.
    """
    costs = costs or roofline_costs(scenario)
    split = resolve_split(scenario, costs)
    batches, history, rng = draw_batches(scenario)
    spec = costs.instance()
    n_inst = split.gen_devices // scenario.tp
    plans, recent = [], history
    for _, resp in batches:
        plans.append(
            generation.plan_batch(spec, n_inst, resp, recent, rng=rng, **plan_kwargs(scenario))
        )
        recent = resp  # the dispatcher's representative lengths come from the last batch
    common = dict(
        costs=costs,
        batches=batches,
        gen_devices=split.gen_devices,
        train_devices=split.train_devices,
        tp=scenario.tp,
        staleness=scenario.staleness,
        warmup=scenario.warmup,
    )
    if scenario.mode == INFLIGHT:
        # Admissions every budget/16 decode steps (a chunk), so a pod-scale round is a few
        # hundred host steps per instance, not one per token.
        budget = scenario.budget
        return run_inflight(budget=budget, chunk=max(1, budget // 16), **common)
    return run_schedule(mode=scenario.mode, plans=plans, **common)


def simulate_modes(
    scenario: Scenario, modes: tuple[str, ...] = MODES, costs: stages.CostSource | None = None
) -> dict[str, SimResult]:
    """Runs `scenario` under each mode (same batches, same seed)."""
    return {m: simulate(dataclasses.replace(scenario, mode=m), costs) for m in modes}
