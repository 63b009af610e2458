"""Roofline cost model for decode steps, prefill, training and weight transfer.

The calibration constants are global (one value for every setting, model and mode) and each
has a physical reading. `CostParams` documents where each default comes from; the Fig. 8
calibration in `calibrate.py` uses exactly these defaults.

Decode step of one generation instance (tensor parallel over `tp` devices), batch B, total
context S = sum of the running sequences' lengths:

    t_step = overhead + tp_comm + max(bytes / (tp * hbm_bw * hbm_eff),
                                      flops / (tp * peak * decode_mfu))
    bytes  = weight_bytes + kv_bytes_per_token * S
    flops  = 2 * matmul_params * B + 4 * layers * n_heads * head_dim * S
    tp_comm = 2 * layers * (allreduce_latency + 2 (tp - 1) / tp * B * d_model * 2 / link_bw)
              (tp > 1: two ring all-reduces of the BF16 activations per block)

Training time of a sequence of T tokens on `y` devices:

    t = flop_factor * forward_flops(T, T / 2) / (y * peak * train_mfu)

with flop_factor = 9 for PPO (actor fwd+bwd 3, critic fwd+bwd 3, old log-probs 1, reference
1, values 1, in units of one forward) and 5 for GRPO (no critic).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl_podplan.simulation.hardware import Hardware, Model

# Units of one forward pass per trained token.
FLOP_FACTORS = {"ppo": 9.0, "grpo": 5.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostParams:
    """Global calibration constants. Defaults are the calibrated values.

    Attributes:
      hbm_efficiency: achieved / peak HBM bandwidth in decode. 0.65 is fitted to the paper's
        7B PTL curve (H800, TP 1) together with `step_overhead_s`; vLLM-class engines reach
        55-75% of peak bandwidth in decode.
      step_overhead_s: fixed host + kernel-launch time per decode step (scheduler, sampling,
        CUDA-graph launch); fitted jointly (1.5 ms; the fit assumes 2K tokens of context per
        sequence, RMS error 2.3% over BS 1-512).
      decode_mfu: achieved / peak FLOP/s for the compute-bound part of decode (large batches).
      prefill_mfu: achieved / peak FLOP/s for prompt prefill.
      allreduce_latency_s: one small tensor-parallel all-reduce in decode (NVLink one-shot
        all-reduce of a few hundred KB is 5-15 us).
      train_mfu: achieved / peak FLOP/s of the trainer (Megatron/FSDP on H800 with long
        sequences: 35-45%).
      train_min_tokens_per_device: tokens a trainer micro-batch needs per device before it
        starts (the paper's "enough samples to saturate the GPUs"; one 4K-token sequence
        per device).
      kv_memory_fraction: share of instance HBM the engine may use for weights + KV cache
        (vLLM's gpu_memory_utilization default 0.9).
      max_num_seqs: hard cap on running sequences per instance (vLLM default 256).
      net_efficiency: achieved / peak network bandwidth for weight transfer.
      transfer_latency_s: fixed cost per weight transfer (handshake, barrier, engine swap).
      switch_overhead_s: fixed cost of a colocated stage switch per direction (free / re-create
        the KV cache, offload / onload the optimizer state, wake the engine), as in verl's
        hybrid engine. Charged twice per colocated iteration.
      weights_per_device_fraction: TP is the smallest power of two such that the BF16 weights
        take at most this share of the instance's HBM (the rest is KV cache).
    """

    hbm_efficiency: float = 0.65
    step_overhead_s: float = 1.5e-3
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.5
    allreduce_latency_s: float = 8e-6
    train_mfu: float = 0.4
    train_min_tokens_per_device: int = 4096
    kv_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    net_efficiency: float = 0.7
    transfer_latency_s: float = 0.5
    switch_overhead_s: float = 2.0
    weights_per_device_fraction: float = 0.25

    def __post_init__(self):
        for field in (
            "hbm_efficiency",
            "decode_mfu",
            "prefill_mfu",
            "train_mfu",
            "kv_memory_fraction",
            "net_efficiency",
            "weights_per_device_fraction",
        ):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"CostParams.{field} must be in (0, 1], got {value!r}")
        for field in (
            "step_overhead_s",
            "allreduce_latency_s",
            "transfer_latency_s",
            "switch_overhead_s",
        ):
            if getattr(self, field) < 0:
                raise ValueError(f"CostParams.{field} must be >= 0, got {getattr(self, field)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"CostParams.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.train_min_tokens_per_device < 0:
            raise ValueError("CostParams.train_min_tokens_per_device must be >= 0")


def auto_tp(model: Model, hw: Hardware, params: CostParams) -> int:
    """Smallest power-of-two tensor-parallel degree leaving room for the KV cache."""
    tp = 1
    while model.weight_bytes > params.weights_per_device_fraction * tp * hw.hbm_bytes:
        tp *= 2
        if tp > hw.devices_per_node:
            raise ValueError(f"model {model.name} does not fit one node of {hw.name}")
    return tp


def kv_capacity_tokens(
    model: Model, hw: Hardware, tp: int, params: CostParams, resident_per_device: float = 0.0
) -> int:
    """KV-cache tokens one instance of `tp` devices can hold after its weights.

    `resident_per_device` is other state that stays in HBM during generation (the training
    state of a colocated pod).
    """
    free = (
        params.kv_memory_fraction * tp * hw.hbm_bytes
        - model.weight_bytes
        - tp * resident_per_device
    )
    if free <= 0:
        raise ValueError(
            f"tp={tp}: {model.name} weights ({model.weight_bytes / 1e9:.1f} GB) plus resident "
            f"state exceed {params.kv_memory_fraction:.0%} of {tp} x {hw.name} HBM"
        )
    return int(free // model.kv_bytes_per_token)


def max_slots(
    model: Model,
    hw: Hardware,
    tp: int,
    max_seq_len: int,
    params: CostParams,
    resident_per_device: float = 0.0,
) -> int:
    """Concurrent sequences when each slot reserves `max_seq_len` tokens of KV cache.

    This is the fixed-slot engine of DESIGN.md (slot count x maximum length) and the
    paper's BS_max(L).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    capacity = kv_capacity_tokens(model, hw, tp, params, resident_per_device)
    return min(params.max_num_seqs, capacity // max_seq_len)


def decode_step_time(
    model: Model,
    hw: Hardware,
    tp: int,
    batch: int | float,
    total_context: float,
    params: CostParams,
) -> float:
    """Seconds for one decode step of `batch` sequences holding `total_context` tokens."""
    bytes_ = model.weight_bytes + model.kv_bytes_per_token * total_context
    mem_t = bytes_ / (tp * hw.hbm_bw * params.hbm_efficiency)
    attn = 4.0 * model.layers * model.n_heads * model.head_dim * total_context
    flops = 2.0 * model.matmul_params * batch + attn
    compute_t = flops / (tp * hw.peak_flops * params.decode_mfu)
    comm_t = tp_comm_time(model, hw, tp, batch, params)
    return params.step_overhead_s + comm_t + max(mem_t, compute_t)


def tp_comm_time(model: Model, hw: Hardware, tp: int, batch: float, params: CostParams) -> float:
    """Tensor-parallel all-reduce seconds per decode step (latency + ring bandwidth term)."""
    if tp == 1:
        return 0.0
    msg = batch * model.d_model * 2.0  # BF16 activations of one all-reduce
    ring = 2.0 * (tp - 1) / tp * msg / (hw.link_bw * params.net_efficiency)
    return 2 * model.layers * (params.allreduce_latency_s + ring)


def per_token_latency(
    model: Model, hw: Hardware, tp: int, batch: int, context: float, params: CostParams
) -> float:
    """PTL(BS) of the paper: decode step time when every sequence holds `context` tokens."""
    return decode_step_time(model, hw, tp, batch, batch * context, params)


def prefill_time(model: Model, hw: Hardware, tp: int, tokens: float, params: CostParams) -> float:
    """Seconds to prefill `tokens` prompt tokens (compute bound, causal attention)."""
    flops = model.forward_flops(tokens, tokens / 2.0)
    return flops / (tp * hw.peak_flops * params.prefill_mfu)


def train_time(
    model: Model,
    hw: Hardware,
    devices: int,
    seq_tokens: float | np.ndarray,
    algorithm: str,
    params: CostParams,
) -> float:
    """Seconds of trainer time for one sequence of `seq_tokens` tokens on `devices` devices."""
    if algorithm not in FLOP_FACTORS:
        raise ValueError(f"algorithm must be one of {sorted(FLOP_FACTORS)}, got {algorithm!r}")
    flops = FLOP_FACTORS[algorithm] * model.forward_flops(seq_tokens, seq_tokens / 2.0)
    return flops / (devices * hw.peak_flops * params.train_mfu)


def train_state_bytes(model: Model, algorithm: str) -> float:
    """Trainer memory: fp32 master + Adam (16 B/param) per trained model, BF16 reference."""
    trained = 2 if algorithm == "ppo" else 1  # actor (+ critic)
    return model.params * (16.0 * trained + 2.0)


def weight_transfer_time(
    model: Model, hw: Hardware, train_devices: int, gen_tp: int, params: CostParams
) -> float:
    """Seconds to push new BF16 actor weights from the trainer to every generation instance.

    Pipelined broadcast: the trainer's shards leave over `train_devices` NICs, each instance
    receives the full copy over its `gen_tp` NICs; chunks are forwarded instance to
    instance, so the time is the bottleneck side, independent of the instance count.
    """
    bw = min(train_devices, gen_tp) * hw.net_bw * params.net_efficiency
    return params.transfer_latency_s + model.weight_bytes / bw


def colocated_switch_time(model: Model, hw: Hardware, params: CostParams) -> float:
    """Seconds of one colocated train -> generate -> train switch pair.

    The training layout (sharded) is all-gathered into the generation layout over the
    intra-node link each iteration, plus the fixed engine switch cost twice.
    """
    gather = model.weight_bytes / (hw.link_bw * params.net_efficiency)
    return gather / hw.devices_per_node + 2 * params.switch_overhead_s
