"""Event simulation of continuous-batching generation instances.

One instance runs decode steps over its running sequences; every step adds one token to
each. A sequence admitted at step k0 with response length L finishes at step k0 + L and
frees its KV-cache slot, which the next queued prompt takes (after its prefill). Between
two events (a completion or an admission) the batch B is constant and the total context
grows by B per step, so the decode time of the whole segment is a sum of
`decode_step_time` over a linearly growing context, computed in closed form
(`RooflineDecode.segment_time`) instead of step by step. That makes a 1024-sample,
20K-token batch cost ~2 events per sample, not ~10^5 Python steps.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Protocol

import numpy as np

from streamrl_podplan.simulation import cost_model, dispatch
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.hardware import Hardware, Model


class DecodeCost(Protocol):
    """Time model of one instance: the roofline below, or a measured profile (`profiles.py`)."""

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        """Seconds for `steps` decode steps of `batch` sequences from total context `ctx0`."""
        ...

    def prefill_time(self, tokens: float) -> float:
        """Seconds to prefill one prompt of `tokens` tokens."""
        ...


@dataclasses.dataclass(frozen=True)
class RooflineDecode:
    """`cost_model.decode_step_time` summed in closed form over a segment.

    Attributes:
      model: the served model.
      hw: accelerator type.
      tp: tensor-parallel degree (devices in the instance).
      params: calibration constants.
    """

    model: Model
    hw: Hardware
    tp: int
    params: CostParams

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"RooflineDecode.tp must be >= 1, got {self.tp}")

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        m, hw, prm, tp = self.model, self.hw, self.params, self.tp
        bw = tp * hw.hbm_bw * prm.hbm_efficiency
        fl = tp * hw.peak_flops * prm.decode_mfu
        kv = m.kv_bytes_per_token
        attn = 4.0 * m.layers * m.n_heads * m.head_dim
        # Memory term p1 + q1 * j and compute term p2 + q2 * j; context is ctx0 + batch * j.
        p1, q1 = (m.weight_bytes + kv * ctx0) / bw, kv * batch / bw
        p2 = (2.0 * m.matmul_params * batch + attn * ctx0) / fl
        q2 = attn * batch / fl
        comm = cost_model.tp_comm_time(m, hw, tp, batch, prm)
        total = steps * (prm.step_overhead_s + comm)
        if q1 == q2:
            return total + _sum_linear(max(p1, p2), q1, 0, steps)
        # Before j* the flatter line is the larger one, from j* on the steeper one.
        j_star = (p2 - p1) / (q1 - q2)
        cut = int(np.clip(np.ceil(j_star), 0, steps))
        lo, hi = ((p1, q1), (p2, q2)) if q1 < q2 else ((p2, q2), (p1, q1))
        return total + _sum_linear(*lo, 0, cut) + _sum_linear(*hi, cut, steps)

    def prefill_time(self, tokens: float) -> float:
        return cost_model.prefill_time(self.model, self.hw, self.tp, tokens, self.params)


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """One generation instance: its time model and its KV-cache slot count.

    `share_group` > 1 models shared-prompt prefill (`generation.share_prefill`): samples
    i // share_group of a batch share one prompt, and a sample admitted while another of
    its group holds a slot (or is admitted in the same wave) copies that prompt's KV
    instead of prefilling it (the copy's cost is taken as nil).
    """

    cost: DecodeCost
    slots: int
    share_group: int = 1

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(
                f"InstanceSpec.slots must be >= 1, got {self.slots} (KV cache smaller than one "
                "maximum-length sequence)"
            )


@dataclasses.dataclass(frozen=True)
class GenResult:
    """Timeline of one global batch, times relative to the batch's start, in seconds.

    Attributes:
      admit: f64[n] time each sample was admitted (prefill start).
      done: f64[n] time each sample completed.
      instance: i64[n] instance each sample ran on.
      instance_end: f64[n_instances] time each instance finished its last sample.
    """

    admit: np.ndarray
    done: np.ndarray
    instance: np.ndarray
    instance_end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.instance_end.max())


def _sum_linear(p: float, q: float, a: int, b: int) -> float:
    """Sum of p + q * j for integer j in [a, b)."""
    n = b - a
    return n * p + q * (a + b - 1) * n / 2.0 if n > 0 else 0.0


def run_instance(
    spec: InstanceSpec, order: list[int], prompt: np.ndarray, resp: np.ndarray
) -> tuple[dict[int, float], dict[int, float], float]:
    """Simulates one instance admitting `order` (sample indices) into its slots.

    Returns:
      (admit time per sample, completion time per sample, instance end time).
    """
    queue = list(reversed(order))  # pop() from the end = next to admit
    running: list[tuple[int, int]] = []  # heap of (finish step, sample)
    admit_t: dict[int, float] = {}
    done_t: dict[int, float] = {}
    t, step = 0.0, 0
    ctx_offset = 0.0  # sum over running of (prompt - admit step); context = this + B * step
    holding: dict[int, int] = {}  # shared prefill: group -> its samples holding a slot
    while queue or running:
        prefill_tokens = []
        while queue and len(running) < spec.slots:
            i = queue.pop()
            admit_t[i] = t
            heapq.heappush(running, (step + int(resp[i]), i))
            ctx_offset += float(prompt[i]) - step
            g = i // spec.share_group
            if spec.share_group == 1 or not holding.get(g):
                prefill_tokens.append(float(prompt[i]))
            holding[g] = holding.get(g, 0) + 1
        for p in prefill_tokens:
            t += spec.cost.prefill_time(p)
        next_step = running[0][0]
        batch = len(running)
        t += spec.cost.segment_time(batch, ctx_offset + batch * step, next_step - step)
        step = next_step
        while running and running[0][0] == step:
            _, i = heapq.heappop(running)
            done_t[i] = t
            holding[i // spec.share_group] -= 1
            ctx_offset -= float(prompt[i]) - (step - int(resp[i]))
    return admit_t, done_t, t


def simulate_batch(
    spec: InstanceSpec, plan: list[list[int]], prompt: np.ndarray, resp: np.ndarray
) -> GenResult:
    """Runs every instance of a dispatch `plan` on one global batch."""
    n = len(resp)
    admit = np.full(n, np.nan)
    done = np.full(n, np.nan)
    inst = np.full(n, -1, dtype=np.int64)
    ends = np.zeros(len(plan))
    for k, order in enumerate(plan):
        if not order:
            continue
        a, d, end = run_instance(spec, order, prompt, resp)
        for i, v in a.items():
            admit[i] = v
            inst[i] = k
        for i, v in d.items():
            done[i] = v
        ends[k] = end
    if np.isnan(done).any():
        raise ValueError("dispatch plan does not cover every sample exactly once")
    return GenResult(admit=admit, done=done, instance=inst, instance_end=ends)


def plan_batch(
    spec: InstanceSpec,
    n_instances: int,
    resp: np.ndarray,
    recent_resp: np.ndarray,
    *,
    dispatch_kind: str,
    ranker_recall: float,
    alpha: float,
    objective: str,
    rng: np.random.Generator,
) -> list[list[int]]:
    """Dispatch plan (admission order per instance) for one global batch."""
    if n_instances < 1:
        raise ValueError(f"n_instances must be >= 1, got {n_instances}")
    if dispatch_kind == "random":
        return dispatch.random_dispatch(len(resp), n_instances, rng)
    if dispatch_kind != "skew_aware":
        raise ValueError(f"dispatch must be one of {dispatch.DISPATCHES}, got {dispatch_kind!r}")
    scores = dispatch.ranker_scores(resp, ranker_recall, alpha, rng)

    def ptl(bs: int, ctx: float) -> float:
        return spec.cost.segment_time(bs, bs * ctx, 1)

    return dispatch.skew_aware_dispatch(
        scores, recent_resp, n_instances, spec.slots, ptl, alpha=alpha, objective=objective
    )
