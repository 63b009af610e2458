"""ConfigDict in, `ExperimentConfig` out: unknown keys and wrong types named by field."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections

from streamrl_jax.config.rules import validate
from streamrl_jax.config.sections import (
    LEARNER_SECTIONS,
    ConfigError,
    ExperimentConfig,
    LearnerSection,
)


def _check_type(path: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{path} must be a tuple, got {value!r}")
        return tuple(_check_type(path, v, typing.get_args(hint)[0]) for v in value)
    if origin in (typing.Union, types.UnionType):
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(f"{path} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{path} must be int, got bool")
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, (dict, ml_collections.ConfigDict)):
        raise ConfigError(f"{path or 'config'} must be a section, got {data!r}")
    data = data.to_dict() if isinstance(data, ml_collections.ConfigDict) else dict(data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(path + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{path}{name}.")
        else:
            kwargs[name] = _check_type(path + name, value, hint)
    return cls(**kwargs)


def _plain(data: Any) -> Any:
    return data.to_dict() if isinstance(data, ml_collections.ConfigDict) else data


def _learner(cfg: ExperimentConfig, entry: Any, i: int) -> LearnerSection:
    """`learners[i]`: what it sets, over the top level's sections (`LearnerSection`)."""
    path = f"learners[{i}]"
    entry = _plain(entry)
    if not isinstance(entry, dict):
        raise ConfigError(f"{path} must be a section (name=..., and what differs), got {entry!r}")
    shared = sorted(set(entry) - {"name", "seed", *LEARNER_SECTIONS})
    if shared:
        raise ConfigError(
            f"{path}: {', '.join(shared)} cannot differ between learners (they share one "
            f"generation service and process); a learner sets name, seed and "
            f"{', '.join(LEARNER_SECTIONS)} (lora: its trainer.lora)"
        )
    kwargs: dict[str, Any] = {
        "name": _check_type(f"{path}.name", entry.get("name", ""), str),
        "seed": _check_type(f"{path}.seed", entry.get("seed", cfg.seed), int),
    }
    for name in LEARNER_SECTIONS:
        top = cfg.trainer.lora if name == "lora" else getattr(cfg, name)
        own = _plain(entry.get(name) or {})
        if not isinstance(own, dict):
            raise ConfigError(f"{path}.{name} must be a section, got {own!r}")
        kwargs[name] = _build(type(top), dataclasses.asdict(top) | own, f"{path}.{name}.")
    return LearnerSection(**kwargs)


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> ExperimentConfig:
    """Builds and validates the typed config (a learner's sections over the top level's)."""
    data = dict(_plain(cd)) if isinstance(cd, ml_collections.ConfigDict | dict) else cd
    learners = data.pop("learners", ()) if isinstance(data, dict) else ()
    cfg = _build(ExperimentConfig, data, "")
    if not isinstance(learners, list | tuple):
        raise ConfigError(f"learners must be a tuple of sections, got {learners!r}")
    if learners:
        cfg = dataclasses.replace(
            cfg, learners=tuple(_learner(cfg, e, i) for i, e in enumerate(learners))
        )
    return validate(cfg)


def to_config_dict(cfg: ExperimentConfig) -> ml_collections.ConfigDict:
    """The defaults as a ConfigDict (configs start from this and override)."""
    return ml_collections.ConfigDict(dataclasses.asdict(cfg))


def defaults() -> ml_collections.ConfigDict:
    return to_config_dict(ExperimentConfig())
