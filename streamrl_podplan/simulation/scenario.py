"""What one simulation run describes: model, pod, mode, batch, lengths, dispatch.

`Scenario` is validated once at construction; every impossible value raises a ValueError
that names the field (`Scenario.devices`, `Scenario.max_batch`, ...).
"""

from __future__ import annotations

import dataclasses
import math

from streamrl_jax.scheduling.dispatch import OBJECTIVES
from streamrl_jax.scheduling.lengths import LengthTrace
from streamrl_podplan.simulation import cost_model
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.dispatch import DISPATCHES
from streamrl_podplan.simulation.hardware import Hardware, Model

MODES = ("colocated", "disaggregated_batch", "stream_sync", "stream_async")
# stream_async with in-flight weight updates and partial rollout (simulation/inflight.py)
INFLIGHT = "inflight"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """One RL iteration stream on one pod.

    Attributes:
      mode: one of MODES, or INFLIGHT.
      model: the policy model (critic and reference have the same shape).
      hw: accelerator type.
      devices: accelerators in the pod.
      trace: response / prompt length distribution.
      global_batch: samples per training step.
      algorithm: "ppo" (actor, critic, reference) or "grpo" (actor, reference).
      gen_devices: devices of the generation stage in disaggregated modes; None = choose by
        Algorithm 1 (minimise max(T_gen, T_train)) over multiples of `split_granularity`.
      split_granularity: device-split step; None = one node (hw.devices_per_node).
      gen_tp: tensor-parallel degree of one generation instance; None = smallest power of two
        whose weights take at most `params.weights_per_device_fraction` of its HBM.
      max_batch: KV-cache slots per instance; None = as many as the KV cache holds at the
        maximum sequence length (capped by params.max_num_seqs). Must fit the KV cache.
      dispatch: "random", "skew_aware", or "auto" (skew-aware in stream modes, random in
        colocated / disaggregated_batch, as in the paper's comparison).
      ranker_recall: recall@alpha of the modelled length ranker (paper 7B ranker: 0.87).
      alpha: long-tail share for skew-aware dispatch.
      dispatch_objective: "max" or "sum" of the two groups' predicted latencies.
      staleness: policy lag of stream_async (the paper's StreamRL-Async is 1).
      partial_budget_tokens: INFLIGHT: tokens per sample per round; None = a quarter of
        the trace's longest response.
      iterations: training steps simulated.
      warmup: first steps excluded from throughput (pipeline fill).
      seed: seed of the length draws and the dispatch / ranker randomness.
      params: calibration constants.
    """

    mode: str
    model: Model
    hw: Hardware
    devices: int
    trace: LengthTrace
    global_batch: int = 1024
    algorithm: str = "ppo"
    gen_devices: int | None = None
    split_granularity: int | None = None
    gen_tp: int | None = None
    max_batch: int | None = None
    dispatch: str = "auto"
    ranker_recall: float = 0.87
    alpha: float = 0.2
    dispatch_objective: str = "max"
    staleness: int = 1
    partial_budget_tokens: int | None = None
    iterations: int = 5
    warmup: int = 2
    seed: int = 0
    params: CostParams = dataclasses.field(default_factory=CostParams)

    def __post_init__(self):
        if self.mode not in (*MODES, INFLIGHT):
            raise ValueError(
                f"Scenario.mode must be one of {(*MODES, INFLIGHT)}, got {self.mode!r}"
            )
        if self.partial_budget_tokens is not None and self.partial_budget_tokens < 1:
            raise ValueError(
                f"Scenario.partial_budget_tokens must be >= 1, got {self.partial_budget_tokens}"
            )
        if self.devices < 1:
            raise ValueError(f"Scenario.devices must be >= 1, got {self.devices}")
        if self.global_batch < 1:
            raise ValueError(f"Scenario.global_batch must be >= 1, got {self.global_batch}")
        if self.algorithm not in cost_model.FLOP_FACTORS:
            raise ValueError(
                f"Scenario.algorithm must be one of {sorted(cost_model.FLOP_FACTORS)}, "
                f"got {self.algorithm!r}"
            )
        if self.dispatch not in (*DISPATCHES, "auto"):
            raise ValueError(
                f"Scenario.dispatch must be one of {(*DISPATCHES, 'auto')}, got {self.dispatch!r}"
            )
        if not 0 < self.ranker_recall <= 1:
            raise ValueError(f"Scenario.ranker_recall must be in (0, 1], got {self.ranker_recall}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"Scenario.alpha must be in (0, 1), got {self.alpha}")
        if self.dispatch_objective not in OBJECTIVES:
            raise ValueError(
                f"Scenario.dispatch_objective must be one of {OBJECTIVES}, "
                f"got {self.dispatch_objective!r}"
            )
        if self.staleness < 1:
            raise ValueError(f"Scenario.staleness must be >= 1, got {self.staleness}")
        if self.iterations < 1 or not 0 <= self.warmup < self.iterations:
            raise ValueError(
                f"Scenario.iterations ({self.iterations}) must be >= 1 and Scenario.warmup "
                f"({self.warmup}) in [0, iterations)"
            )
        if self.split_granularity is not None and self.split_granularity < 1:
            raise ValueError(
                f"Scenario.split_granularity must be >= 1, got {self.split_granularity}"
            )
        tp = self.tp
        if tp < 1 or self.devices % tp:
            raise ValueError(f"Scenario.gen_tp ({tp}) must be >= 1 and divide devices")
        if self.disaggregated and self.gen_devices is not None:
            if not 0 < self.gen_devices < self.devices:
                raise ValueError(
                    f"Scenario.gen_devices must be in (0, devices={self.devices}), "
                    f"got {self.gen_devices}"
                )
            if self.gen_devices % tp:
                raise ValueError(
                    f"Scenario.gen_devices ({self.gen_devices}) must be a multiple of gen_tp ({tp})"
                )
        if self.disaggregated and self.devices < 2:
            raise ValueError(f"Scenario.devices must be >= 2 for mode {self.mode!r}")
        capacity = cost_model.max_slots(
            self.model, self.hw, tp, self.trace.max_seq_len, self.params, self.resident_per_device
        )
        if self.max_batch is not None:
            if self.max_batch < 1:
                raise ValueError(f"Scenario.max_batch must be >= 1, got {self.max_batch}")
            if self.max_batch > capacity:
                raise ValueError(
                    f"Scenario.max_batch ({self.max_batch}) exceeds the KV-cache capacity of one "
                    f"instance ({capacity} sequences of {self.trace.max_seq_len} tokens, "
                    f"{self.model.name} on {tp} x {self.hw.name})"
                )
        elif capacity < 1:
            raise ValueError(
                f"Scenario.trace.max_len: one {self.trace.max_seq_len}-token sequence does not "
                f"fit the KV cache of {tp} x {self.hw.name} for {self.model.name}; raise gen_tp"
            )

    @property
    def budget(self) -> int:
        """INFLIGHT: tokens per sample per round."""
        return self.partial_budget_tokens or -(-self.trace.max_len // 4)

    @property
    def disaggregated(self) -> bool:
        return self.mode != "colocated"

    @property
    def tp(self) -> int:
        if self.gen_tp is not None:
            return self.gen_tp
        return cost_model.auto_tp(self.model, self.hw, self.params)

    @property
    def slots(self) -> int:
        if self.max_batch is not None:
            return self.max_batch
        return cost_model.max_slots(
            self.model,
            self.hw,
            self.tp,
            self.trace.max_seq_len,
            self.params,
            self.resident_per_device,
        )

    @property
    def resident_per_device(self) -> float:
        """HBM bytes per device held by other state while generating.

        Colocated: the trainer's state (fp32 master + Adam per trained model, BF16 reference)
        stays resident, sharded over all devices, and shrinks the KV cache; disaggregated
        generation devices hold only the served weights.
        """
        if self.disaggregated:
            return 0.0
        return cost_model.train_state_bytes(self.model, self.algorithm) / self.devices

    @property
    def granularity(self) -> int:
        g = self.split_granularity or self.hw.devices_per_node
        # A split must also hold whole generation instances.
        return math.lcm(g, self.tp)

    @property
    def resolved_dispatch(self) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        return "skew_aware" if self.mode.startswith("stream") else "random"
