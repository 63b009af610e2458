"""What every config field accepts, and which settings combine: `validate` and `check`.

One `_Rule` per registry or numeric field of every section (`RULES`; a test
fails if a field has none); each failure is a `ConfigError` naming the field as
the user wrote it (`algorithm.advantage='bogus'; expected one of (...)`).

Every "X needs Y" rule lives here, in one of two functions:

* `validate(cfg)`: each field, then the combinations the config alone decides
  (partial rollout needs stream_async, the mesh's tensor-parallel sizes divide its
  devices, ...). `from_config_dict` runs it.
* `check(cfg, processes)`: `validate`, then the combinations that depend on how many
  processes run the program (`Processes`): what runs in one process only, what
  partial rollout needs across processes, how training processes split a batch,
  what elastic generation counts. Every entry point runs it at start-up before
  anything is built: `pipeline.run` with `Processes.one()`, and a multi-controller
  process (`pipeline/processes/`) with the counts from its environment before it
  joins the program, then again with the joined program's.

A refusal is one line naming the fields and the process counts; `launch` prints
it as `error: ...` and exits with status 2, on every process alike.
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
    WEIGHT_TRANSPORTS,
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


def _require(ok: bool, message: str) -> None:
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
            _require(self.ok(value), f"{path}={value!r}; expected {self.expected}")
        else:
            _require(self.ok(value), f"{path} must be {self.expected}, got {value!r}")


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
        **dict.fromkeys(("kl_coef", "entropy_coef", "tis_cap"), _NONNEG),
        **dict.fromkeys(("overlong_buffer", "overlong_penalty"), _NONNEG),
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
    LogSection: {},
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


def _check_tasks(data: DataSection) -> None:
    """data.tasks names reasoning-gym datasets (unused with data.jsonl_path)."""
    if data.jsonl_path:
        return
    tasks = task_names(data)
    _require(bool(tasks), f"data.tasks={data.tasks!r} names no task")
    # reasoning-gym's own registry, imported only here: a third-party library, not a layer.
    from reasoning_gym.factory import DATASETS

    for task in tasks:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        _require(
            task in DATASETS,
            f"data.tasks={data.tasks!r}: {task!r} is not a reasoning-gym task"
            + (f" (did you mean {', '.join(close)}?)" if close else ""),
        )


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Every field's registry name and range, then cross-field checks; raises naming the field."""
    check_section("", cfg)
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        if dataclasses.is_dataclass(section):
            check_section(field.name, section)
    p, g = cfg.pipeline, cfg.generation
    _require(
        p.min_groups <= p.prompts_per_step,
        f"pipeline.min_groups ({p.min_groups}) exceeds pipeline.prompts_per_step "
        f"({p.prompts_per_step})",
    )
    _require(
        p.prompts_per_step % p.mini_batches == 0,
        f"pipeline.prompts_per_step ({p.prompts_per_step}) must be divisible by "
        f"pipeline.mini_batches ({p.mini_batches}): each mini-batch holds the same number "
        "of groups",
    )
    _require(
        p.weight_update == "boundary" or p.mode == "stream_async",
        f"pipeline.weight_update='inflight' needs pipeline.mode='stream_async' (mode is "
        f"{p.mode!r}: the synchronous modes generate batch b with W_b only, and colocated "
        "shares the devices between the stages)",
    )
    _require(
        p.weight_update == "boundary" or not p.deterministic,
        "pipeline.weight_update='inflight' cannot be pipeline.deterministic: the chunk at "
        "which a running sample takes new weights depends on timing",
    )
    _require(
        p.max_lag == 0 or (p.mode == "stream_async" and p.max_lag >= p.staleness),
        f"pipeline.max_lag ({p.max_lag}) must be 0 (= staleness) or, in stream_async, "
        f">= pipeline.staleness ({p.staleness}): batch b starts with W_(b-s)",
    )
    _, kind = rollout_names(p.rollout)
    _require(
        (kind == "partial") == (p.partial_budget_tokens > 0),
        f"pipeline.partial_budget_tokens ({p.partial_budget_tokens}) is partial rollout's "
        f"token budget per round: > 0 exactly when pipeline.rollout names 'partial' "
        f"(it is {p.rollout!r})",
    )
    if kind == "partial":
        _require(
            p.mode == "stream_async",
            f"pipeline.partial_budget_tokens needs pipeline.mode='stream_async' (mode is "
            f"{p.mode!r}): a carried sample is trained at a later step than its batch",
        )
        _require(
            p.max_lag > p.staleness,
            f"pipeline.partial_budget_tokens needs pipeline.max_lag ({p.max_lag}) > "
            f"pipeline.staleness ({p.staleness}): a sample carried into the next round is "
            "one step older when trained",
        )
        _require(
            p.mini_batches == 1,
            "pipeline.partial_budget_tokens needs pipeline.mini_batches=1 (a step trains the "
            "groups its round completed, a number that varies)",
        )
        rounds = p.max_lag - p.staleness + 1
        _require(
            p.lag_policy == "drop" or p.partial_budget_tokens * rounds >= g.max_new_tokens,
            f"pipeline.lag_policy='regenerate' needs partial_budget_tokens * (max_lag - "
            f"staleness + 1) = {p.partial_budget_tokens * rounds} >= generation."
            f"max_new_tokens ({g.max_new_tokens}), or the longest sample could be "
            "regenerated forever",
        )
    if kind == "dynamic_sampling":
        _check_dynamic_sampling(p)
    a = cfg.algorithm
    _require(
        g.weight_dtype != "int8" or a.tis_cap > 0,
        "generation.weight_dtype='int8' needs algorithm.tis_cap > 0 (e.g. 2.0): the int8 "
        "sampler's log-probs differ from the trained model's, and the truncated importance "
        "weight min(pi_old / mu, tis_cap) is what corrects it",
    )
    _require(
        a.tis_cap == 0 or p.mini_batches == 1,
        f"algorithm.tis_cap > 0 needs pipeline.mini_batches=1 (it is {p.mini_batches}): "
        "pi_old is recomputed under the trainer's weights when each micro-batch is "
        "trained, which are the batch's starting weights only with one mini-batch",
    )
    _require(
        a.overlong_buffer <= g.max_new_tokens,
        f"algorithm.overlong_buffer ({a.overlong_buffer}) exceeds generation.max_new_tokens "
        f"({g.max_new_tokens}): the buffer is the last tokens before the response cap",
    )
    o, optimizer_steps = cfg.optimizer, p.steps * p.mini_batches
    _require(
        o.schedule != "cosine" or o.warmup_steps < optimizer_steps,
        f"optimizer.warmup_steps ({o.warmup_steps}) must be below the run's optimizer steps "
        f"(pipeline.steps * pipeline.mini_batches = {optimizer_steps}) for the cosine schedule",
    )
    _require(
        cfg.algorithm.advantage != "gae" or cfg.critic.whiten != "group" or p.group_size >= 2,
        "critic.whiten='group' needs pipeline.group_size >= 2 (use critic.whiten='none')",
    )
    _require(
        not cfg.data.jsonl_path or bool(cfg.data.eval_jsonl_path),
        "data.jsonl_path needs data.eval_jsonl_path (held-out problems from another file)",
    )
    sc = cfg.scheduling
    _require(
        sc.dispatch != "oracle" or g.length_replay,
        "scheduling.dispatch='oracle' needs generation.length_replay=True (true lengths)",
    )
    _check_mesh(p.mode, cfg.mesh)
    _require(
        g.max_prompt_len + g.max_new_tokens <= cfg.model.max_context,
        f"generation.max_prompt_len + max_new_tokens ({g.max_prompt_len + g.max_new_tokens}) "
        f"exceeds model.max_context ({cfg.model.max_context})",
    )
    _require(
        cfg.trainer.row_tokens == 0 or cfg.trainer.row_tokens >= cfg.model.max_context,
        f"trainer.row_tokens ({cfg.trainer.row_tokens}) must be 0 (auto) or >= "
        f"model.max_context ({cfg.model.max_context}): every sample must fit one row",
    )
    _require(
        cfg.data.train_seed != cfg.data.eval_seed,
        "data.train_seed must differ from data.eval_seed (held-out problems)",
    )
    _check_tasks(cfg.data)
    task_configs(cfg.data)  # parses, or raises naming data.task_config
    return cfg


def _check_mesh(mode: str, m: MeshSection) -> None:
    """How the devices split into instances and tensor-parallel groups (`mesh.py`).

    The rule is the same in one process and across processes: there each generation
    process holds `generate_devices` (its instances) and each training process
    `train_devices`, whole `train_tp` groups of a training mesh over all of them.
    Colocated mode (one process) puts both roles on all the devices.
    """
    slots = len(m.instance_slots)
    _require(slots >= 1, "mesh.instance_slots must name at least one instance")
    _require(all(s >= 1 for s in m.instance_slots), "mesh.instance_slots must all be >= 1")
    if mode == "colocated":
        need = m.generate_devices + m.train_devices
        _require(
            need % slots == 0,
            f"pipeline.mode='colocated' splits mesh.generate_devices + mesh.train_devices = "
            f"{need} devices into the {slots} instances of mesh.instance_slots, which must "
            "divide them",
        )
        _require(
            need % m.train_tp == 0,
            f"mesh.train_tp ({m.train_tp}) must divide the {need} devices of "
            "pipeline.mode='colocated' (mesh.generate_devices + mesh.train_devices)",
        )
        return
    _require(
        m.train_devices % m.train_tp == 0,
        f"mesh.train_tp ({m.train_tp}) must divide mesh.train_devices ({m.train_devices})",
    )
    _require(
        m.generate_devices % m.instance_tp == 0,
        f"mesh.instance_tp ({m.instance_tp}) must divide mesh.generate_devices "
        f"({m.generate_devices})",
    )
    _require(
        m.generate_devices // m.instance_tp == slots,
        f"mesh.instance_slots names {slots} instances but mesh.generate_devices / "
        f"mesh.instance_tp = {m.generate_devices} / {m.instance_tp} makes "
        f"{m.generate_devices // m.instance_tp}",
    )


def _check_dynamic_sampling(p: PipelineSection) -> None:
    """The combinations dynamic sampling refuses (docs/pipeline.md, "Dynamic sampling")."""
    _require(
        p.group_size >= 2,
        "pipeline.rollout='dynamic_sampling' needs pipeline.group_size >= 2 (a group of one "
        "sample has no reward variance: every group would be skipped)",
    )
    _require(
        p.mini_batches == 1,
        f"pipeline.rollout='dynamic_sampling' needs pipeline.mini_batches=1 (it is "
        f"{p.mini_batches}): a step that ran out of draws holds fewer groups than the "
        "mini-batches split",
    )
    _require(
        p.weight_update == "boundary",
        "pipeline.rollout='dynamic_sampling' needs pipeline.weight_update='boundary': "
        "replacement prompts are generated with the batch's own weights W_g(b), which "
        "in-flight updates would swap mid-batch",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Processes:
    """How many processes run the program, as far as start-up knows.

    Attributes:
      total: processes in the program; 1 = one process runs both stages; None = several
        whose number is known only once they join (`jax.distributed` auto-detection).
      generation: processes 0 .. G-1 generate, the others train (`distributed/roles.py`);
        0 in one process.
    """

    total: int | None
    generation: int

    def __post_init__(self):
        if self.total == 1 and self.generation != 0:
            raise ValueError(f"one process has no generation processes, got {self.generation}")
        if self.total != 1 and not (
            self.generation >= 1 and (self.total is None or self.generation < self.total)
        ):
            raise ValueError(
                f"{self.total} processes need 1 <= generation < total, got {self.generation}"
            )

    @classmethod
    def one(cls) -> Processes:
        """A one-process run (`pipeline.run`)."""
        return cls(total=1, generation=0)

    @property
    def several(self) -> bool:
        return self.total != 1

    @property
    def training(self) -> int | None:
        """Training processes; None while the total is not known."""
        return None if self.total is None else self.total - self.generation

    def __str__(self) -> str:
        if not self.several:
            return "1 process"
        where = "(STREAMRL_NUM_PROCESSES, STREAMRL_GENERATION_PROCESSES)"
        if self.total is None:
            return f"several processes, {self.generation} generating {where}"
        return (
            f"{self.total} processes, {self.generation} generating and {self.training} "
            f"training {where}"
        )


NO_RESUME_ACROSS_PROCESSES = (
    "a partial-rollout run across processes cannot be checkpointed or resumed: the "
    "paused samples a checkpoint must hold live in the generation process "
    "(docs/multicontroller.md); run one process, or another pipeline.rollout"
)


def check(cfg: ExperimentConfig, processes: Processes) -> ExperimentConfig:
    """Every rule on the config: `validate`, then those that depend on the process counts.

    Run at start-up on every process before anything is built (module docstring). With
    `processes.total` None (before joining) the rules that need the total wait for the
    check after joining.

    Args:
      cfg: the experiment config.
      processes: how many processes run the program (`Processes.one()` in one process).

    Returns:
      `cfg`.

    Raises:
      ConfigError: one line naming the fields and the process counts.
    """
    validate(cfg)
    p, sc, n = cfg.pipeline, cfg.scheduling, processes
    if not n.several:
        slots = len(cfg.mesh.instance_slots)
        _require(
            sc.elastic_reserved < slots,
            f"scheduling.elastic_reserved={sc.elastic_reserved} must leave at least one of the "
            f"{slots} instances in mesh.instance_slots active (in one process it counts "
            "instances; across processes, generation processes)",
        )
        return cfg
    _require(
        p.mode != "colocated",
        f"pipeline.mode='colocated' shares one device set between generation and training, "
        f"so it runs in one process; this run has {n}. Use disaggregated_batch, stream_sync "
        "or stream_async, or run one process",
    )
    wrappers, kind = rollout_names(p.rollout)
    _require(
        kind != "dynamic_sampling",
        f"pipeline.rollout={p.rollout!r}: dynamic sampling runs in one process only; this "
        f"run has {n}: the generation processes cannot see the rewards that decide the "
        "refills",
    )
    _require(
        "curriculum" not in wrappers,
        f"pipeline.rollout={p.rollout!r}: the curriculum runs in one process only; this run "
        f"has {n}: the generation processes cannot see the outcomes that weigh the draws",
    )
    partial = kind == "partial"
    _require(
        not partial or (n.generation == 1 and n.total in (None, 2)),
        f"pipeline.rollout='partial' across processes runs with one generation and one "
        f"training process; this run has {n}: the paused samples live in their generation "
        "process, which a lost one would take with it, and the round reports go to one "
        "trainer. Use 2 processes (-n 2 -g 1), or another pipeline.rollout",
    )
    _require(
        not partial or cfg.checkpoint.every == 0,
        f"pipeline.rollout='partial' with checkpoint.every={cfg.checkpoint.every} on {n}: "
        f"{NO_RESUME_ACROSS_PROCESSES}",
    )
    if n.training is not None and n.training > 1:
        try:
            check_training_split(
                n.training, p.prompts_per_step // p.mini_batches, p.micro_batch_groups
            )
        except ConfigError as e:
            raise ConfigError(f"this run has {n}: {e}") from None
    _require(
        sc.elastic_reserved < n.generation,
        f"scheduling.elastic_reserved={sc.elastic_reserved}: across processes it counts "
        f"reserved generation processes, and must leave at least one active; this run has {n}",
    )
    return cfg


def check_training_split(training: int, per_mini: int, micro: int) -> None:
    """Raises ConfigError unless `training` processes can each own an equal slice of every
    micro-batch (`pipeline/shards.py`, "Ownership"): T | micro_batch_groups and T | the
    groups per mini-batch, so every micro-batch (the last one too) splits evenly.

    Args:
      training: T, the training processes.
      per_mini: groups per mini-batch (`pipeline.prompts_per_step / pipeline.mini_batches`).
      micro: groups per micro-batch (`pipeline.micro_batch_groups`).
    """
    _require(
        training >= 1 and per_mini % training == 0 and micro % training == 0,
        f"{training} training processes must divide pipeline.micro_batch_groups ({micro}) "
        f"and the groups per mini-batch (pipeline.prompts_per_step / pipeline.mini_batches "
        f"= {per_mini}): each owns an equal slice of every micro-batch",
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
