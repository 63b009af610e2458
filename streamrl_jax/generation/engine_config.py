"""`EngineConfig`: the static shape and policy of one generation engine (`engine.py`)."""

from __future__ import annotations

import dataclasses

from streamrl_jax.generation import compact, quant

CPU_DOTS = ("auto", "eigen", "ynnpack")
# "auto" picks Eigen for the decode chunk of models at least this wide: faster for
# SmolLM2 (width 576), slower for the tiny model (width 64); BENCHMARKS.md "Decode step
# vs roofline".
EIGEN_MIN_WIDTH = 512
DECODE_ATTENTION = ("auto", "elementwise", "dot")
KEY_LAYOUTS = ("auto", "positions_minor", "head_dim_minor")
GATE_UP_LAYOUTS = ("auto", "embed_major", "parts_major")
MAX_TOP_LOGPROBS = 64  # alternatives per token an engine may return (OpenAI's API: 20)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static shape and policy of one engine.

    Attributes:
      num_slots: KV-cache rows = decode batch size.
      max_prompt_length: longest accepted prompt.
      max_total_length: prompt + response cap (KV-cache length); a sample that
        reaches it finishes with reason "context".
      chunk_steps: decode steps per host round trip.
      prefill_batch: prompts per prefill call (padded to this size).
      min_bucket: smallest prompt-length bucket; buckets double up to
        `max_prompt_length` (the last bucket is `max_prompt_length`).
      stop_ids: default stop ids for requests that set none.
      max_stop_ids: per-request stop-id capacity on the device.
      admission: "fifo" (submission order) or "lpt" (highest `priority` first,
        i.e. longest predicted output first; ties in submission order).
      refill: admit into freed slots as soon as they free (continuous
        batching); False waits until every slot is free (static batching).
      weight_dtype: the generation copy's matrices: "auto" (the model's compute
        dtype) or "int8" (per-channel int8, W8A8 matmuls: `quant.py`); the
        recorded behaviour log-probs are then the int8 model's.
      share_prefill: requests with the same prompt (a GRPO group) prefill it
        once; the others copy its KV and logits into their slots and sample
        their own first token (`admission.py`; samples are bitwise unchanged).
      decode_buckets: run each decode chunk on the smallest (batch, length)
        bucket covering the running slots (`compact.py`); False decodes every
        slot over the whole cache every step (one shape).
      min_decode_length: smallest length bucket; they double up to
        `max_total_length`.
      cpu_dots: on the CPU backend, which library runs the f32/bf16 matmuls of the
        decode chunk: "eigen" (XLA's own dot emitter; YNNPACK keeps the reductions),
        "ynnpack" (XLA:CPU's default in jaxlib 0.10.2 for every dot) or "auto"
        (Eigen for models of width >= EIGEN_MIN_WIDTH). Eigen is faster for SmolLM2's
        decode at 8-16 rows here, YNNPACK for prefill's many rows (which keeps it)
        and for narrow models (docs/generation.md, "Matmul library"). int8 engines
        always use YNNPACK (its s8 dot is the W8A8 kernel); other backends ignore this.
      decode_attention: how a decode step attends (`decoder.GenModel`): "elementwise"
        (broadcast products and sums, fused loops), "dot" (two batched einsums) or
        "auto" (elementwise on CPU, where XLA runs the batched dot as one tiny matmul
        per (slot, kv head): BENCHMARKS.md "Decode step vs roofline"; dot elsewhere).
      key_layout: the KV cache's keys (`decoder.LayerCache`): "positions_minor"
        ([B, K, D, S], what the fused CPU attention reads best), "head_dim_minor"
        ([B, K, S, D] as the values; a decode step's write stays in place on XLA:TPU,
        which copies the whole cache to scatter into a minor position axis) or "auto"
        (positions minor on CPU, head dims minor elsewhere: docs/generation.md,
        "Key layout on TPU").
      gate_up_layout: the fused gate and up matrix of the generation weights
        (`decoder.from_training_layout`): "embed_major" ([E, 2, M], one matmul that
        XLA:CPU reads in place), "parts_major" ([2, E, M]: XLA:TPU re-lays out the
        embed-major form, whose minor tile pads the 2, once per decode chunk, every
        layer's copy live at once) or "auto" (embed-major on CPU, parts-major
        elsewhere: docs/generation.md, "Key layout on TPU").
      kv_hold_s: a slot kept for a continuation (`GenerationRequest.keep_kv`: an
        episode waiting for its environment) is given up after this many seconds
        without one, once another request needs a slot; its continuation then
        re-prefills (counted: `Engine.metrics()["reprefilled"]`).
      record_routes: a mixture of experts records the experts every fed token went to
        in every layer and returns them with its sample (`Sample.routes`: routing
        replay, `model/routes.py`); refused for a dense model by the engine.
      adapters: LoRA adapter slots kept unmerged beside the base weights (a request
        names its slot: `GenerationRequest.adapter`; rows of different adapters decode
        in one batch: `adapters.py`); 0 (the default) merges a LoRA model's one adapter
        into the weights at each update, the fastest decode for one adapter
        (BENCHMARKS.md, "LoRA").
      top_logprobs: each sampled token comes with its position's k most likely tokens
        and their log-probs (`Sample.top_ids`, `Sample.top_logprobs`: the OpenAI API's
        `top_logprobs`); compiled into prefill and decode, 0 (the default) adds nothing
        to them. At most MAX_TOP_LOGPROBS.
    """

    num_slots: int = 8
    max_prompt_length: int = 64
    max_total_length: int = 256
    chunk_steps: int = 8
    prefill_batch: int = 4
    min_bucket: int = 16
    stop_ids: tuple[int, ...] = ()
    max_stop_ids: int = 4
    admission: str = "fifo"
    refill: bool = True
    weight_dtype: str = "auto"
    share_prefill: bool = True
    decode_buckets: bool = True
    min_decode_length: int = 64
    cpu_dots: str = "auto"
    decode_attention: str = "auto"
    key_layout: str = "auto"
    gate_up_layout: str = "auto"
    kv_hold_s: float = 120.0
    record_routes: bool = False
    adapters: int = 0
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        counts = ("num_slots", "max_prompt_length", "chunk_steps", "prefill_batch")
        for name in (*counts, "min_decode_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1")
        if self.max_total_length <= self.max_prompt_length:
            raise ValueError(
                f"EngineConfig.max_total_length ({self.max_total_length}) must exceed "
                f"max_prompt_length ({self.max_prompt_length})"
            )
        if self.admission not in ("fifo", "lpt"):
            raise ValueError(
                f"EngineConfig.admission must be 'fifo' or 'lpt', not {self.admission!r}"
            )
        if self.weight_dtype not in quant.WEIGHT_DTYPES:
            raise ValueError(
                f"EngineConfig.weight_dtype must be one of {quant.WEIGHT_DTYPES}, "
                f"not {self.weight_dtype!r}"
            )
        if self.cpu_dots not in CPU_DOTS:
            raise ValueError(
                f"EngineConfig.cpu_dots must be one of {CPU_DOTS}, not {self.cpu_dots!r}"
            )
        if self.key_layout not in KEY_LAYOUTS:
            raise ValueError(
                f"EngineConfig.key_layout must be one of {KEY_LAYOUTS}, not {self.key_layout!r}"
            )
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(
                f"EngineConfig.gate_up_layout must be one of {GATE_UP_LAYOUTS}, "
                f"not {self.gate_up_layout!r}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"EngineConfig.decode_attention must be one of {DECODE_ATTENTION}, "
                f"not {self.decode_attention!r}"
            )
        if not isinstance(self.adapters, int) or self.adapters < 0:
            raise ValueError(f"EngineConfig.adapters must be an int >= 0, got {self.adapters!r}")
        if not isinstance(self.top_logprobs, int) or not (
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"EngineConfig.top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.top_logprobs!r}"
            )
        if len(self.stop_ids) > self.max_stop_ids:
            raise ValueError("EngineConfig.stop_ids has more ids than max_stop_ids")

    def decode_compiler_options(self, platform: str, width: int) -> tuple[tuple[str, str], ...]:
        """XLA compiler options of the decode chunk on `platform` for a model of hidden
        size `width` (hashable: `executables.jitted` is cached by them)."""
        eigen = self.cpu_dots == "eigen" or (self.cpu_dots == "auto" and width >= EIGEN_MIN_WIDTH)
        if platform != "cpu" or not eigen or self.weight_dtype == "int8":
            return ()
        # YNNPACK for reductions only: its dot fusions are what the default adds.
        return (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_REDUCE"),)

    def keys_positions_minor(self, platform: str) -> bool:
        """The KV cache's key layout on `platform` (`decoder.LayerCache`)."""
        if self.key_layout != "auto":
            return self.key_layout == "positions_minor"
        return platform == "cpu"

    def gate_up_parts_major(self, platform: str) -> bool:
        """The generation weights' gate and up layout on `platform` ([2, E, M] if true)."""
        if self.gate_up_layout != "auto":
            return self.gate_up_layout == "parts_major"
        return platform != "cpu"

    def attention(self, platform: str) -> str:
        """The decode step's attention form on `platform` (`decoder.ATTENTION`)."""
        if self.decode_attention != "auto":
            return self.decode_attention
        return "elementwise" if platform == "cpu" else "dot"

    def buckets(self) -> tuple[int, ...]:
        out, b = [], max(1, self.min_bucket)
        while b < self.max_prompt_length:
            out.append(b)
            b *= 2
        return (*out, self.max_prompt_length)

    def bucket(self, n: int) -> int:
        """The prefill length for `n` input tokens: a prompt's bucket, or for a
        continuation (prompt + response so far, up to `max_total_length` - 1) the
        prompt buckets doubled on past `max_prompt_length`, capped at the cache length."""
        for b in self.buckets():
            if b >= n:
                return b
        b = self.max_prompt_length
        while b < n:
            b *= 2
        return min(b, self.max_total_length)

    def prefill_buckets(self, continuations: bool = False) -> tuple[int, ...]:
        """Every prefill length `bucket` gives: the prompt buckets, and with
        `continuations` (partial rollout re-prefills prompt + response so far) those past
        `max_prompt_length` too."""
        if not continuations:
            return self.buckets()
        return tuple(sorted({self.bucket(n) for n in range(1, self.max_total_length)}))

    def decode_shapes(self) -> compact.DecodeShapes:
        return compact.DecodeShapes(
            num_slots=self.num_slots,
            max_length=self.max_total_length,
            chunk_steps=self.chunk_steps,
            min_length=self.min_decode_length,
            enabled=self.decode_buckets,
        )
