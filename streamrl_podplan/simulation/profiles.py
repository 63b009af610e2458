"""Measured stage profiles -> predicted samples/s per mode (validation against real runs).

A profile is a JSON file written by a benchmark (`tools/bench_pipeline.py`) that
measured each stage alone; `predict(profile)` feeds those times to the same schedules as
the roofline simulation, so its prediction can be compared with the samples/s the
benchmark measured for each mode. Format (documented with an example in
docs/podplan.md; every field in seconds or tokens):

    {
      "global_batch": 16,                 # samples per training step
      "iterations": 4, "warmup": 1,       # simulated steps, steps excluded from the rate
      "gen_instances": 1,                 # generation instances (disaggregated modes)
      "colocated_instances": 1,           # generation instances when colocated
      "slots": 8,                         # KV-cache slots per instance
      "dispatch": "random",               # or "skew_aware" (stream modes)
      "ranker_recall": 1.0,
      "decode": {
        "batch_sizes": [1, 2, 4, 8],      # measured decode batch sizes, ascending
        "per_token_s": [...],             # seconds per decode step at each batch size
        "per_context_token_s": 0.0,       # optional: extra step seconds per context token
        "prefill_s_per_token": 0.0,       # optional: prefill seconds per prompt token
        "chunk_steps": 1                  # optional: the engine admits and retires only
                                          # every chunk_steps decode steps, so a sample
                                          # holds its slot for its length rounded up
      },
      "train": {
        "seconds_per_token": 1e-4,        # trainer seconds per (prompt + response) token
        "optimizer_s": 0.05,              # per training step
        "min_microbatch_tokens": 512
      },
      "weight_sync_s": 0.2,               # trainer -> generation transfer, per step
      "switch_s": [0.0, 0.0],             # colocated (gen -> train, train -> gen) switches
      "colocated_scale": {"decode": 0.65, "train": 0.65},  # time multipliers when one
                                          # process owns every device (DESIGN.md s.5)
      "lengths": {"prompt": [...], "response": [...]},      # the replayed trace
      "group_size": 4, "share_prefill": true,  # optional: consecutive group_size samples
                                          # share a prompt, prefilled once while one of
                                          # them holds a slot (generation.share_prefill)
      "measured_samples_per_s": {"colocated": 1.2, ...}     # optional, for comparison
    }
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from streamrl_podplan.simulation import generation
from streamrl_podplan.simulation.inflight import run_inflight
from streamrl_podplan.simulation.pipeline import run_schedule
from streamrl_podplan.simulation.scenario import MODES


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"profile field {where}{key} is missing")
    return d[key]


@dataclasses.dataclass(frozen=True)
class TableDecode:
    """Decode cost from a measured per-token latency table (linear interpolation in batch)."""

    batch_sizes: np.ndarray
    per_token_s: np.ndarray
    per_context_token_s: float = 0.0
    prefill_s_per_token: float = 0.0
    scale: float = 1.0

    def ptl(self, batch: int) -> float:
        bs, pt = self.batch_sizes, self.per_token_s
        if len(bs) > 1 and batch > bs[-1]:  # extrapolate the last measured slope
            slope = (pt[-1] - pt[-2]) / (bs[-1] - bs[-2])
            return float(pt[-1] + slope * (batch - bs[-1]))
        return float(np.interp(batch, bs, pt))

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        ctx_sum = steps * ctx0 + batch * steps * (steps - 1) / 2.0
        return self.scale * (steps * self.ptl(batch) + self.per_context_token_s * ctx_sum)

    def prefill_time(self, tokens: float) -> float:
        return self.scale * self.prefill_s_per_token * tokens


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
    """`stages.CostSource` backed by a measured profile (one per colocated / disaggregated)."""

    decode: TableDecode
    slots: int
    train_s_per_token: float
    optimizer_s: float
    min_tokens: int
    sync_s: float
    switch: tuple[float, float]
    share_group: int = 1  # "share_prefill": a group's samples prefill their prompt once

    def instance(self) -> generation.InstanceSpec:
        return generation.InstanceSpec(
            cost=self.decode, slots=self.slots, share_group=self.share_group
        )

    def train_seconds(self, prompt: np.ndarray, resp: np.ndarray, devices: int) -> np.ndarray:
        del devices  # measured on the profile's own trainer devices
        return self.train_s_per_token * (prompt + resp).astype(np.float64)

    def optimizer_seconds(self, devices: int) -> float:
        return self.optimizer_s

    def min_microbatch_tokens(self, devices: int) -> int:
        return self.min_tokens

    def train_fits(self, devices: int) -> bool:
        return True

    def weight_sync_seconds(self, train_devices: int) -> float:
        return self.sync_s

    def switch_seconds(self) -> tuple[float, float]:
        return self.switch


def load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def costs_from_profile(profile: dict[str, Any], colocated: bool) -> MeasuredCosts:
    """Builds the cost source of one side (colocated or disaggregated) of a profile."""
    dec = _need(profile, "decode", "")
    trn = _need(profile, "train", "")
    bs = np.asarray(_need(dec, "batch_sizes", "decode."), dtype=np.float64)
    pt = np.asarray(_need(dec, "per_token_s", "decode."), dtype=np.float64)
    if bs.ndim != 1 or bs.shape != pt.shape or len(bs) == 0 or np.any(np.diff(bs) <= 0):
        raise ValueError(
            "profile fields decode.batch_sizes / decode.per_token_s must be equal-length, "
            "non-empty, and batch_sizes strictly ascending"
        )
    if np.any(pt <= 0):
        raise ValueError("profile field decode.per_token_s must be > 0")
    scale = profile.get("colocated_scale", {}) if colocated else {}
    slots = int(_need(profile, "slots", ""))
    if slots < 1:
        raise ValueError(f"profile field slots must be >= 1, got {slots}")
    return MeasuredCosts(
        decode=TableDecode(
            batch_sizes=bs,
            per_token_s=pt,
            per_context_token_s=float(dec.get("per_context_token_s", 0.0)),
            prefill_s_per_token=float(dec.get("prefill_s_per_token", 0.0)),
            scale=float(scale.get("decode", 1.0)),
        ),
        slots=slots,
        train_s_per_token=float(_need(trn, "seconds_per_token", "train."))
        * float(scale.get("train", 1.0)),
        optimizer_s=float(trn.get("optimizer_s", 0.0)),
        min_tokens=int(trn.get("min_microbatch_tokens", 0)),
        sync_s=float(profile.get("weight_sync_s", 0.0)),
        switch=tuple(float(x) for x in profile.get("switch_s", (0.0, 0.0))),
        share_group=int(profile.get("group_size", 1)) if profile.get("share_prefill") else 1,
    )


def _replay(prompt: np.ndarray, resp: np.ndarray, batch: int, iterations: int) -> list:
    """The trace in order, `batch` samples a step, wrapping around when it is shorter."""
    idx = np.arange(batch * iterations) % resp.size
    return [
        (prompt[idx[i * batch : (i + 1) * batch]], resp[idx[i * batch : (i + 1) * batch]])
        for i in range(iterations)
    ]


def _inflight(profile: dict[str, Any], prompt: np.ndarray, resp: np.ndarray, chunk: int) -> float:
    """The in-flight mode (simulation/inflight.py) on the profile's measured costs; its
    settings from the profile's `inflight` section (budget tokens, staleness, and its own
    iterations and warmup: its rounds take longer to fill) and `group_size`."""
    spec = _need(profile, "inflight", "")
    warmup = int(spec.get("warmup", profile.get("warmup", 1)))
    batches = _replay(prompt, resp, int(profile.get("global_batch", resp.size)),
                      int(spec.get("iterations", profile.get("iterations", 2))))  # fmt: skip
    res = run_inflight(
        costs=costs_from_profile(profile, False),
        batches=batches,
        gen_devices=int(profile.get("gen_instances", 1)),
        train_devices=int(profile.get("train_devices", 1)),
        tp=1,
        budget=int(_need(spec, "budget_tokens", "inflight.")),
        staleness=int(spec.get("staleness", 1)),
        warmup=warmup,
        group_size=int(profile.get("group_size", 1)),
        chunk=chunk,
    )
    return res.samples_per_s


def predict(profile: dict[str, Any], modes: tuple[str, ...] = MODES, seed: int = 0) -> dict:
    """Predicted samples/s per mode for a measured profile (and the measured ones, if any)."""
    lens = _need(profile, "lengths", "")
    prompt = np.asarray(_need(lens, "prompt", "lengths."), dtype=np.int64)
    resp = np.asarray(_need(lens, "response", "lengths."), dtype=np.int64)
    if prompt.shape != resp.shape or resp.size == 0 or np.any(resp < 1):
        raise ValueError("profile fields lengths.prompt / lengths.response: equal, non-empty, >0")
    batch = int(profile.get("global_batch", resp.size))
    iterations = int(profile.get("iterations", max(2, resp.size // batch)))
    warmup = int(profile.get("warmup", 1))
    if batch < 1 or not 0 <= warmup < iterations:
        raise ValueError("profile fields global_batch >= 1 and 0 <= warmup < iterations")
    rng = np.random.default_rng(seed)
    batches = _replay(prompt, resp, batch, iterations)
    chunk = int(_need(profile, "decode", "").get("chunk_steps", 1))
    if chunk < 1:
        raise ValueError(f"profile field decode.chunk_steps must be >= 1, got {chunk}")
    gen_lengths = [-(-r // chunk) * chunk for _, r in batches]
    out: dict[str, Any] = {"predicted_samples_per_s": {}}
    for mode in modes:
        if mode == "inflight":
            out["predicted_samples_per_s"][mode] = _inflight(profile, prompt, resp, chunk)
            continue
        colocated = mode == "colocated"
        costs = costs_from_profile(profile, colocated)
        key = "colocated_instances" if colocated else "gen_instances"
        n_inst = int(profile.get(key, profile.get("gen_instances", 1)))
        kind = profile.get("dispatch", "random") if mode.startswith("stream") else "random"
        plans, recent = [], gen_lengths[0]
        for r in gen_lengths:
            plans.append(
                generation.plan_batch(
                    costs.instance(),
                    n_inst,
                    r,
                    recent,
                    dispatch_kind=kind,
                    ranker_recall=float(profile.get("ranker_recall", 1.0)),
                    alpha=0.2,
                    objective="max",
                    rng=rng,
                )
            )
            recent = r
        res = run_schedule(
            mode=mode,
            costs=costs,
            batches=batches,
            plans=plans,
            gen_devices=n_inst,
            train_devices=int(profile.get("train_devices", 1)),
            tp=1,
            warmup=warmup,
            gen_lengths=gen_lengths,
        )
        out["predicted_samples_per_s"][mode] = res.samples_per_s
    measured = profile.get("measured_samples_per_s")
    if measured:
        out["measured_samples_per_s"] = measured
        out["rel_error"] = {
            m: out["predicted_samples_per_s"][m] / v - 1.0
            for m, v in measured.items()
            if m in out["predicted_samples_per_s"]
        }
    return out
