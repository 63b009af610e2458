"""Generation: per-instance engines with continuous batching, and the SGS over them.

The names below load on first use (PEP 562), so that the host-only modules that import
`streamrl_jax.generation.types` (the sample channel, the wire format, the launchers) do
not import JAX through this package.
"""

import importlib

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


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
