"""The simulator's stage costs rescaled by what the compiler says the programs cost.

`streamrl_podplan.plan` compiles the project's own executables for a pod that is not attached
and reads, per device, each one's FLOPs and bytes accessed (`cost_analysis`). Those put a
time on each program by the same roofline the simulator uses
(`max(flops / (peak * mfu), bytes / (hbm_bw * efficiency))`, with `CostParams`' constants),
at the one operating point compiled. `CompiledCosts` is a `stages.CostSource` whose every
stage is the roofline model's, multiplied by the compiled time over the roofline time at
that point: the shape of each curve (batch, context, devices) stays the model's, its
level is the compiled program's. So a program that reads its KV cache several times a
step, recomputes activations (remat) or carries padding shows up in the predicted step
time, where the hand-written formulas would not see it.

XLA counts a while loop's body once: a decode chunk's cost is one decode step's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_podplan.simulation import cost_model, generation, stages
from streamrl_podplan.simulation.hardware import Hardware


def roofline_seconds(flops: float, bytes_: float, hw: Hardware, mfu: float, eff: float) -> float:
    """One device's seconds for a program of `flops` and `bytes_` (per device)."""
    return max(flops / (hw.peak_flops * mfu), bytes_ / (hw.hbm_bw * eff))


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per-device FLOPs and bytes of the compiled programs, and the point they were compiled at.

    Attributes:
      decode_flops, decode_bytes: one decode step of `slots` sequences over a cache of
        `max_len` positions on an instance of `instance_tp` devices.
      prefill_flops, prefill_bytes: one prefill call of `prefill_batch` prompts of
        `max_prompt` tokens.
      train_flops, train_bytes: one `accumulate` of `rows` x `seq` tokens on
        `train_devices` devices; both 0 when not analysed (the training time is then
        the roofline's own: `train_scale` 1).
      apply_bytes: one optimizer `apply` on `train_devices` devices.
    """

    decode_flops: float
    decode_bytes: float
    prefill_flops: float
    prefill_bytes: float
    train_flops: float
    train_bytes: float
    apply_bytes: float
    instance_tp: int
    slots: int
    max_len: int
    prefill_batch: int
    max_prompt: int
    train_devices: int
    rows: int
    seq: int


@dataclasses.dataclass(frozen=True)
class _ScaledDecode:
    inner: generation.DecodeCost
    decode: float
    prefill: float

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        return self.decode * self.inner.segment_time(batch, ctx0, steps)

    def prefill_time(self, tokens: float) -> float:
        return self.prefill * self.inner.prefill_time(tokens)


@dataclasses.dataclass(frozen=True)
class CompiledCosts:
    """`stages.CostSource`: `base` with each stage scaled to its compiled cost.

    `train_fits(y)` holds from the compiled training mesh up: more devices shard the
    state further at the same rows per device (never checked below it)."""

    base: stages.RooflineCosts
    decode_scale: float
    prefill_scale: float
    train_scale: float
    apply_device_seconds: float  # seconds x devices of one optimizer apply
    min_train_devices: int

    @classmethod
    def from_compiled(cls, base: stages.RooflineCosts, c: Compiled) -> CompiledCosts:
        m, hw, prm = base.model, base.hw, base.params
        if base.tp != c.instance_tp or base.slots != c.slots:
            raise ValueError(
                f"CompiledCosts: the roofline's instance (TP {base.tp}, {base.slots} slots) is "
                f"not the compiled one (TP {c.instance_tp}, {c.slots} slots)"
            )
        eff = prm.hbm_efficiency
        ctx = float(c.slots * c.max_len)  # the compiled step attends over the whole cache
        overhead = prm.step_overhead_s + cost_model.tp_comm_time(m, hw, c.instance_tp, c.slots, prm)
        step = overhead + roofline_seconds(c.decode_flops, c.decode_bytes, hw, prm.decode_mfu, eff)
        model_step = cost_model.decode_step_time(m, hw, c.instance_tp, c.slots, ctx, prm)
        prefill = roofline_seconds(c.prefill_flops, c.prefill_bytes, hw, prm.prefill_mfu, eff)
        model_prefill = c.prefill_batch * cost_model.prefill_time(
            m, hw, c.instance_tp, c.max_prompt, prm
        )
        # accumulate is the policy's forward and backward (3 forwards' worth, more with
        # remat); the roofline's train time counts FLOP_FACTORS[algorithm] forwards.
        # No training figures (0: not analysed): the roofline's own training time.
        fwd_bwd = 3.0 * m.forward_flops(float(c.seq), c.seq / 2.0) * c.rows
        model_train = fwd_bwd / (c.train_devices * hw.peak_flops * prm.train_mfu)
        train = model_train
        if c.train_flops or c.train_bytes:
            train = roofline_seconds(c.train_flops, c.train_bytes, hw, prm.train_mfu, eff)
        apply = c.apply_bytes / (hw.hbm_bw * eff)
        return cls(
            base=base,
            decode_scale=step / model_step,
            prefill_scale=prefill / model_prefill,
            train_scale=train / model_train,
            apply_device_seconds=apply * c.train_devices,
            min_train_devices=c.train_devices,
        )

    def instance(self) -> generation.InstanceSpec:
        spec = self.base.instance()
        scaled = _ScaledDecode(spec.cost, self.decode_scale, self.prefill_scale)
        return dataclasses.replace(spec, cost=scaled)

    def train_seconds(self, prompt: np.ndarray, resp: np.ndarray, devices: int) -> np.ndarray:
        return self.train_scale * self.base.train_seconds(prompt, resp, devices)

    def optimizer_seconds(self, devices: int) -> float:
        return self.apply_device_seconds / devices

    def min_microbatch_tokens(self, devices: int) -> int:
        return self.base.min_microbatch_tokens(devices)

    def train_fits(self, devices: int) -> bool:
        return devices >= self.min_train_devices

    def weight_sync_seconds(self, train_devices: int) -> float:
        return self.base.weight_sync_seconds(train_devices)

    def switch_seconds(self) -> tuple[float, float]:
        return self.base.switch_seconds()
