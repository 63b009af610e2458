"""Builds the components of a run from an `ExperimentConfig`.

Meshes first (one explicit split of the devices), then the model straight
into its training sharding, the trainer, the generation service on its
instance meshes with weights moved there by `WeightSync`, the reward pool,
the prompt pipeline and the held-out evaluation prompts. `run.py` wires them
into a schedule; nothing here starts a pipeline thread except the generation
service's own instance threads.
"""

from __future__ import annotations

import dataclasses
import os
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
    service: GenerationService
    weight_sync: WeightSync
    initial_weights: list[Published]  # W_0 as placed on each generation instance
    reward_fn: RewardFn
    prompts: PromptPipeline
    eval_prompts: list[Prompt]

    def close(self, timeout: float) -> None:
        self.service.close(timeout)


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
    model_cfg, tokenizer, params = build_model(cfg, meshes.train)
    trainer = make_policy_trainer(
        model_cfg,
        trainer_config(cfg, meshes.train.shape["fsdp"]),
        meshes.train,
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

    gen_dtype = cfg.model.generate_dtype
    gen_cfg = model_cfg.replace(param_dtype=gen_dtype, dtype=gen_dtype, remat=False)
    gen_graphdef = nnx.split(nnx.eval_shape(lambda: llama.create(gen_cfg)))[0]
    instances = mesh_lib.instance_meshes(meshes.generate)
    weight_sync = WeightSync(
        [sharding.state_shardings(state.params, m, "generate") for m in instances],
        gen_cfg.jnp_param_dtype,
    )
    published, _ = weight_sync.transfer(state.params, version=0)
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
    d = cfg.data
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
    service = GenerationService(
        gen_graphdef, published[0].params, gen_cfg, instances, engine_cfgs, version=0
    )
    if len(published) > 1:
        service.update_weights([p.params for p in published], 0)

    return Components(
        meshes=meshes,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        trainer=trainer,
        state=state,
        ref_params=ref_params,
        service=service,
        weight_sync=weight_sync,
        initial_weights=published,
        reward_fn=train_set.reward_fn(format_bonus=d.format_reward),
        prompts=prompts,
        eval_prompts=eval_prompts,
    )
