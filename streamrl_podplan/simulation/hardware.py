"""Hardware and model descriptions for the pod-scale simulator, with FLOP/byte formulas.

Everything here is a public spec sheet number or a count derived from a model's shapes;
nothing is calibrated. The calibrated efficiencies live in `cost_model.py`.

Hardware numbers are dense BF16 peak (no sparsity), HBM capacity and bandwidth, and the
per-device bandwidths a weight transfer can use: the intra-node link (NVLink / ICI) and the
per-device share of the inter-node network (for GPUs, one 400 Gb/s NIC per GPU, the usual
H800/H100 pod build; for TPUs the ICI links of a slice).
"""

from __future__ import annotations

import dataclasses

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator type.

    Attributes:
      name: preset name.
      peak_flops: dense BF16 FLOP/s of one device.
      hbm_bytes: HBM capacity of one device in bytes.
      hbm_bw: HBM bandwidth of one device in bytes/s.
      link_bw: intra-node (NVLink / ICI) bandwidth per device in bytes/s, one direction.
      net_bw: inter-node bandwidth per device in bytes/s, one direction.
      devices_per_node: devices that share a node (the granularity of device splits).
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    net_bw: float
    devices_per_node: int = 8

    def __post_init__(self):
        for field in ("peak_flops", "hbm_bytes", "hbm_bw", "link_bw", "net_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Hardware.{field} must be > 0, got {getattr(self, field)!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"Hardware.devices_per_node must be >= 1, got {self.devices_per_node}")


# Public spec sheets. H800 = H100 SXM compute and HBM with NVLink cut to 400 GB/s.
HARDWARE: dict[str, Hardware] = {
    "h800": Hardware(
        name="h800",
        peak_flops=989.5e12,
        hbm_bytes=80 * GB,
        hbm_bw=3.35 * TB,
        link_bw=200 * GB,
        net_bw=50 * GB,
    ),
    "h20": Hardware(
        name="h20",
        peak_flops=148e12,
        hbm_bytes=96 * GB,
        hbm_bw=4.0 * TB,
        link_bw=450 * GB,
        net_bw=50 * GB,
    ),
    "h100": Hardware(
        name="h100",
        peak_flops=989.5e12,
        hbm_bytes=80 * GB,
        hbm_bw=3.35 * TB,
        link_bw=450 * GB,
        net_bw=50 * GB,
    ),
    "h200": Hardware(
        name="h200",
        peak_flops=989.5e12,
        hbm_bytes=141 * GB,
        hbm_bw=4.8 * TB,
        link_bw=450 * GB,
        net_bw=50 * GB,
    ),
    # TPU v5e: 197 TFLOP/s, 16 GB at 819 GB/s, ICI 1600 Gb/s per chip; 8 chips per host.
    "tpu_v5e": Hardware(
        name="tpu_v5e",
        peak_flops=197e12,
        hbm_bytes=16 * GB,
        hbm_bw=819 * GB,
        link_bw=200 * GB,
        net_bw=200 * GB,
    ),
    # TPU v5p: 459 TFLOP/s, 95 GB at 2765 GB/s, ICI 4800 Gb/s per chip; 4 chips per host.
    "tpu_v5p": Hardware(
        name="tpu_v5p",
        peak_flops=459e12,
        hbm_bytes=95 * GB,
        hbm_bw=2765 * GB,
        link_bw=600 * GB,
        net_bw=600 * GB,
        devices_per_node=4,
    ),
    # TPU v6e (Trillium): 918 TFLOP/s, 32 GB at 1640 GB/s, ICI 3584 Gb/s per chip.
    "tpu_v6e": Hardware(
        name="tpu_v6e",
        peak_flops=918e12,
        hbm_bytes=32 * GB,
        hbm_bw=1640 * GB,
        link_bw=448 * GB,
        net_bw=448 * GB,
        devices_per_node=4,
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """Decoder-only transformer shapes (Llama / Qwen2 family).

    Attributes:
      name: preset name.
      layers: number of transformer blocks.
      d_model: hidden size.
      n_heads: query heads.
      n_kv_heads: key/value heads (GQA).
      head_dim: per-head dimension.
      d_ff: MLP intermediate size (SwiGLU: three matrices).
      vocab: vocabulary size.
      tied_embeddings: whether the LM head shares the embedding matrix.
      qkv_bias: whether q/k/v projections have biases (Qwen2 does).
      bytes_per_param: storage of weights for generation and transfer (2 = BF16).
    """

    name: str
    layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = True
    bytes_per_param: int = 2

    def __post_init__(self):
        for field in ("layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"Model.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Model.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})"
            )

    @property
    def block_params(self) -> int:
        """Parameters of the transformer blocks (what each decoded token multiplies through)."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = self.d_model * (q + 2 * kv) + q * self.d_model
        if self.qkv_bias:
            attn += q + 2 * kv
        mlp = 3 * self.d_model * self.d_ff
        return self.layers * (attn + mlp + 2 * self.d_model)

    @property
    def params(self) -> int:
        """All parameters, embeddings included."""
        emb = self.vocab * self.d_model * (1 if self.tied_embeddings else 2)
        return self.block_params + emb + self.d_model

    @property
    def matmul_params(self) -> int:
        """Parameters used as matmul weights per token: blocks plus the LM head."""
        return self.block_params + self.vocab * self.d_model

    @property
    def weight_bytes(self) -> float:
        return float(self.params * self.bytes_per_param)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token of context: K and V for every layer, BF16."""
        return float(2 * self.layers * self.n_kv_heads * self.head_dim * 2)

    def forward_flops(self, tokens: float, mean_context: float) -> float:
        """Forward FLOPs for `tokens` tokens that each attend to `mean_context` positions.

        2 FLOPs per matmul parameter per token, plus QK^T and AV: 2 * 2 * n_heads * head_dim
        per attended position per layer.
        """
        attn = 4.0 * self.layers * self.n_heads * self.head_dim * mean_context
        return tokens * (2.0 * self.matmul_params + attn)


MODELS: dict[str, Model] = {
    "qwen2.5-7b": Model(
        name="qwen2.5-7b",
        layers=28,
        d_model=3584,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        d_ff=18944,
        vocab=152064,
    ),
    "qwen2.5-32b": Model(
        name="qwen2.5-32b",
        layers=64,
        d_model=5120,
        n_heads=40,
        n_kv_heads=8,
        head_dim=128,
        d_ff=27648,
        vocab=152064,
    ),
    "qwen2.5-72b": Model(
        name="qwen2.5-72b",
        layers=80,
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        d_ff=29568,
        vocab=152064,
    ),
    "smollm2-135m": Model(
        name="smollm2-135m",
        layers=30,
        d_model=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        vocab=49152,
        tied_embeddings=True,
        qkv_bias=False,
    ),
    "smollm2-360m": Model(
        name="smollm2-360m",
        layers=32,
        d_model=960,
        n_heads=15,
        n_kv_heads=5,
        head_dim=64,
        d_ff=2560,
        vocab=49152,
        tied_embeddings=True,
        qkv_bias=False,
    ),
    "smollm2-1.7b": Model(
        name="smollm2-1.7b",
        layers=24,
        d_model=2048,
        n_heads=32,
        n_kv_heads=32,
        head_dim=64,
        d_ff=8192,
        vocab=49152,
        tied_embeddings=True,
        qkv_bias=False,
    ),
}


def get_hardware(name: str) -> Hardware:
    """Looks up a hardware preset by name; raises ValueError naming the valid ones."""
    if name not in HARDWARE:
        raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got {name!r}")
    return HARDWARE[name]


def get_model(name: str) -> Model:
    """Looks up a model preset by name; raises ValueError naming the valid ones."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]
