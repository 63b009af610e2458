"""The stream's third stage in the simulator: a reward model scoring every sample
(generation -> scoring -> training, DESIGN.md §8; issue 55).

A scorer reads each whole trace (prompt + response) once per forward it needs: a
generative judge or a value-head PRM one, PRIME's implicit PRM two (log pi_prm and
log pi_ref; its own training lands on the training stage). A forward over a trace is a
prefill: compute bound, at the trainer's calibrated MFU,

    T_score(z) = forwards * sum_i F(prompt_i + resp_i) / (z * peak * train_mfu)

with F the model's forward FLOPs (`Model.forward_flops`, causal attention over half the
trace on average). The scorer's weights must fit: z is a multiple of the smallest
power-of-two group whose HBM holds them at the generation side's weight share
(`cost_model.auto_tp`).

`three_stage_plan` sets the policy's two stages (Algorithm 1, `balance.split_single_pool`)
beside two ways to add the scorer on the same pod:

* **on the trainer**: the scorer runs on the training devices before they train each
  batch, generation still overlapping (the training stage's slack absorbs it, if it has
  any): the best split of max(T_gen(x), T_score(y) + T_train(y));
* **stage**: the scorer on devices of its own, the three stages overlapping
  (`balance.split_three_stages`): max(T_gen(x), T_score(z), T_train(y)).

Splits of generation and training keep the scenario's granularity (a node), the scorer's
its weights' group, so a stage of its own costs the other two whole nodes when the pod
has none to spare; `best` is whichever of the two is faster: what a planner would choose.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from streamrl_jax.scheduling import balance
from streamrl_podplan.simulation import cost_model, simulator, stages
from streamrl_podplan.simulation.hardware import Model
from streamrl_podplan.simulation.scenario import Scenario


def score_seconds(
    scorer: Model, scenario: Scenario, devices: int, prompt: np.ndarray, resp: np.ndarray
) -> float:
    """Seconds of one scoring forward over every trace of a batch on `devices` devices."""
    tokens = (prompt + resp).astype(np.float64)
    flops = float(scorer.forward_flops(tokens, tokens / 2.0).sum())
    hw, params = scenario.hw, scenario.params
    return flops / (devices * hw.peak_flops * params.train_mfu)


@dataclasses.dataclass(frozen=True)
class ThreeStagePlan:
    """The policy's two-stage split, and the scorer added blocking or as a stage.

    Attributes:
      two: Algorithm 1 without a scorer (the step time to compare with).
      on_trainer: (gen devices, train devices, step seconds) with the scorer on the
        training devices before training.
      stage: Algorithm 1 over three stages (None: the pod has no room for a stage of its
        own at the split granularity).
      score_unit: the scorer's device granularity (its weights' group).
    """

    two: balance.StageSplit
    on_trainer: tuple[int, int, float]
    stage: balance.ThreeStageSplit | None
    score_unit: int

    def row(self) -> dict:
        row = {
            "two_stage_s": round(self.two.step_time, 1),
            "two_split": [self.two.gen_devices, self.two.train_devices],
            "on_trainer_s": round(self.on_trainer[2], 1),
            "on_trainer_split": list(self.on_trainer[:2]),
            "on_trainer_over_two_stage": round(self.on_trainer[2] / self.two.step_time, 3),
            "best": "on_trainer",
        }
        s = self.stage
        if s is None:
            return row | {"stage_s": None}
        return row | {
            "stage_s": round(s.step_time, 1),
            "stage_split": [s.gen_devices, s.score_devices, s.train_devices],
            "stage_times_s": [round(t, 1) for t in (s.t_gen, s.t_score, s.t_train)],
            "bottleneck": s.bottleneck,
            "stage_over_two_stage": round(s.step_time / self.two.step_time, 3),
            "best": "stage" if s.step_time < self.on_trainer[2] else "on_trainer",
        }


def three_stage_plan(
    scenario: Scenario, scorer: Model | None = None, forwards: int = 1
) -> ThreeStagePlan:
    """The plans of module docstring for `scenario` (its first batch is the probe);
    `scorer`: the reward model (None: the policy's architecture, as PRIME's PRM);
    `forwards`: forwards per trace (1: a judge or value head; 2: an implicit PRM)."""
    if forwards < 1:
        raise ValueError(f"forwards must be >= 1, got {forwards}")
    scorer = scorer or scenario.model
    costs = simulator.roofline_costs(scenario)
    batches, history, _ = simulator.draw_batches(scenario)
    prompt, resp = batches[0]
    probe = stages.ProbeBatch(prompt, resp, history, simulator.plan_kwargs(scenario), scenario.seed)
    p_gen, p_train = stages.simulator_profiles(costs, scenario.tp, probe)
    unit = cost_model.auto_tp(scorer, scenario.hw, scenario.params)

    def p_score(z: int) -> float:
        if z % unit:
            return math.inf
        return forwards * score_seconds(scorer, scenario, z, prompt, resp)

    n, g = scenario.devices, scenario.granularity
    two, _ = balance.split_single_pool(n, p_gen, p_train, gen_unit=g, train_unit=g)
    on_trainer = min(
        (
            (x, y, max(p_gen(x), p_score(y) + p_train(y)))
            for x in range(g, n, g)
            for y in range(g, n - x + 1, g)
        ),
        key=lambda c: (c[2], c[0] + c[1]),
    )
    try:
        stage, _ = balance.split_three_stages(
            n, p_gen, p_score, p_train, gen_unit=g, score_unit=unit, train_unit=g
        )
    except ValueError:  # no room for a third stage at this granularity
        stage = None
    return ThreeStagePlan(two, on_trainer, stage, unit)
