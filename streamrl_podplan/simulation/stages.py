"""Stage cost sources and the Algorithm 1 device split.

A `CostSource` answers everything the schedule needs about time: one generation
instance's decode model and slot count, trainer seconds per sample on y devices, and the
weight-transfer / stage-switch seconds. `RooflineCosts` derives them from hardware and
model descriptions (`cost_model.py`); `profiles.MeasuredCosts` from a measured JSON.

`choose_split` is the paper's Algorithm 1 for one pool: enumerate (x, y = n - x) on the
split granularity, predict T_gen(x) by simulating one batch's generation and T_train(y)
from the trainer costs (both on one `ProbeBatch`), pick the pair minimising
max(T_gen, T_train). `simulator_profiles` hands the same two predictions to
`scheduling.balance` as profiles (devices -> seconds), for any `CostSource`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np

from streamrl_jax.scheduling.balance import Profile
from streamrl_podplan.simulation import cost_model, generation
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.hardware import Hardware, Model


class CostSource(Protocol):
    """Time model of every stage; see the module docstring."""

    def instance(self) -> generation.InstanceSpec:
        """One generation instance (decode cost and KV-cache slots)."""
        ...

    def train_seconds(self, prompt: np.ndarray, resp: np.ndarray, devices: int) -> np.ndarray:
        """f64[n] trainer seconds per sample on `devices` devices."""
        ...

    def optimizer_seconds(self, devices: int) -> float:
        """Seconds of the optimizer update(s) closing one training step."""
        ...

    def min_microbatch_tokens(self, devices: int) -> int:
        """Tokens a streamed micro-batch waits for before the trainer starts it."""
        ...

    def train_fits(self, devices: int) -> bool:
        """Whether the training state fits on `devices` devices."""
        ...

    def weight_sync_seconds(self, train_devices: int) -> float:
        """Seconds to push new weights from the trainer to the generation stage."""
        ...

    def switch_seconds(self) -> tuple[float, float]:
        """Colocated stage switch seconds: (generate -> train, train -> generate)."""
        ...


@dataclasses.dataclass(frozen=True)
class RooflineCosts:
    """Costs from public specs and the calibrated constants of `CostParams`."""

    model: Model
    hw: Hardware
    tp: int
    slots: int
    algorithm: str
    params: CostParams

    def instance(self) -> generation.InstanceSpec:
        return generation.InstanceSpec(
            cost=generation.RooflineDecode(self.model, self.hw, self.tp, self.params),
            slots=self.slots,
        )

    def train_seconds(self, prompt: np.ndarray, resp: np.ndarray, devices: int) -> np.ndarray:
        tokens = (prompt + resp).astype(np.float64)
        return cost_model.train_time(
            self.model, self.hw, devices, tokens, self.algorithm, self.params
        )

    def optimizer_seconds(self, devices: int) -> float:
        # Adam reads and writes the fp32 state once per trained model; memory bound.
        state = cost_model.train_state_bytes(self.model, self.algorithm)
        return 2.0 * state / (devices * self.hw.hbm_bw * self.params.hbm_efficiency)

    def min_microbatch_tokens(self, devices: int) -> int:
        return self.params.train_min_tokens_per_device * devices

    def train_fits(self, devices: int) -> bool:
        # Leave 30% of HBM for activations (with recomputation).
        state = cost_model.train_state_bytes(self.model, self.algorithm)
        return state <= 0.7 * devices * self.hw.hbm_bytes

    def weight_sync_seconds(self, train_devices: int) -> float:
        return cost_model.weight_transfer_time(
            self.model, self.hw, train_devices, self.tp, self.params
        )

    def switch_seconds(self) -> tuple[float, float]:
        total = cost_model.colocated_switch_time(self.model, self.hw, self.params)
        return self.params.switch_overhead_s, total - self.params.switch_overhead_s


@dataclasses.dataclass(frozen=True)
class Split:
    """A device split with its predicted stage times (seconds per global batch)."""

    gen_devices: int
    train_devices: int
    t_gen: float
    t_train: float


@dataclasses.dataclass(frozen=True)
class ProbeBatch:
    """The global batch stage times are predicted on, with what its dispatch sees.

    Attributes:
      prompt: i64[n] prompt lengths.
      resp: i64[n] response lengths.
      recent_resp: i64[m] response lengths the dispatcher observed before the batch.
      plan_kwargs: dispatch settings for `generation.plan_batch`.
      seed: seed of the dispatch / ranker randomness.
    """

    prompt: np.ndarray
    resp: np.ndarray
    recent_resp: np.ndarray
    plan_kwargs: dict
    seed: int = 0


def gen_batch_seconds(costs: CostSource, devices: int, tp: int, batch: ProbeBatch) -> float:
    """T_gen: `batch` dispatched to `devices // tp` instances and decoded to its end."""
    spec = costs.instance()
    rng = np.random.default_rng(batch.seed)
    plan = generation.plan_batch(
        spec, devices // tp, batch.resp, batch.recent_resp, rng=rng, **batch.plan_kwargs
    )
    return generation.simulate_batch(spec, plan, batch.prompt, batch.resp).makespan


def train_batch_seconds(costs: CostSource, devices: int, batch: ProbeBatch) -> float:
    """T_train: the trainer's per-sample seconds on `devices` summed, plus the optimizer."""
    t = float(costs.train_seconds(batch.prompt, batch.resp, devices).sum())
    return t + costs.optimizer_seconds(devices)


def predict_stage_times(
    costs: CostSource, gen_devices: int, train_devices: int, tp: int, batch: ProbeBatch
) -> Split:
    """T_gen from one simulated batch on `gen_devices`, T_train from the trainer costs."""
    return Split(
        gen_devices,
        train_devices,
        gen_batch_seconds(costs, gen_devices, tp, batch),
        train_batch_seconds(costs, train_devices, batch),
    )


def simulator_profiles(costs: CostSource, tp: int, batch: ProbeBatch) -> tuple[Profile, Profile]:
    """(P_gen, P_train) for `scheduling.balance` from this cost model.

    P_gen(x) is `gen_batch_seconds` on x devices (inf unless x is a multiple of `tp`);
    P_train(y) is `train_batch_seconds` on y devices (inf where the training state does not
    fit). `balance.split_single_pool` over them matches `choose_split`.
    """

    def p_gen(x: int) -> float:
        return math.inf if x % tp else gen_batch_seconds(costs, x, tp, batch)

    def p_train(y: int) -> float:
        return train_batch_seconds(costs, y, batch) if costs.train_fits(y) else math.inf

    return p_gen, p_train


def choose_split(
    costs: CostSource, devices: int, granularity: int, tp: int, batch: ProbeBatch
) -> tuple[Split, list[Split]]:
    """Algorithm 1: the split minimising max(T_gen, T_train), and every candidate tried.

    Raises:
      ValueError: if no split on the granularity leaves a trainer the state fits on.
    """
    candidates = [
        predict_stage_times(costs, x, devices - x, tp, batch)
        for x in range(granularity, devices, granularity)
        if not x % tp and costs.train_fits(devices - x)
    ]
    if not candidates:
        raise ValueError(
            f"Scenario.devices ({devices}): no split on granularity {granularity} leaves "
            "both stages room (the training state does not fit, or too few devices)"
        )
    best = min(candidates, key=lambda s: (max(s.t_gen, s.t_train), s.t_gen + s.t_train))
    return best, candidates
