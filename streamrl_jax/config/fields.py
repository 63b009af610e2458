"""What every config field accepts: `RULES` and `check_section`.

One `_Rule` per registry or numeric field of every section (`RULES`; a test
fails if a field has none); each failure is a `ConfigError` naming the field as
the user wrote it (`algorithm.advantage='bogus'; expected one of (...)`). Also the
fields whose values have a grammar of their own: `pipeline.rollout` ("wrapper+kind"),
`data.tasks` (reasoning-gym names) and `data.task_config` (JSON). Which settings
combine is `rules.py`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable
from typing import Any

from streamrl_jax.config.sections import (
    ADVANTAGES,
    AGGREGATIONS,
    BAD_ROWS,
    CPU_DOTS,
    DISPATCHES,
    DTYPES,
    ENVIRONMENTS,
    JUDGE_MODES,
    JUDGE_PLACEMENTS,
    JUDGE_VERDICTS,
    KL_ESTIMATORS,
    LAG_POLICIES,
    LR_SCHEDULES,
    MODES,
    NONFINITE,
    OBJECTIVES,
    OVERLONG_PROMPTS,
    PLANNERS,
    POLICY_LOSSES,
    PRM_BASELINES,
    REMAT_POLICIES,
    REWARD_ERRORS,
    REWARD_SANDBOXES,
    REWARDS,
    ROLLOUT_WRAPPERS,
    ROLLOUTS,
    SCAFFOLDS,
    TOOL_FORMATS,
    WEIGHT_DTYPES,
    WEIGHT_TRANSPORTS,
    WEIGHT_UPDATES,
    WHITENING,
    AlgorithmSection,
    CheckpointSection,
    ConfigError,
    CriticSection,
    DataSection,
    EnvironmentSection,
    EvalSection,
    ExperimentConfig,
    GenerationSection,
    JudgeSection,
    LogSection,
    LoraSection,
    MeshSection,
    ModelSection,
    OptimizerSection,
    PipelineSection,
    SchedulingSection,
    TrainerSection,
    WarmupSection,
)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """What one field accepts: a registry name, or a numeric range."""

    ok: Callable[[Any], bool]
    expected: str  # "one of (...)", ">= 1", "in [0, 1)"
    registry: bool = False

    def check(self, path: str, value: Any) -> None:
        if self.registry:
            require(self.ok(value), f"{path}={value!r}; expected {self.expected}")
        else:
            require(self.ok(value), f"{path} must be {self.expected}, got {value!r}")


def _one_of(names: tuple[str, ...]) -> _Rule:
    return _Rule(lambda v: v in names, f"one of {names}", registry=True)


def rollout_names(value: str) -> tuple[list[str], str]:
    """`pipeline.rollout` split into (wrappers, kind)."""
    *wrappers, kind = value.split("+")
    return wrappers, kind


def _is_rollout(value: str) -> bool:
    wrappers, kind = rollout_names(value)
    return (
        kind in ROLLOUTS
        and all(w in ROLLOUT_WRAPPERS for w in wrappers)
        and (len(set(wrappers)) == len(wrappers))
    )


def _at_least(low: float) -> _Rule:
    return _Rule(lambda v: v >= low, f">= {low}")


def _above(low: float) -> _Rule:
    return _Rule(lambda v: v > low, f"> {low}")


def _unit(*, open_low: bool = False, open_high: bool = False) -> _Rule:
    lo, hi = ("(" if open_low else "["), (")" if open_high else "]")
    return _Rule(
        lambda v: (v > 0 if open_low else v >= 0) and (v < 1 if open_high else v <= 1),
        f"in {lo}0, 1{hi}",
    )


_COUNT, _NONNEG, _POSITIVE = _at_least(1), _at_least(0), _above(0)
# Every registry and numeric field of every section (a test checks none is missing).
# "0 = off" (dual_clip, tis_cap, max_grad_norm, value_clip) is read in trainer/config.py.
RULES: dict[type, dict[str, _Rule]] = {
    ModelSection: {
        **dict.fromkeys(("param_dtype", "dtype", "generate_dtype"), _one_of(DTYPES)),
        "remat": _one_of(REMAT_POLICIES),
        "max_context": _COUNT,
    },
    MeshSection: dict.fromkeys(
        ("generate_devices", "train_devices", "train_tp", "instance_tp"), _COUNT
    ),
    GenerationSection: {
        **dict.fromkeys(
            ("max_prompt_len", "max_new_tokens", "decode_chunk", "prefill_batch"), _COUNT
        ),
        "temperature": _NONNEG,
        "top_k": _NONNEG,
        "top_p": _unit(open_low=True),
        "weight_dtype": _one_of(WEIGHT_DTYPES),
        "cpu_dots": _one_of(CPU_DOTS),
        "kv_hold_s": _NONNEG,
        # generation.engine_config.MAX_TOP_LOGPROBS
        "top_logprobs": _Rule(lambda v: 0 <= v <= 64, "in [0, 64]"),
    },
    PipelineSection: {
        "mode": _one_of(MODES),
        **dict.fromkeys(
            ("staleness", "steps", "prompts_per_step", "group_size", "min_groups"), _COUNT
        ),
        **dict.fromkeys(("micro_batch_groups", "mini_batches"), _COUNT),
        "nonfinite": _one_of(NONFINITE),
        "weight_update": _one_of(WEIGHT_UPDATES),
        "max_lag": _NONNEG,
        "rollout": _Rule(
            _is_rollout,
            f"a kind of {ROLLOUTS}, after optional wrappers of {ROLLOUT_WRAPPERS} joined "
            "with '+' (e.g. 'curriculum+dynamic_sampling')",
            registry=True,
        ),
        "partial_budget_tokens": _NONNEG,
        "dynamic_sampling_max_draws": _NONNEG,
        "curriculum_decay": _unit(open_low=True, open_high=True),
        "curriculum_floor": _unit(open_low=True),
        "lag_policy": _one_of(LAG_POLICIES),
        **dict.fromkeys(("watchdog_s", "timeout_s"), _POSITIVE),
        "weight_transport": _one_of(WEIGHT_TRANSPORTS),
    },
    AlgorithmSection: {
        "advantage": _one_of(ADVANTAGES),
        "policy_loss": _one_of(POLICY_LOSSES),
        "aggregation": _one_of(AGGREGATIONS),
        "kl_estimator": _one_of(KL_ESTIMATORS),
        **dict.fromkeys(("clip_eps", "clip_eps_high"), _POSITIVE),
        "dual_clip": _Rule(lambda v: v == 0 or v > 1, "0 (off) or > 1"),
        **dict.fromkeys(("kl_coef", "entropy_coef", "tis_cap", "router_aux_coef"), _NONNEG),
        **dict.fromkeys(("overlong_buffer", "overlong_penalty"), _NONNEG),
        "distill_coef": _POSITIVE,
        "sft_coef": _NONNEG,
        "sft_batch": _POSITIVE,
        "prm_coef": _NONNEG,
        **dict.fromkeys(("prm_beta", "prm_learning_rate"), _POSITIVE),
        "prm_baseline": _one_of(PRM_BASELINES),
    },
    OptimizerSection: {
        **dict.fromkeys(("learning_rate", "eps"), _POSITIVE),
        **dict.fromkeys(("warmup_steps", "max_grad_norm", "weight_decay"), _NONNEG),
        "schedule": _one_of(LR_SCHEDULES),
        "min_lr_ratio": _unit(),
        **dict.fromkeys(("b1", "b2"), _unit(open_high=True)),
    },
    CriticSection: {
        "learning_rate": _POSITIVE,
        "value_clip": _NONNEG,
        **dict.fromkeys(("gamma", "lam"), _unit()),
        "whiten": _one_of(WHITENING),
    },
    TrainerSection: {"row_tokens": _NONNEG},
    LoraSection: {"rank": _NONNEG, "alpha": _POSITIVE},  # its targets: config/rules.py
    DataSection: {
        **dict.fromkeys(("train_seed", "eval_seed", "format_reward"), _NONNEG),
        "train_size": _COUNT,
        "bad_rows": _one_of(BAD_ROWS),
        "overlong_prompts": _one_of(OVERLONG_PROMPTS),
        "reward_errors": _one_of(REWARD_ERRORS),
        "reward": _one_of(REWARDS),
        "reward_sandbox": _one_of(REWARD_SANDBOXES),
        "reward_timeout_s": _POSITIVE,
        "reward_memory_mb": _at_least(64),
    },
    EvalSection: {"every": _NONNEG, "num_problems": _NONNEG},
    EnvironmentSection: {
        "name": _one_of(ENVIRONMENTS),
        "tool_format": _one_of(TOOL_FORMATS),
        "scaffold": _one_of(SCAFFOLDS),
        **dict.fromkeys(("max_turns", "max_attempts", "workers", "tool_output_chars"), _COUNT),
        "max_episode_tokens": _NONNEG,
        "attempt_discount": _unit(open_low=True),
        "step_credit": _unit(),
        "tool_timeout_s": _POSITIVE,
        "tool_memory_mb": _at_least(64),
    },
    LogSection: {},
    WarmupSection: {"steps": _NONNEG, "batch": _COUNT, "learning_rate": _POSITIVE},
    JudgeSection: {
        **dict.fromkeys(("coef", "rule_coef"), _NONNEG),
        "min_mass": _unit(),
        "mode": _one_of(JUDGE_MODES),
        "placement": _one_of(JUDGE_PLACEMENTS),
        "verdict": _one_of(JUDGE_VERDICTS),
        **dict.fromkeys(("devices", "batch", "queue", "verdict_tokens"), _COUNT),
        "max_wait_s": _NONNEG,
        "max_tokens": _at_least(64),
        "timeout_s": _POSITIVE,
        "max_failure_rate": _unit(),
    },
    SchedulingSection: {
        "dispatch": _one_of(DISPATCHES),
        "objective": _one_of(OBJECTIVES),
        "planner": _one_of(PLANNERS),
        "ranker_min_samples": _COUNT,
        "elastic_reserved": _NONNEG,
    },
    CheckpointSection: {"every": _NONNEG, "keep": _COUNT},
    ExperimentConfig: {"seed": _NONNEG},
}


def check_section(path: str, section: Any) -> None:
    """Checks every registry name and numeric range of one section.

    Args:
      path: the section's name as the user writes it ("algorithm"), "" for the top level.
      section: a section dataclass instance.

    Raises:
      ValueError: naming the field, e.g. `algorithm.advantage='bogus'; expected one of (...)`.
    """
    for name, rule in RULES[type(section)].items():
        rule.check(f"{path}.{name}" if path else name, getattr(section, name))


def check_tasks(data: DataSection) -> None:
    """data.tasks names reasoning-gym datasets (unused with data.jsonl_path)."""
    if data.jsonl_path:
        return
    tasks = task_names(data)
    require(bool(tasks), f"data.tasks={data.tasks!r} names no task")
    # reasoning-gym's own registry, imported only here: a third-party library, not a layer.
    from reasoning_gym.factory import DATASETS

    for task in tasks:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        require(
            task in DATASETS,
            f"data.tasks={data.tasks!r}: {task!r} is not a reasoning-gym task"
            + (f" (did you mean {', '.join(close)}?)" if close else ""),
        )


def task_names(data: DataSection) -> list[str]:
    """`data.tasks` split into reasoning-gym task names."""
    return [t.strip() for t in data.tasks.split(",") if t.strip()]


def task_configs(data: DataSection) -> dict[str, dict[str, Any]]:
    """`data.task_config` parsed: {task name: reasoning-gym config kwargs}."""
    if not data.task_config:
        return {}
    try:
        parsed = json.loads(data.task_config)
    except json.JSONDecodeError as e:
        raise ConfigError(f"data.task_config is not valid JSON: {e}") from None
    tasks = set(task_names(data))
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise ConfigError("data.task_config must be a JSON object {task: {kwarg: value}}")
    if unknown := set(parsed) - tasks:
        raise ConfigError(f"data.task_config names {sorted(unknown)}, not in data.tasks")
    return parsed
