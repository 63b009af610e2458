"""The components of a run and their builders.

`build` (one process) makes everything a schedule needs: the role meshes, the
model straight into its training sharding, the policy trainer (and the PPO
critic when `algorithm.advantage="gae"`), the generation instances' meshes and
engine configs with W_0 already placed on them (moved there by `WeightSync`),
the prompt pipeline, the held-out prompts and the reward function. Nothing here
starts a thread: the run makes the generation service (`GenerationParts.service`)
with its observers and owns it.

Several processes (docs/multicontroller.md): `build_training` builds the same
without generation (its `WeightSync` mover sends to the generation processes);
`build_generation` only the generation side of a generation process (its
instances, the same seeded prompt pipeline, the held-out prompts), reading the
model's config and tokenizer without loading its weights (the trainer sends W_0).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax import learner as learner_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax import sharding
from streamrl_jax.config import ExperimentConfig, sample_tokens
from streamrl_jax.data import Prompt, PromptPipeline
from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine import EngineConfig
from streamrl_jax.generation.service import GenerationService
from streamrl_jax.generation.types import ChunkReport
from streamrl_jax.learner import Learner, policy_kind
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import Description, describe
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.pipeline import datasets, warmup
from streamrl_jax.pipeline.meshes import make_meshes, role_meshes, scoring_mesh
from streamrl_jax.pipeline.tenant import TenantJudge
from streamrl_jax.rewards import judge as judge_lib
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.rewards.judge import Judge, Scorer
from streamrl_jax.rewards.sandbox import Limits
from streamrl_jax.trainer import state as state_lib
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params, Published, WeightSync, place_on

# (training params, generation dtype) -> the WeightSync of a training process.
MakeWeightSync = Callable[[Params, jnp.dtype], WeightSync]


@dataclasses.dataclass
class GenerationParts:
    """How to build this process's generation instances, before any weights exist."""

    model_cfg: model_config.ModelConfig  # in the generation dtype
    graphdef: nnx.GraphDef
    instances: list[Mesh]  # one ("tp",) mesh per instance
    engine_cfgs: list[EngineConfig]
    param_shardings: list[Params]  # per instance, a tree of the params' NamedShardings
    abstract_params: Params  # the params' shapes and dtypes (what a weight header declares)
    # the tokenizer's decode: the engines read requests' stop strings with it
    detokenize: Callable[[Sequence[int]], str] | None = None
    # the judge as the service's tenant (`judge.placement="generation"`): attached to
    # every service built here (`pipeline/tenant.py`)
    tenants: tuple[TenantJudge, ...] = ()

    def service(
        self,
        params: list[Params],
        version: int,
        *,
        on_chunk: Callable[[ChunkReport], None],
        precompile: bool,
        continuations: bool,
    ) -> GenerationService:
        """The service, its instances holding `params` (one tree per instance);
        `on_chunk` observes every decode chunk (`generation.engine.Engine`); with
        `precompile` every instance compiles its shapes before it serves (with
        `continuations`, partial rollout's re-prefill buckets too)."""
        service = GenerationService(
            self.graphdef,
            params[0],
            self.model_cfg,
            self.instances,
            self.engine_cfgs,
            version=version,
            on_chunk=on_chunk,
            precompile=precompile,
            continuations=continuations,
            detokenize=self.detokenize,
        )
        if len(params) > 1:
            service.update_weights(list(params), version)
        for tenant in self.tenants:
            tenant.attach(service)
        return service


@dataclasses.dataclass
class Components:
    """Everything a run schedules; `close()` releases the generation threads."""

    meshes: mesh_lib.Meshes
    model_cfg: model_config.ModelConfig
    tokenizer: Tokenizer
    learner: Learner  # the policy and its targets (reference, teacher, critic, ...); their states
    generation: GenerationParts | None  # None in a training process (generation elsewhere)
    weight_sync: WeightSync
    initial_weights: list[Published]  # W_0 as placed on each generation instance
    reward_fn: RewardFn
    reward_sandbox: Limits | None  # worker limits when scoring runs sandboxed, else None
    prompts: PromptPipeline
    eval_prompts: list[Prompt]
    warmup: dict[str, float] = dataclasses.field(default_factory=dict)  # its figures, if run
    judge: Scorer | None = None  # the reward model on the scoring mesh (`judge.model`)


def describe_model(cfg: ExperimentConfig) -> Description:
    """The model's config (in the training dtypes, with the run's LoRA adapters:
    `trainer.lora`) and tokenizer; reads no weight."""
    d = _describe_model(cfg)
    return dataclasses.replace(d, cfg=policy_kind(cfg).model_config(d.cfg))


def _describe_model(cfg: ExperimentConfig) -> Description:
    m = cfg.model
    if m.source == "tiny":
        tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
        model_cfg = model_config.tiny(
            vocab_size=tokenizer.vocab_size,
            max_position_embeddings=m.max_context,
            param_dtype=m.param_dtype,
            dtype=m.dtype,
            remat=m.remat,
            sequence_parallel=m.sequence_parallel,
        )
        return Description(model_cfg, tokenizer, {}, "tiny", is_gguf=False)
    path = model_path(cfg)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model.source: {path} does not exist")
    d = describe(
        path,
        param_dtype=m.param_dtype,
        dtype=m.dtype,
        remat=m.remat,
        sequence_parallel=m.sequence_parallel,
    )
    if d.tokenizer is None:
        raise UserError(f"model.source {path}: the checkpoint has no tokenizer")
    if m.max_context > d.cfg.max_position_embeddings:
        raise UserError(
            f"model.max_context ({m.max_context}) exceeds the model's context "
            f"({d.cfg.max_position_embeddings})"
        )
    if m.routing_replay and not d.cfg.num_experts:
        raise UserError(
            f"model.routing_replay: {path} is a dense model (routing replay is for "
            "mixture-of-experts models)"
        )
    return d


def model_path(cfg: ExperimentConfig) -> str:
    return smollm2_gguf_path() if cfg.model.source == "smollm2" else cfg.model.source


def initial_policy(cfg: ExperimentConfig, train_mesh: Mesh) -> tuple[Trainer, TrainState]:
    """The policy trainer and its state as a run of `cfg` starts on `train_mesh` (before
    any warm-up): the weights of `model.source` (or `init_from`), with LoRA new adapters
    on that base, which is what a LoRA checkpoint's adapters go with."""
    return learner_lib.initial_policy(cfg, describe_model(cfg), train_mesh)


def engine_config(cfg: ExperimentConfig, tokenizer: Tokenizer, slots: int) -> EngineConfig:
    """The engine of a generation instance with `slots` slots, as the run configures it."""
    g = cfg.generation
    return EngineConfig(
        num_slots=slots,
        max_prompt_length=g.max_prompt_len,
        # An episode's turns share one slot: its whole budget (config.sample_tokens).
        max_total_length=g.max_prompt_len + sample_tokens(cfg),
        chunk_steps=g.decode_chunk,
        prefill_batch=g.prefill_batch,
        stop_ids=tuple(tokenizer.stop_ids),
        max_stop_ids=max(4, len(tokenizer.stop_ids)),
        admission="lpt" if cfg.scheduling.dispatch in ("skew_aware", "oracle") else "fifo",
        weight_dtype=g.weight_dtype,
        share_prefill=g.share_prefill,
        cpu_dots=g.cpu_dots,
        # Decode buckets change a chunk's matmul and attention shapes with what else is
        # running, which moves log-probs by float rounding (docs/generation.md): a
        # deterministic run keeps one decode shape, so its samples are bitwise the same
        # whatever the schedule (resume, mode and topology parity).
        decode_buckets=not cfg.pipeline.deterministic,
        record_routes=cfg.model.routing_replay,
        kv_hold_s=g.kv_hold_s,
        top_logprobs=g.top_logprobs,
    )


def generation_parts(
    cfg: ExperimentConfig,
    model_cfg: model_config.ModelConfig,
    tokenizer: Tokenizer,
    generate_mesh: Mesh,
    adapters: int = 0,
) -> GenerationParts:
    """Instance meshes, engine configs and weight shardings of the generation side, and
    the judge where it is the service's tenant (`judge.placement`); `adapters`: the
    engines' LoRA adapter slots (several learners: one each)."""
    gen_dtype = cfg.model.generate_dtype
    gen_cfg = model_cfg.replace(
        param_dtype=gen_dtype, dtype=gen_dtype, remat="dots_attention", sequence_parallel=False
    )
    gen_graphdef, abstract = nnx.split(nnx.eval_shape(lambda: llama.create(gen_cfg)))
    instances = mesh_lib.instance_meshes(generate_mesh)
    engine_cfgs = [
        dataclasses.replace(engine_config(cfg, tokenizer, slots), adapters=adapters)
        for slots in cfg.mesh.instance_slots
    ]
    tenants = ()
    if cfg.judge.model and cfg.judge.placement == "generation":
        judge = make_judge(cfg, instances[0])
        tenants = (TenantJudge(judge, instances, cfg.judge.timeout_s),)
    return GenerationParts(
        model_cfg=gen_cfg,
        graphdef=gen_graphdef,
        instances=instances,
        engine_cfgs=engine_cfgs,
        param_shardings=[sharding.state_shardings(abstract, m, "generate") for m in instances],
        abstract_params=abstract,
        detokenize=tokenizer.decode,
        tenants=tenants,
    )


def served(
    cfg: ExperimentConfig,
    *,
    checkpoint: str = "",
    slots: int = 16,
    kv_hold_s: float = 0.0,
    top_logprobs: int = 20,
) -> tuple[GenerationParts, list[Params], Tokenizer]:
    """What `python -m streamrl_jax.serve` serves, and what an evaluation beside it decodes
    with (`pipeline/episode_evaluation.py`): the generation side of a run of `cfg` holding
    the policy at `checkpoint` (a root or step directory, read as the run reads
    `init_from`; "": the model `cfg` starts from; no warm-up), every engine with `slots`
    slots, its kept KV held `kv_hold_s` while requests wait, `top_logprobs` alternatives
    a token; and the tokenizer."""
    g = dataclasses.replace(cfg.generation, kv_hold_s=kv_hold_s, top_logprobs=top_logprobs)
    # No judge: serving scores nothing (and its process has devices for the roles only).
    served_cfg = dataclasses.replace(
        cfg, generation=g, init_from=checkpoint, judge=dataclasses.replace(cfg.judge, model="")
    )
    c = build(served_cfg, warm=False)
    assert c.generation is not None, "one process builds its generation side"
    engines = [dataclasses.replace(e, num_slots=slots) for e in c.generation.engine_cfgs]
    parts = dataclasses.replace(c.generation, engine_cfgs=engines)
    return parts, [p.params for p in c.initial_weights], c.tokenizer


def has_checkpoint(directory: str) -> bool:
    """Whether a run's checkpoint directory holds a step (the run resumes: no warm-up)."""
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def build(
    cfg: ExperimentConfig,
    devices: list[jax.Device] | None = None,
    *,
    reward_fn: RewardFn | None = None,
    warm: bool = True,
) -> Components:
    """Creates every component of a one-process run. `reward_fn` replaces the task's
    reward (tests, custom rewards): it runs inline unless `data.reward_sandbox="process"`.
    `warm`: run the supervised warm-up (`warmup.steps`; False for a run that resumes)."""
    # Datasets first: a bad file fails before any device memory or thread exists.
    eval_set, train_set = datasets.datasets(cfg)
    meshes = make_meshes(cfg, devices)
    logging.info(
        "meshes: train %s on %s; generation %s on %s",
        dict(meshes.train.shape),
        [d.id for d in meshes.train.devices.flat],
        dict(meshes.generate.shape),
        [d.id for d in meshes.generate.devices.flat],
    )
    return _components(cfg, meshes, train_set, eval_set, reward_fn=reward_fn, warm=warm)


def build_training(
    cfg: ExperimentConfig,
    devices: Sequence[jax.Device],
    make_weight_sync: MakeWeightSync,
    *,
    processes: int = 1,
    held_out: bool = True,
    warm: bool = True,
    base_from: ExperimentConfig | None = None,
    judge: Scorer | None = None,
) -> Components:
    """The components of a training process: no generation service; W_0 goes out
    through `make_weight_sync(params, generate_dtype)` (it sends to the generation
    processes, which must be connected). With several training processes, `devices`
    holds every training process's devices (process by process) and the training mesh
    spans them all; `held_out=False`: this one scores no held-out prompts (the first
    training process does); `base_from`: a learner's run across processes
    (`processes/learners.py`), whose adapters start on the frozen base of this config's
    (the first learner's), as in one process (`learners.build`); `judge`: the run's judge
    when it is served from elsewhere (scoring processes: `judge_channel.RemoteJudge`),
    else it is loaded here when the run has one."""
    eval_set, train_set = datasets.datasets(cfg)
    meshes = role_meshes(cfg, devices, "training", processes)
    logging.info(
        "training process: train mesh %s on %s",
        dict(meshes.train.shape),
        [d.id for d in meshes.train.devices.flat],
    )
    base = None
    if base_from is not None:
        _, first = learner_lib.initial_policy(base_from, describe_model(base_from), meshes.train)
        base = state_lib.frozen(first.params)
    return _components(
        cfg,
        meshes,
        train_set,
        eval_set,
        make_weight_sync=make_weight_sync,
        held_out=held_out,
        warm=warm,
        base=base,
        judge=judge,
    )


def learner_components(
    cfg: ExperimentConfig,
    meshes: mesh_lib.Meshes,
    train_set: datasets.ProblemSet,
    eval_set: datasets.ProblemSet,
    make_weight_sync: MakeWeightSync,
    *,
    reward_fn: RewardFn | None = None,
    base: Params | None = None,
    described: Description | None = None,
) -> Components:
    """One learner's components on meshes the learners share (pipeline/learners.py): W_0
    goes out through `make_weight_sync` to the service they share; `base`: the frozen
    base another learner loaded (None: load it); `described`: the model's description
    (`describe_model`, the same for every learner), read once."""
    return _components(
        cfg,
        meshes,
        train_set,
        eval_set,
        make_weight_sync=make_weight_sync,
        reward_fn=reward_fn,
        base=base,
        described=described,
    )


def _components(
    cfg: ExperimentConfig,
    meshes: mesh_lib.Meshes,
    train_set: datasets.ProblemSet,
    eval_set: datasets.ProblemSet,
    *,
    make_weight_sync: MakeWeightSync | None = None,
    reward_fn: RewardFn | None = None,
    held_out: bool = True,
    warm: bool = False,
    base: Params | None = None,
    described: Description | None = None,
    judge: Scorer | None = None,
) -> Components:
    """Trainers, prompts and W_0 through the weight sync; the generation service on
    `meshes.generate` unless `make_weight_sync` sends the weights elsewhere (other
    processes, or the service learners share); `base`: a LoRA learner's frozen base,
    another learner's (`_training`); `judge`: the run's judge served from elsewhere
    (None: loaded on this process's scoring mesh when the run has one)."""
    d = described or describe_model(cfg)
    model_cfg, tokenizer = d.cfg, d.tokenizer
    trainer, state = learner_lib.initial_policy(cfg, d, meshes.train, base)
    warmed: dict[str, float] = {}
    if warm and cfg.warmup.steps > 0:  # before W_0 leaves: generation starts from its result
        params, warmed = warmup.warm_up(
            cfg, model_cfg, meshes.train, state.params, tokenizer, train_set
        )
        state = trainer.state_from_params(params, cfg.seed)
    learner = learner_lib.make_learner(cfg, model_cfg, tokenizer, trainer, state, train_set)
    prompts, eval_prompts = datasets.prompts(cfg, tokenizer, train_set, eval_set)
    parts = None
    if make_weight_sync is None:
        parts = generation_parts(cfg, model_cfg, tokenizer, meshes.generate)
        weight_sync = WeightSync(
            parts.model_cfg.jnp_param_dtype,
            place_on(parts.param_shardings),
            adapters_only=learner.policy.adapters_only,
        )
    else:
        dtype = model_cfg.replace(param_dtype=cfg.model.generate_dtype).jnp_param_dtype
        weight_sync = make_weight_sync(state.params, dtype)
    published, _ = weight_sync.transfer(state.params, version=0)
    sandbox = datasets.reward_sandbox(cfg)
    if reward_fn is not None and cfg.data.reward_sandbox != "process":
        sandbox = None  # the caller's own function: inline unless asked otherwise
    return Components(
        meshes=meshes,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        learner=learner,
        generation=parts,
        weight_sync=weight_sync,
        initial_weights=published,
        reward_fn=datasets.episode_reward(cfg, reward_fn or datasets.reward_fn(cfg, train_set)),
        reward_sandbox=sandbox,
        prompts=prompts,
        eval_prompts=eval_prompts if held_out else [],
        warmup=warmed,
        judge=judge or _judge(cfg, meshes, parts),
    )


def _judge(
    cfg: ExperimentConfig, meshes: mesh_lib.Meshes, parts: GenerationParts | None
) -> Scorer | None:
    """This process's judge: none, the generation service's tenant, or one on the
    scoring mesh (`judge.placement`)."""
    if not cfg.judge.model:
        return None
    if cfg.judge.placement == "generation":  # (across processes the caller serves it)
        (tenant,) = parts.tenants
        return tenant
    return make_judge(cfg, scoring_mesh(cfg, meshes))


def make_judge(cfg: ExperimentConfig, mesh: Mesh) -> Judge:
    """The run's judge (`judge.model`) with its params on `mesh`; blocking mode judges
    one sample per forward (its reward call's own)."""
    j = cfg.judge
    written = j.verdict_tokens if j.verdict == "parsed" else 0
    graphdef, params, tokenizer, model_cfg = judge_lib.load(
        j.model, mesh, max_context=j.max_tokens + written, seed=cfg.seed
    )
    logging.info("judge %s on %s (%s)", j.model, [d.id for d in mesh.devices.flat], j.mode)
    return Judge(
        graphdef,
        params,
        tokenizer,
        mesh,
        template=j.template,
        rubric=j.rubric,
        scores=j.scores,
        min_mass=j.min_mass,
        max_tokens=j.max_tokens,
        batch=1 if j.mode == "blocking" else j.batch,
        model_cfg=model_cfg,
        verdict=j.verdict,
        verdict_tokens=j.verdict_tokens,
    )


@dataclasses.dataclass(frozen=True)
class GenerationSide:
    """What a generation process builds (`build_generation`)."""

    parts: GenerationParts  # its instances (the service is made once W_0 has arrived)
    prompts: PromptPipeline  # the seeded prompt pipeline
    eval_prompts: list[Prompt]  # the held-out prompts
    tokenizer: Tokenizer
    reward_fn: RewardFn  # what an episodes run's environment scores answers with
    reward_sandbox: Limits | None


def build_generation(
    cfg: ExperimentConfig,
    devices: Sequence[jax.Device],
    *,
    adapters: int = 0,
    parts: GenerationParts | None = None,
) -> GenerationSide:
    """The generation side of a generation process: its instances, the seeded prompt
    pipeline, the held-out prompts, and for an episodes run what its environment needs
    (the tokenizer, the task's reward). Reads the model's config and tokenizer only: the
    weights come from the trainer. Several learners (`processes/learners.py`): the first
    builds the instances with `adapters` slots, the others draw their own prompts for
    the same `parts`."""
    eval_set, train_set = datasets.datasets(cfg)
    d = describe_model(cfg)
    if parts is None:
        meshes = role_meshes(cfg, devices, "generation")
        logging.info(
            "generation process: %d instance(s) on %s",
            meshes.num_instances,
            [d.id for d in meshes.generate.devices.flat],
        )
        parts = generation_parts(cfg, d.cfg, d.tokenizer, meshes.generate, adapters=adapters)
    prompts, eval_prompts = datasets.prompts(cfg, d.tokenizer, train_set, eval_set)
    return GenerationSide(
        parts=parts,
        prompts=prompts,
        eval_prompts=eval_prompts,
        tokenizer=d.tokenizer,
        reward_fn=datasets.reward_fn(cfg, train_set),
        reward_sandbox=datasets.reward_sandbox(cfg),
    )
