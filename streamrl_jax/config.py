"""Typed experiment configuration: an `ml_collections.ConfigDict` in, frozen dataclasses out.

`configs/NAME.py:get_config(arg)` returns a ConfigDict with one section per
component; `from_config_dict` turns it once into `ExperimentConfig`. Unknown
keys, wrong types and impossible values fail here, at start-up, with a
message naming the field (`pipeline.staleness must be >= 1 ...`). Library
code receives these dataclasses, never a ConfigDict or flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable
from typing import Any

import ml_collections

# Registry names, as the user writes them. config.py is the bottom layer and imports
# no registry; tests/config_test.py asserts these equal the registries' keys
# (streamrl_jax.algorithms, model.config, scheduling.dispatch, rewards.jsonl).
MODES = ("colocated", "disaggregated_batch", "stream_sync", "stream_async")
NONFINITE = ("skip", "stop")
# Outcome estimators (algorithms.ADVANTAGES) and, with a critic, "gae"
# (algorithms.CRITIC_ADVANTAGES; selects the critic section).
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
POLICY_LOSSES = ("ppo_clip", "dapo")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16", "float16")
BAD_ROWS = ("error", "skip")
OVERLONG_PROMPTS = ("drop", "error", "truncate")
REWARD_ERRORS = ("raise", "zero")
REWARDS = ("task", "vowels")
DISPATCHES = ("round_robin", "random", "skew_aware", "oracle")
OBJECTIVES = ("max", "sum")
PLANNERS = ("lpt", "groups")
WHITENING = ("group", "none")  # trainer/critic.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model, and its numerics."""

    source: str = "smollm2"  # "smollm2" (embedded GGUF), "tiny" (random), or a path
    param_dtype: str = "float32"  # trainer master weights
    dtype: str = "float32"  # trainer compute dtype
    generate_dtype: str = "float32"  # generation weights / KV cache dtype
    remat: bool = False  # rematerialise blocks in the backward pass
    max_context: int = 512  # cap on prompt + response length used by this run


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    """Device split (DESIGN.md §1); ignored device counts are derived for colocated mode."""

    generate_devices: int = 1  # devices for generation instances
    train_devices: int = 1  # devices for the trainer (FSDP)
    train_tp: int = 1  # tensor parallel inside the training mesh
    instance_tp: int = 1  # devices per generation instance
    instance_slots: tuple[int, ...] = (16,)  # batch size (slots) of each instance


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationSection:
    """Sampling and engine shape."""

    max_prompt_len: int = 128  # longest prompt admitted (tokens); longer is an error
    max_new_tokens: int = 128  # response cap
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    decode_chunk: int = 8  # decode steps per host round trip
    prefill_batch: int = 4  # prompts prefilled together
    length_replay: bool = False  # force response lengths from the paper's long-tail trace


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """The schedule (DESIGN.md §2-3)."""

    mode: str = "stream_sync"  # one of MODES
    staleness: int = 1  # s of stream_async: batch b is generated with W_{max(0, b-s)}
    steps: int = 10  # optimizer steps (= global batches)
    prompts_per_step: int = 8  # prompts per global batch
    group_size: int = 4  # samples per prompt (GRPO group)
    min_groups: int = 2  # streaming: train once this many complete groups are ready
    micro_batch_groups: int = 4  # most groups per trainer micro-batch
    mini_batches: int = 1  # optimizer steps per global batch (PPO mini-batches by group count)
    strict_versions: bool = False  # raise (instead of count and drop) on a too-old sample
    deterministic: bool = False  # micro-batches in group order: bitwise-reproducible training
    nonfinite: str = "skip"  # NaN/Inf loss or gradients: "skip" the update (counted) | "stop"
    watchdog_s: float = 120.0  # warn when a stage with work makes no progress this long
    timeout_s: float = 600.0  # longest wait on any pipeline stage before it is reported stalled


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmSection:
    """RL maths, by registry name (streamrl_jax.algorithms, docs/algorithms.md)."""

    advantage: str = "grpo"  # one of ADVANTAGES; "gae" trains a critic (section `critic`)
    policy_loss: str = "ppo_clip"  # ppo_clip | dapo
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    clip_eps: float = 0.2  # PPO clip: ratio in [1 - clip_eps, 1 + clip_eps] (low side for dapo)
    clip_eps_high: float = 0.28  # dapo only: upper clip 1 + clip_eps_high (ppo_clip ignores it)
    dual_clip: float = 3.0  # dual-clip bound c > 1 for negative advantages (0 = off)
    kl_coef: float = 0.0  # KL-to-reference coefficient (0 = no reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus
    tis_cap: float = 0.0  # truncated importance-sampling cap vs behaviour log-probs (0 = off)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """AdamW with warmup and gradient clipping (the critic's too, with its own learning rate)."""

    learning_rate: float = 1e-6  # peak learning rate
    warmup_steps: int = 0  # linear warm-up; step s uses lr * min(1, (s + 1) / warmup_steps)
    schedule: str = "constant"  # constant | cosine (decay to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.1  # cosine: final learning rate / peak
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm (0 = off)
    weight_decay: float = 0.0  # decoupled; never applied to norm scales or biases
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticSection:
    """PPO value model (trainer/critic.py), trained when algorithm.advantage="gae".

    It shares the model architecture and every optimizer.* setting except its
    learning rate; GAE is computed per sample, so it streams (docs/trainer.md).
    """

    learning_rate: float = 1e-5  # the critic's peak AdamW learning rate
    value_clip: float = 0.2  # value-loss clip around the old values (0 = plain squared error)
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda; < 1 shrinks token t's share of the outcome by lam^(T-t)
    # "group": whiten the advantages over each GRPO group's response tokens (groups never
    # split across micro-batches, so this streams exactly; needs pipeline.group_size >= 2)
    whiten: str = "group"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Prompts and rewards (reasoning-gym tasks)."""

    tasks: str = "basic_arithmetic"  # comma-separated reasoning-gym task names
    task_config: str = ""  # JSON {task: {reasoning-gym config kwargs}}, e.g. difficulty
    train_seed: int = 1  # train problems
    eval_seed: int = 2  # held-out problems (must differ from train_seed)
    train_size: int = 2000  # problems in the training set
    format_reward: float = 0.0  # bonus for a well-formed answer tag
    system_prompt: str = ""  # "" = rewards.tasks.SYSTEM_PROMPT (asks for <answer> tags)
    jsonl_path: str = ""  # a JSONL file of {"question", "answer"} rows instead of `tasks`
    eval_jsonl_path: str = ""  # held-out JSONL problems (required with jsonl_path)
    bad_rows: str = "error"  # JSONL rows that do not parse: "error" | "skip" (counted)
    overlong_prompts: str = "drop"  # over generation.max_prompt_len: drop | error | truncate
    reward_errors: str = "raise"  # a reward function exception: "raise" (end the run) | "zero"
    # "task": the dataset's scorer; "vowels": a dense stand-in (rewards/vowels.py) for
    # tests of untrained tiny models, which never earn the task reward
    reward: str = "task"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    """Held-out evaluation (greedy)."""

    every: int = 5  # evaluate every N steps (0 = only at start and end)
    num_problems: int = 32  # held-out problems per evaluation (greedy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogSection:
    tensorboard: bool = True
    trace: bool = True  # write trace.json
    progress: bool = True
    samples: bool = True  # append every completed training sample to samples.jsonl (ranker data)
    final_params: bool = False  # write <workdir>/final_params.npz at the end (compare runs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulingSection:
    """Skew-aware scheduling (streamrl_jax/scheduling/live.py, docs/scheduling.md)."""

    dispatch: str = "round_robin"  # round_robin | random | skew_aware | oracle
    objective: str = "max"  # Algorithm 2 objective: max (makespan) | sum (paper's pseudocode)
    planner: str = "lpt"  # lpt (list scheduling, for fixed-shape engines) | groups (Algorithm 2)
    ranker_path: str = ""  # a ranker pickle from tools/train_ranker.py ("" = untrained)
    ranker_online: bool = True  # refresh the ranker from completed samples every step
    ranker_min_samples: int = 64  # online refresh starts once this many samples are buffered
    ptl_profile: str = ""  # PTL(BS) JSON from tools/profile_ptl.py ("" = flat)
    elastic_reserved: int = 0  # last N of mesh.instance_slots held back for the elastic rule


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """Orbax checkpoints in <workdir>/checkpoints (docs/checkpoint.md)."""

    every: int = 0  # save every N steps (0 = off; a run still resumes an existing one)
    keep: int = 3  # newest checkpoints kept
    async_save: bool = True  # write on a background thread
    on_signal: bool = True  # SIGINT/SIGTERM: save the last step boundary and stop


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    seed: int = 0
    init_from: str = ""  # a checkpoint (root or step directory) to take the weights from
    model: ModelSection = ModelSection()
    mesh: MeshSection = MeshSection()
    generation: GenerationSection = GenerationSection()
    pipeline: PipelineSection = PipelineSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerSection = OptimizerSection()
    critic: CriticSection = CriticSection()
    data: DataSection = DataSection()
    eval: EvalSection = EvalSection()
    log: LogSection = LogSection()
    checkpoint: CheckpointSection = CheckpointSection()
    scheduling: SchedulingSection = SchedulingSection()


def _check_type(path: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ValueError(f"{path} must be a tuple, got {value!r}")
        return tuple(_check_type(path, v, typing.get_args(hint)[0]) for v in value)
    if origin in (typing.Union, types.UnionType):
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"{path} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    if hint is int and isinstance(value, bool):
        raise ValueError(f"{path} must be int, got bool")
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, (dict, ml_collections.ConfigDict)):
        raise ValueError(f"{path or 'config'} must be a section, got {data!r}")
    data = data.to_dict() if isinstance(data, ml_collections.ConfigDict) else dict(data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(path + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{path}{name}.")
        else:
            kwargs[name] = _check_type(path + name, value, hint)
    return cls(**kwargs)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


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
    },
    PipelineSection: {
        "mode": _one_of(MODES),
        **dict.fromkeys(
            ("staleness", "steps", "prompts_per_step", "group_size", "min_groups"), _COUNT
        ),
        **dict.fromkeys(("micro_batch_groups", "mini_batches"), _COUNT),
        "nonfinite": _one_of(NONFINITE),
        **dict.fromkeys(("watchdog_s", "timeout_s"), _POSITIVE),
    },
    AlgorithmSection: {
        "advantage": _one_of(ADVANTAGES),
        "policy_loss": _one_of(POLICY_LOSSES),
        "aggregation": _one_of(AGGREGATIONS),
        "kl_estimator": _one_of(KL_ESTIMATORS),
        **dict.fromkeys(("clip_eps", "clip_eps_high"), _POSITIVE),
        "dual_clip": _Rule(lambda v: v == 0 or v > 1, "0 (off) or > 1"),
        **dict.fromkeys(("kl_coef", "entropy_coef", "tis_cap"), _NONNEG),
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
    DataSection: {
        **dict.fromkeys(("train_seed", "eval_seed", "format_reward"), _NONNEG),
        "train_size": _COUNT,
        "bad_rows": _one_of(BAD_ROWS),
        "overlong_prompts": _one_of(OVERLONG_PROMPTS),
        "reward_errors": _one_of(REWARD_ERRORS),
        "reward": _one_of(REWARDS),
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
    p, g, m = cfg.pipeline, cfg.generation, cfg.mesh
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
        sc.elastic_reserved < len(m.instance_slots),
        f"scheduling.elastic_reserved={sc.elastic_reserved} must leave at least one of the "
        f"{len(m.instance_slots)} instances in mesh.instance_slots active",
    )
    _require(
        sc.dispatch != "oracle" or g.length_replay,
        "scheduling.dispatch='oracle' needs generation.length_replay=True (true lengths)",
    )
    _require(len(m.instance_slots) >= 1, "mesh.instance_slots must name at least one instance")
    _require(all(s >= 1 for s in m.instance_slots), "mesh.instance_slots must all be >= 1")
    _require(
        g.max_prompt_len + g.max_new_tokens <= cfg.model.max_context,
        f"generation.max_prompt_len + max_new_tokens ({g.max_prompt_len + g.max_new_tokens}) "
        f"exceeds model.max_context ({cfg.model.max_context})",
    )
    _require(
        cfg.data.train_seed != cfg.data.eval_seed,
        "data.train_seed must differ from data.eval_seed (held-out problems)",
    )
    _check_tasks(cfg.data)
    task_configs(cfg.data)  # parses, or raises naming data.task_config
    return cfg


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
        raise ValueError(f"data.task_config is not valid JSON: {e}") from None
    tasks = set(task_names(data))
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise ValueError("data.task_config must be a JSON object {task: {kwarg: value}}")
    if unknown := set(parsed) - tasks:
        raise ValueError(f"data.task_config names {sorted(unknown)}, not in data.tasks")
    return parsed


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> ExperimentConfig:
    """Builds and validates the typed config."""
    return validate(_build(ExperimentConfig, cd, ""))


def to_config_dict(cfg: ExperimentConfig) -> ml_collections.ConfigDict:
    """The defaults as a ConfigDict (configs start from this and override)."""
    return ml_collections.ConfigDict(dataclasses.asdict(cfg))


def defaults() -> ml_collections.ConfigDict:
    return to_config_dict(ExperimentConfig())
