"""Builds the components of a run from an `ExperimentConfig`.

Meshes first (one explicit split of the devices), then the model straight
into its training sharding, the trainer, the generation service on its
instance meshes with weights moved there by `WeightSync`, the reward pool,
the prompt pipeline and the held-out evaluation prompts. `run.py` wires them
into a schedule; nothing here starts a pipeline thread except the generation
service's own instance threads.

Several processes (docs/multicontroller.md): `build_training` builds the same
components without generation (a training process; its `WeightSync` sends to
the generation processes) and `build_generation` only the generation side (a
generation process: its instances on its own devices, the tokenizer, the
same seeded prompt pipeline). `mesh.generate_devices` and `mesh.instance_slots`
then describe each generation process, `mesh.train_devices` the training one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging
from flax import nnx

from streamrl_jax import mesh as mesh_lib
from streamrl_jax import sharding
from streamrl_jax.config import ExperimentConfig, task_configs
from streamrl_jax.data import Prompt, PromptPipeline, tokenize
from streamrl_jax.generation.engine import EngineConfig
from streamrl_jax.generation.service import GenerationService
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.rewards.tasks import TaskDataset
from streamrl_jax.trainer.config import TrainerConfig
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer, make_policy_trainer
from streamrl_jax.weight_sync import Published, WeightSync


@dataclasses.dataclass
class Components:
    """Everything a run schedules; `close()` releases threads."""

    meshes: mesh_lib.Meshes
    model_cfg: model_config.ModelConfig
    tokenizer: Tokenizer
    trainer: Trainer
    state: TrainState
    ref_params: Any  # frozen reference params (None when kl_coef == 0)
    service: GenerationService | None  # None in a training process (generation elsewhere)
    weight_sync: WeightSync
    initial_weights: list[Published]  # W_0 as placed on each generation instance
    reward_fn: RewardFn
    prompts: PromptPipeline
    eval_prompts: list[Prompt]

    def close(self, timeout: float) -> None:
        if self.service is not None:
            self.service.close(timeout)


@dataclasses.dataclass
class GenerationParts:
    """How to build this process's generation instances, before any weights exist."""

    model_cfg: model_config.ModelConfig  # in the generation dtype
    graphdef: nnx.GraphDef
    instances: list[Any]  # one ("tp",) mesh per instance
    engine_cfgs: list[EngineConfig]
    param_shardings: list[Any]  # per instance, the params' NamedShardings

    def service(self, params: list[Any], version: int) -> GenerationService:
        """The service, its instances holding `params` (one tree per instance)."""
        service = GenerationService(
            self.graphdef,
            params[0],
            self.model_cfg,
            self.instances,
            self.engine_cfgs,
            version=version,
        )
        if len(params) > 1:
            service.update_weights(list(params), version)
        return service


@dataclasses.dataclass
class GenerationSide:
    """What a generation process builds (`build_generation`)."""

    parts: GenerationParts
    tokenizer: Tokenizer
    prompts: PromptPipeline
    eval_prompts: list[Prompt]
    vocab_size: int


def devices_needed(cfg: ExperimentConfig) -> int:
    return cfg.mesh.generate_devices + cfg.mesh.train_devices


def make_meshes(cfg: ExperimentConfig, devices: list[jax.Device] | None = None) -> mesh_lib.Meshes:
    """The role meshes; colocated mode puts both roles on the whole device pool."""
    devices = list(jax.devices() if devices is None else devices)
    need = devices_needed(cfg)
    if need > len(devices):
        raise ValueError(
            f"mesh.generate_devices + mesh.train_devices = {need} exceeds the "
            f"{len(devices)} available devices"
        )
    pool = devices[:need]
    m = cfg.mesh
    if cfg.pipeline.mode == "colocated":
        if need % len(m.instance_slots):
            raise ValueError(
                f"colocated: {need} devices cannot be split into "
                f"{len(m.instance_slots)} instances (mesh.instance_slots)"
            )
        mc = mesh_lib.MeshConfig(
            colocated=True, train_tp=m.train_tp, instance_tp=need // len(m.instance_slots)
        )
    else:
        mc = mesh_lib.MeshConfig(
            generate_devices=m.generate_devices,
            train_devices=m.train_devices,
            train_tp=m.train_tp,
            instance_tp=m.instance_tp,
        )
    meshes = mesh_lib.make_meshes(mc, pool)
    if meshes.num_instances != len(m.instance_slots):
        raise ValueError(
            f"mesh.instance_slots names {len(m.instance_slots)} instances but the generation "
            f"mesh has {meshes.num_instances} (generate_devices / instance_tp)"
        )
    return meshes


def role_meshes(
    cfg: ExperimentConfig, devices: Sequence[jax.Device], role: str, processes: int = 1
) -> mesh_lib.Meshes:
    """One role's mesh on its processes' devices (several processes): the first
    `mesh.generate_devices` (generation) or `processes * mesh.train_devices` (training:
    the training mesh spans every training process) of `devices`. Built as a
    "colocated" split of those devices, so both meshes of the result span them; only
    the role's own mesh is used."""
    m = cfg.mesh
    need = m.generate_devices if role == "generation" else m.train_devices * processes
    if need > len(devices):
        field = "mesh.generate_devices" if role == "generation" else "mesh.train_devices"
        raise ValueError(
            f"{field} = {need // processes} exceeds the {len(devices) // processes} devices "
            f"of this {role} process"
        )
    generation = role == "generation"  # the other role's tp is 1: it always divides
    mc = mesh_lib.MeshConfig(
        colocated=True,
        train_tp=1 if generation else m.train_tp,
        instance_tp=m.instance_tp if generation else 1,
    )
    meshes = mesh_lib.make_meshes(mc, list(devices)[:need])
    if generation and meshes.num_instances != len(m.instance_slots):
        raise ValueError(
            f"mesh.instance_slots names {len(m.instance_slots)} instances but each generation "
            f"process has {meshes.num_instances} (generate_devices / instance_tp)"
        )
    return meshes


def _model_path(source: str) -> str:
    return smollm2_gguf_path() if source == "smollm2" else source


def _buckets(limit: int, start: int, multiple: int = 1) -> tuple[int, ...]:
    """Powers of two from `start` (rounded up to `multiple`) up to and including `limit`."""
    out, b = [], start
    while b < limit:
        out.append(-(-b // multiple) * multiple)
        b *= 2
    out.append(-(-limit // multiple) * multiple)
    return tuple(sorted(set(out)))


def _datasets(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """(eval set, train set): reasoning-gym tasks, or JSONL files (docs/datasets.md)."""
    d = cfg.data
    if d.jsonl_path:
        from streamrl_jax.rewards.jsonl import JsonlDataset

        eval_set = JsonlDataset(d.eval_jsonl_path, on_bad_row=d.bad_rows)
        train_set = JsonlDataset(
            d.jsonl_path, on_bad_row=d.bad_rows, exclude_questions=eval_set.questions()
        )
        return eval_set, train_set
    tasks = [t.strip() for t in d.tasks.split(",") if t.strip()]
    kwargs = task_configs(d)
    eval_set = TaskDataset(
        tasks, seed=d.eval_seed, size=max(cfg.eval.num_problems, 1), task_configs=kwargs
    )
    train_set = TaskDataset(
        tasks,
        seed=d.train_seed,
        size=d.train_size,
        task_configs=kwargs,
        exclude_questions=eval_set.questions(),
    )
    return eval_set, train_set


def trainer_config(cfg: ExperimentConfig, fsdp: int) -> TrainerConfig:
    a, o, p = cfg.algorithm, cfg.optimizer, cfg.pipeline
    micro = p.micro_batch_groups * p.group_size
    return TrainerConfig(
        learning_rate=o.learning_rate,
        lr_schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        total_steps=max(p.steps * p.mini_batches, 1),  # optimizer steps
        weight_decay=o.weight_decay,
        adam_b1=o.b1,
        adam_b2=o.b2,
        max_grad_norm=o.max_grad_norm if o.max_grad_norm > 0 else None,
        policy_loss=a.policy_loss,
        aggregation=a.aggregation,
        clip_eps_low=a.clip_eps,
        clip_eps_high=a.clip_eps_high if a.policy_loss == "dapo" else a.clip_eps,
        dual_clip_c=a.dual_clip if a.dual_clip > 1 else None,
        tis_cap=a.tis_cap if a.tis_cap > 0 else None,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        seq_buckets=_buckets(cfg.model.max_context, 64),
        batch_buckets=_buckets(micro, min(8, micro), multiple=fsdp),
        nonfinite=p.nonfinite,
    )


def build_model(
    cfg: ExperimentConfig, trainer_mesh: Any
) -> tuple[model_config.ModelConfig, Tokenizer, nnx.State | None]:
    """(model config, tokenizer, loaded params on the training mesh or None for random)."""
    m = cfg.model
    if m.source == "tiny":
        tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
        model_cfg = model_config.tiny(
            vocab_size=tokenizer.vocab_size,
            max_position_embeddings=m.max_context,
            param_dtype=m.param_dtype,
            dtype=m.dtype,
            remat=m.remat,
        )
        return model_cfg, tokenizer, None
    path = _model_path(m.source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model.source: {path} does not exist")
    pre = load_pretrained(
        path,
        mesh=trainer_mesh,
        role="train",
        param_dtype=m.param_dtype,
        dtype=m.dtype,
        remat=m.remat,
    )
    if pre.tokenizer is None:
        raise ValueError(f"model.source {path}: the checkpoint has no tokenizer")
    if m.max_context > pre.cfg.max_position_embeddings:
        raise ValueError(
            f"model.max_context ({m.max_context}) exceeds the model's context "
            f"({pre.cfg.max_position_embeddings})"
        )
    return pre.cfg, pre.tokenizer, pre.params


@dataclasses.dataclass
class _Training:
    model_cfg: model_config.ModelConfig
    tokenizer: Tokenizer
    trainer: Trainer
    state: TrainState
    ref_params: Any


def _training(cfg: ExperimentConfig, train_mesh: Any) -> _Training:
    """Model straight into the training sharding, the trainer and its state."""
    model_cfg, tokenizer, params = build_model(cfg, train_mesh)
    trainer = make_policy_trainer(
        model_cfg,
        trainer_config(cfg, train_mesh.shape["fsdp"]),
        train_mesh,
        model_seed=cfg.seed,
    )
    state = (
        trainer.init_state(cfg.seed)
        if params is None
        else trainer.state_from_params(params, cfg.seed)
    )
    if cfg.init_from:
        from streamrl_jax import checkpoint as ckpt_lib

        params = ckpt_lib.restore_params_only(
            cfg.init_from,
            ckpt_lib.abstract_tree(state.params),
            None,
            fingerprint=ckpt_lib.model_fingerprint(model_cfg),
        )
        state = trainer.state_from_params(params, cfg.seed)
        logging.info("initial weights from %s", cfg.init_from)
    ref_params = trainer.copy_params(state.params) if cfg.algorithm.kl_coef > 0 else None
    return _Training(model_cfg, tokenizer, trainer, state, ref_params)


def _generate_cfg(
    cfg: ExperimentConfig, model_cfg: model_config.ModelConfig
) -> model_config.ModelConfig:
    gen_dtype = cfg.model.generate_dtype
    return model_cfg.replace(param_dtype=gen_dtype, dtype=gen_dtype, remat=False)


def _generation_parts(
    cfg: ExperimentConfig,
    model_cfg: model_config.ModelConfig,
    tokenizer: Tokenizer,
    generate_mesh: Any,
    params: Any,
) -> GenerationParts:
    """Instance meshes, engine configs and weight shardings; `params` (concrete or
    abstract) gives the tree the shardings follow."""
    gen_cfg = _generate_cfg(cfg, model_cfg)
    gen_graphdef = nnx.split(nnx.eval_shape(lambda: llama.create(gen_cfg)))[0]
    instances = mesh_lib.instance_meshes(generate_mesh)
    g = cfg.generation
    engine_cfgs = [
        EngineConfig(
            num_slots=slots,
            max_prompt_length=g.max_prompt_len,
            max_total_length=g.max_prompt_len + g.max_new_tokens,
            chunk_steps=g.decode_chunk,
            prefill_batch=g.prefill_batch,
            stop_ids=tuple(tokenizer.stop_ids),
            max_stop_ids=max(4, len(tokenizer.stop_ids)),
            admission="lpt" if cfg.scheduling.dispatch in ("skew_aware", "oracle") else "fifo",
        )
        for slots in cfg.mesh.instance_slots
    ]
    return GenerationParts(
        model_cfg=gen_cfg,
        graphdef=gen_graphdef,
        instances=instances,
        engine_cfgs=engine_cfgs,
        param_shardings=[sharding.state_shardings(params, m, "generate") for m in instances],
    )


def _prompts(
    cfg: ExperimentConfig, tokenizer: Tokenizer, train_set: Any, eval_set: Any
) -> tuple[PromptPipeline, list[Prompt]]:
    """The seeded training prompt pipeline and the held-out eval prompts."""
    d, g = cfg.data, cfg.generation
    prompts = PromptPipeline(
        train_set,
        tokenizer,
        max_prompt_len=g.max_prompt_len,
        seed=cfg.seed,
        overlong=cfg.data.overlong_prompts,
        system_prompt=d.system_prompt,
    )
    eval_prompts = [
        tokenize(p, tokenizer, d.system_prompt)
        for p in list(eval_set)[: cfg.eval.num_problems or len(eval_set)]
    ]
    too_long = [p.problem.prompt_id for p in eval_prompts if len(p.tokens) > g.max_prompt_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} eval prompts exceed generation.max_prompt_len={g.max_prompt_len} "
            f"(e.g. {too_long[0]})"
        )
    return prompts, eval_prompts


def _reward_fn(cfg: ExperimentConfig, train_set: Any) -> RewardFn:
    if cfg.data.reward == "vowels":
        from streamrl_jax.rewards.vowels import vowel_reward

        return vowel_reward
    return train_set.reward_fn(format_bonus=cfg.data.format_reward)


def build(cfg: ExperimentConfig, devices: list[jax.Device] | None = None) -> Components:
    """Creates every component; the caller must `close()` the result."""
    # Datasets first: a bad file fails before any device memory or thread exists.
    eval_set, train_set = _datasets(cfg)
    meshes = make_meshes(cfg, devices)
    logging.info(
        "meshes: train %s on %s; generation %s on %s",
        dict(meshes.train.shape),
        [d.id for d in meshes.train.devices.flat],
        dict(meshes.generate.shape),
        [d.id for d in meshes.generate.devices.flat],
    )
    return _components(cfg, meshes, train_set, eval_set)


def build_training(
    cfg: ExperimentConfig,
    devices: Sequence[jax.Device],
    make_weight_sync: Callable[[Any, Any], WeightSync],
    processes: int = 1,
) -> Components:
    """The components of a training process: no generation service; W_0 goes out
    through `make_weight_sync(params, generate_dtype)` (it sends to the generation
    processes, which must be connected). With several training processes, `devices`
    holds every training process's devices (process by process) and the training mesh
    spans them all."""
    eval_set, train_set = _datasets(cfg)
    meshes = role_meshes(cfg, devices, "training", processes)
    logging.info(
        "training process: train mesh %s on %s",
        dict(meshes.train.shape),
        [d.id for d in meshes.train.devices.flat],
    )
    return _components(cfg, meshes, train_set, eval_set, make_weight_sync)


def _components(
    cfg: ExperimentConfig,
    meshes: mesh_lib.Meshes,
    train_set: Any,
    eval_set: Any,
    make_weight_sync: Callable[[Any, Any], WeightSync] | None = None,
) -> Components:
    """Trainer, prompts and W_0 through the weight sync; the generation service on
    `meshes.generate` unless `make_weight_sync` sends the weights to other processes."""
    t = _training(cfg, meshes.train)
    prompts, eval_prompts = _prompts(cfg, t.tokenizer, train_set, eval_set)
    parts = None
    if make_weight_sync is None:
        parts = _generation_parts(cfg, t.model_cfg, t.tokenizer, meshes.generate, t.state.params)
        weight_sync = WeightSync(parts.param_shardings, parts.model_cfg.jnp_param_dtype)
    else:
        dtype = _generate_cfg(cfg, t.model_cfg).jnp_param_dtype
        weight_sync = make_weight_sync(t.state.params, dtype)
    published, _ = weight_sync.transfer(t.state.params, version=0)
    return Components(
        meshes=meshes,
        model_cfg=t.model_cfg,
        tokenizer=t.tokenizer,
        trainer=t.trainer,
        state=t.state,
        ref_params=t.ref_params,
        service=parts.service([p.params for p in published], 0) if parts else None,
        weight_sync=weight_sync,
        initial_weights=published,
        reward_fn=_reward_fn(cfg, train_set),
        prompts=prompts,
        eval_prompts=eval_prompts,
    )


def build_generation(cfg: ExperimentConfig, devices: Sequence[jax.Device]) -> GenerationSide:
    """The generation side of a generation process; its service is made once W_0 has
    arrived (`GenerationSide.parts.service`)."""
    eval_set, train_set = _datasets(cfg)
    meshes = role_meshes(cfg, devices, "generation")
    logging.info(
        "generation process: %d instance(s) on %s",
        meshes.num_instances,
        [d.id for d in meshes.generate.devices.flat],
    )
    # A pretrained model's tokenizer and config come with its weights; these are
    # loaded onto one device and dropped (the trainer sends W_0).
    model_cfg, tokenizer, _ = build_model(cfg, meshes.train)
    abstract = nnx.split(nnx.eval_shape(lambda: llama.create(model_cfg)))[1]
    parts = _generation_parts(cfg, model_cfg, tokenizer, meshes.generate, abstract)
    prompts, eval_prompts = _prompts(cfg, tokenizer, train_set, eval_set)
    return GenerationSide(
        parts=parts,
        tokenizer=tokenizer,
        prompts=prompts,
        eval_prompts=eval_prompts,
        vocab_size=model_cfg.vocab_size,
    )
