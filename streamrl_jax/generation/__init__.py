"""Generation: per-instance engines with continuous batching, and the SGS over them.

The names below load on first use (PEP 562), so that the host-only modules that import
`streamrl_jax.generation.types` (the sample channel, the wire format, the launchers) do
not import JAX through this package.
"""

from streamrl_jax.lazy_names import module_attributes

_HOME = {
    "Engine": "engine",
    "EngineConfig": "engine_config",
    "GenerationService": "service",
    "InstanceError": "service",
    "StreamClosed": "service",
    "sample_queue": "service",
    "FinishReason": "types",
    "GenerationRequest": "types",
    "Sample": "types",
    "SamplingParams": "types",
    "Timings": "types",
}

__all__ = sorted(_HOME, key=str.lower)


__getattr__, __dir__ = module_attributes(__name__, _HOME, globals())
