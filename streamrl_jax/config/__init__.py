"""Typed experiment configuration: an `ml_collections.ConfigDict` in, frozen dataclasses out.

`configs/NAME.py:get_config(arg)` returns a ConfigDict with one section per
component; `from_config_dict` turns it once into `ExperimentConfig`. Unknown
keys, wrong types, registry names and impossible values fail here, at start-up,
before any model loads, with a message naming the field
(`pipeline.staleness must be >= 1 ...`). Library code receives these
dataclasses, never a ConfigDict or flags.

* `sections`: the sections and the registry names each field may take.
* `fields`: what every field accepts (`RULES`, `check_section`).
* `rules`: every rule on which settings combine: `validate` (the config alone) and
  `check` (with the process counts, `Processes`).
* `parse`: ConfigDict -> `ExperimentConfig` (`from_config_dict`), and back.
"""

from streamrl_jax.config.fields import RULES, check_section, task_configs, task_names
from streamrl_jax.config.parse import defaults, from_config_dict, to_config_dict
from streamrl_jax.config.rules import (
    NO_RESUME_ACROSS_PROCESSES,
    Processes,
    check,
    check_training_split,
    validate,
)
from streamrl_jax.config.sections import (
    ADVANTAGES,
    AGGREGATIONS,
    BAD_ROWS,
    CPU_DOTS,
    DISPATCHES,
    DTYPES,
    KL_ESTIMATORS,
    LAG_POLICIES,
    LR_SCHEDULES,
    MODES,
    NONFINITE,
    OBJECTIVES,
    OVERLONG_PROMPTS,
    PLANNERS,
    POLICY_LOSSES,
    REWARD_ERRORS,
    REWARD_SANDBOXES,
    REWARDS,
    ROLLOUT_WRAPPERS,
    ROLLOUTS,
    WEIGHT_DTYPES,
    WEIGHT_UPDATES,
    WHITENING,
    AlgorithmSection,
    CheckpointSection,
    ConfigError,
    CriticSection,
    DataSection,
    EvalSection,
    ExperimentConfig,
    GenerationSection,
    LogSection,
    MeshSection,
    ModelSection,
    OptimizerSection,
    PipelineSection,
    SchedulingSection,
    TrainerSection,
)

__all__ = [
    "ConfigError",
    "MODES",
    "NONFINITE",
    "ADVANTAGES",
    "POLICY_LOSSES",
    "AGGREGATIONS",
    "CPU_DOTS",
    "KL_ESTIMATORS",
    "LR_SCHEDULES",
    "DTYPES",
    "BAD_ROWS",
    "OVERLONG_PROMPTS",
    "REWARD_ERRORS",
    "REWARD_SANDBOXES",
    "REWARDS",
    "ROLLOUTS",
    "ROLLOUT_WRAPPERS",
    "DISPATCHES",
    "OBJECTIVES",
    "PLANNERS",
    "WHITENING",
    "WEIGHT_DTYPES",
    "WEIGHT_UPDATES",
    "LAG_POLICIES",
    "ModelSection",
    "MeshSection",
    "GenerationSection",
    "PipelineSection",
    "AlgorithmSection",
    "OptimizerSection",
    "CriticSection",
    "DataSection",
    "EvalSection",
    "LogSection",
    "SchedulingSection",
    "TrainerSection",
    "CheckpointSection",
    "ExperimentConfig",
    "RULES",
    "NO_RESUME_ACROSS_PROCESSES",
    "Processes",
    "check",
    "check_section",
    "check_training_split",
    "defaults",
    "from_config_dict",
    "task_configs",
    "task_names",
    "to_config_dict",
    "validate",
]
