"""Typed experiment configuration: an `ml_collections.ConfigDict` in, frozen dataclasses out.

`configs/NAME.py:get_config(arg)` returns a ConfigDict with one section per
component; `from_config_dict` turns it once into `ExperimentConfig`. Unknown
keys, wrong types and impossible values fail here, at start-up, with a
message naming the field (`pipeline.staleness must be >= 1 ...`). Library
code receives these dataclasses, never a ConfigDict or flags.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import ml_collections

MODES = ("colocated", "disaggregated_batch", "stream_sync", "stream_async")


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
    """RL maths, by registry name (streamrl_jax.algorithms)."""

    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
    policy_loss: str = "ppo_clip"  # ppo_clip | dapo
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    clip_eps: float = 0.2  # PPO clip (low side for dapo)
    clip_eps_high: float = 0.28  # dapo upper clip
    dual_clip: float = 3.0  # dual-clip bound c (0 = off)
    kl_coef: float = 0.0  # KL-to-reference coefficient (0 = no reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0  # entropy bonus
    tis_cap: float = 0.0  # truncated importance-sampling cap vs behaviour log-probs (0 = off)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """AdamW with warmup and gradient clipping."""

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999


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


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Cross-field checks; raises ValueError naming the field."""
    p, g, m = cfg.pipeline, cfg.generation, cfg.mesh
    _require(p.mode in MODES, f"pipeline.mode={p.mode!r}; expected one of {MODES}")
    _require(p.staleness >= 1, f"pipeline.staleness must be >= 1, got {p.staleness}")
    for name in (
        "steps",
        "prompts_per_step",
        "group_size",
        "min_groups",
        "micro_batch_groups",
        "mini_batches",
    ):
        _require(getattr(p, name) >= 1, f"pipeline.{name} must be >= 1, got {getattr(p, name)}")
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
    _require(p.watchdog_s > 0, f"pipeline.watchdog_s must be > 0, got {p.watchdog_s}")
    for name, value, allowed in (
        ("pipeline.nonfinite", p.nonfinite, ("skip", "stop")),
        ("data.bad_rows", cfg.data.bad_rows, ("error", "skip")),
        ("data.overlong_prompts", cfg.data.overlong_prompts, ("drop", "error", "truncate")),
        ("data.reward_errors", cfg.data.reward_errors, ("raise", "zero")),
        ("data.reward", cfg.data.reward, ("task", "vowels")),
    ):
        _require(value in allowed, f"{name}={value!r}; expected one of {allowed}")
    _require(
        not cfg.data.jsonl_path or bool(cfg.data.eval_jsonl_path),
        "data.jsonl_path needs data.eval_jsonl_path (held-out problems from another file)",
    )
    sc = cfg.scheduling
    dispatches = ("round_robin", "random", "skew_aware", "oracle")
    _require(
        sc.dispatch in dispatches,
        f"scheduling.dispatch={sc.dispatch!r}; expected one of {dispatches}",
    )
    _require(sc.objective in ("max", "sum"), f"scheduling.objective={sc.objective!r}; max | sum")
    _require(sc.planner in ("lpt", "groups"), f"scheduling.planner={sc.planner!r}; lpt | groups")
    _require(
        0 <= sc.elastic_reserved < len(m.instance_slots),
        f"scheduling.elastic_reserved={sc.elastic_reserved} must leave at least one of the "
        f"{len(m.instance_slots)} instances in mesh.instance_slots active",
    )
    _require(
        sc.dispatch != "oracle" or g.length_replay,
        "scheduling.dispatch='oracle' needs generation.length_replay=True (true lengths)",
    )
    ck = cfg.checkpoint
    _require(ck.every >= 0, f"checkpoint.every must be >= 0, got {ck.every}")
    _require(ck.keep >= 1, f"checkpoint.keep must be >= 1, got {ck.keep}")
    _require(p.timeout_s > 0, f"pipeline.timeout_s must be > 0, got {p.timeout_s}")
    _require(len(m.instance_slots) >= 1, "mesh.instance_slots must name at least one instance")
    _require(all(s >= 1 for s in m.instance_slots), "mesh.instance_slots must all be >= 1")
    _require(
        g.max_prompt_len >= 1 and g.max_new_tokens >= 1,
        "generation.max_prompt_len and max_new_tokens must be >= 1",
    )
    _require(
        g.max_prompt_len + g.max_new_tokens <= cfg.model.max_context,
        f"generation.max_prompt_len + max_new_tokens ({g.max_prompt_len + g.max_new_tokens}) "
        f"exceeds model.max_context ({cfg.model.max_context})",
    )
    _require(g.temperature >= 0, f"generation.temperature must be >= 0, got {g.temperature}")
    _require(0 < g.top_p <= 1, f"generation.top_p must be in (0, 1], got {g.top_p}")
    _require(g.top_k >= 0, f"generation.top_k must be >= 0, got {g.top_k}")
    _require(g.decode_chunk >= 1, f"generation.decode_chunk must be >= 1, got {g.decode_chunk}")
    _require(
        cfg.data.train_seed != cfg.data.eval_seed,
        "data.train_seed must differ from data.eval_seed (held-out problems)",
    )
    _require(cfg.optimizer.learning_rate > 0, "optimizer.learning_rate must be > 0")
    task_configs(cfg.data)  # parses, or raises naming data.task_config
    _require(
        cfg.optimizer.schedule in ("constant", "cosine"),
        f"optimizer.schedule={cfg.optimizer.schedule!r}; expected constant | cosine",
    )
    return cfg


def task_configs(data: DataSection) -> dict[str, dict[str, Any]]:
    """`data.task_config` parsed: {task name: reasoning-gym config kwargs}."""
    if not data.task_config:
        return {}
    try:
        parsed = json.loads(data.task_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.task_config is not valid JSON: {e}") from None
    tasks = {t.strip() for t in data.tasks.split(",") if t.strip()}
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
