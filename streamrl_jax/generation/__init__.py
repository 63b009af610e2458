"""Generation: per-instance engines with continuous batching, and the SGS over them."""

from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.generation.service import (
    GenerationService,
    InstanceError,
    StreamClosed,
    sample_queue,
)
from streamrl_jax.generation.types import (
    FinishReason,
    GenerationRequest,
    Sample,
    SamplingParams,
    Timings,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GenerationRequest",
    "GenerationService",
    "InstanceError",
    "Sample",
    "sample_queue",
    "SamplingParams",
    "StreamClosed",
    "Timings",
]
