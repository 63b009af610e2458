"""Which settings combine: `validate` and `check`.

Every "X needs Y" rule lives here, in one of two functions:

* `validate(cfg)`: each field (`fields.py`), then the combinations the config alone decides
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

from streamrl_jax.config.fields import (
    check_section,
    check_tasks,
    require,
    rollout_names,
    task_configs,
)
from streamrl_jax.config.sections import (
    FUNCTION_ENVIRONMENTS,
    LORA_TARGETS,
    MULTI_AGENT_ENVIRONMENTS,
    STEP_CREDIT_ENVIRONMENTS,
    ConfigError,
    ExperimentConfig,
    LearnerSection,
    MeshSection,
    PipelineSection,
)


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Every field's registry name and range, then cross-field checks; raises naming the field."""
    check_section("", cfg)
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        if dataclasses.is_dataclass(section):
            check_section(field.name, section)
    p, g = cfg.pipeline, cfg.generation
    require(
        p.min_groups <= p.prompts_per_step,
        f"pipeline.min_groups ({p.min_groups}) exceeds pipeline.prompts_per_step "
        f"({p.prompts_per_step})",
    )
    require(
        p.prompts_per_step % p.mini_batches == 0,
        f"pipeline.prompts_per_step ({p.prompts_per_step}) must be divisible by "
        f"pipeline.mini_batches ({p.mini_batches}): each mini-batch holds the same number "
        "of groups",
    )
    require(
        p.weight_update == "boundary" or p.mode == "stream_async",
        f"pipeline.weight_update='inflight' needs pipeline.mode='stream_async' (mode is "
        f"{p.mode!r}: the synchronous modes generate batch b with W_b only, and colocated "
        "shares the devices between the stages)",
    )
    require(
        p.weight_update == "boundary" or not p.deterministic,
        "pipeline.weight_update='inflight' cannot be pipeline.deterministic: the chunk at "
        "which a running sample takes new weights depends on timing",
    )
    require(
        p.max_lag == 0 or (p.mode == "stream_async" and p.max_lag >= p.staleness),
        f"pipeline.max_lag ({p.max_lag}) must be 0 (= staleness) or, in stream_async, "
        f">= pipeline.staleness ({p.staleness}): batch b starts with W_(b-s)",
    )
    _, kind = rollout_names(p.rollout)
    require(
        (kind == "partial") == (p.partial_budget_tokens > 0),
        f"pipeline.partial_budget_tokens ({p.partial_budget_tokens}) is partial rollout's "
        f"token budget per round: > 0 exactly when pipeline.rollout names 'partial' "
        f"(it is {p.rollout!r})",
    )
    if kind == "partial":
        require(
            p.mode == "stream_async",
            f"pipeline.partial_budget_tokens needs pipeline.mode='stream_async' (mode is "
            f"{p.mode!r}): a carried sample is trained at a later step than its batch",
        )
        require(
            p.max_lag > p.staleness,
            f"pipeline.partial_budget_tokens needs pipeline.max_lag ({p.max_lag}) > "
            f"pipeline.staleness ({p.staleness}): a sample carried into the next round is "
            "one step older when trained",
        )
        require(
            p.mini_batches == 1,
            "pipeline.partial_budget_tokens needs pipeline.mini_batches=1 (a step trains the "
            "groups its round completed, a number that varies)",
        )
        rounds = p.max_lag - p.staleness + 1
        require(
            p.lag_policy == "drop" or p.partial_budget_tokens * rounds >= g.max_new_tokens,
            f"pipeline.lag_policy='regenerate' needs partial_budget_tokens * (max_lag - "
            f"staleness + 1) = {p.partial_budget_tokens * rounds} >= generation."
            f"max_new_tokens ({g.max_new_tokens}), or the longest sample could be "
            "regenerated forever",
        )
    if kind == "dynamic_sampling":
        _check_dynamic_sampling(p)
    _check_environment(cfg)
    require(
        not cfg.judge.model or not cfg.learners,
        "judge.model with learners: the scoring stage serves one policy's stream (each "
        "learner's samples would need its own stage)",
    )
    require(
        cfg.judge.placement == "scoring" or cfg.judge.mode == "stage",
        "judge.placement='generation' with judge.mode='blocking': a tenant of the generation "
        "service judges the stream's samples as a stage (blocking is the reward call's own "
        "judge, the stage's baseline)",
    )
    a = cfg.algorithm
    require(
        g.weight_dtype != "int8" or a.tis_cap > 0,
        "generation.weight_dtype='int8' needs algorithm.tis_cap > 0 (e.g. 2.0): the int8 "
        "sampler's log-probs differ from the trained model's, and the truncated importance "
        "weight min(pi_old / mu, tis_cap) is what corrects it",
    )
    require(
        a.tis_cap == 0 or p.mini_batches == 1,
        f"algorithm.tis_cap > 0 needs pipeline.mini_batches=1 (it is {p.mini_batches}): "
        "pi_old is recomputed under the trainer's weights when each micro-batch is "
        "trained, which are the batch's starting weights only with one mini-batch",
    )
    require(
        a.overlong_buffer <= g.max_new_tokens,
        f"algorithm.overlong_buffer ({a.overlong_buffer}) exceeds generation.max_new_tokens "
        f"({g.max_new_tokens}): the buffer is the last tokens before the response cap",
    )
    o, optimizer_steps = cfg.optimizer, p.steps * p.mini_batches
    require(
        o.schedule != "cosine" or o.warmup_steps < optimizer_steps,
        f"optimizer.warmup_steps ({o.warmup_steps}) must be below the run's optimizer steps "
        f"(pipeline.steps * pipeline.mini_batches = {optimizer_steps}) for the cosine schedule",
    )
    require(
        cfg.algorithm.advantage != "gae" or cfg.critic.whiten != "group" or p.group_size >= 2,
        "critic.whiten='group' needs pipeline.group_size >= 2 (use critic.whiten='none')",
    )
    a = cfg.algorithm
    require(
        a.prm_coef == 0 or a.advantage != "gae",
        f"algorithm.prm_coef={a.prm_coef} with algorithm.advantage='gae': the critic's GAE "
        "replaces the advantages the process rewards are added to (use a group advantage)",
    )
    require(
        a.prm_coef == 0 or cfg.trainer.lora.rank == 0,
        f"algorithm.prm_coef={a.prm_coef} with trainer.lora.rank={cfg.trainer.lora.rank}: the "
        "process reward model is a full copy of the policy, not built for a LoRA policy yet",
    )
    require(
        not cfg.data.jsonl_path or bool(cfg.data.eval_jsonl_path),
        "data.jsonl_path needs data.eval_jsonl_path (held-out problems from another file)",
    )
    sc = cfg.scheduling
    require(
        sc.dispatch != "oracle" or g.length_replay,
        "scheduling.dispatch='oracle' needs generation.length_replay=True (true lengths)",
    )
    _check_mesh(p.mode, cfg.mesh)
    require(
        g.max_prompt_len + g.max_new_tokens <= cfg.model.max_context,
        f"generation.max_prompt_len + max_new_tokens ({g.max_prompt_len + g.max_new_tokens}) "
        f"exceeds model.max_context ({cfg.model.max_context})",
    )
    require(
        cfg.trainer.row_tokens == 0 or cfg.trainer.row_tokens >= cfg.model.max_context,
        f"trainer.row_tokens ({cfg.trainer.row_tokens}) must be 0 (auto) or >= "
        f"model.max_context ({cfg.model.max_context}): every sample must fit one row",
    )
    require(
        not cfg.model.routing_replay or cfg.model.source not in ("smollm2", "tiny"),
        f"model.routing_replay: model.source={cfg.model.source!r} is a dense model (routing "
        "replay is for mixture-of-experts models: a Qwen3-MoE or Mixtral checkpoint)",
    )
    lora = cfg.trainer.lora
    check_section("trainer.lora", lora)
    require(
        bool(lora.targets) and set(lora.targets) <= set(LORA_TARGETS),
        f"trainer.lora.targets must be a non-empty subset of {LORA_TARGETS}, got "
        f"{tuple(lora.targets)}",
    )
    require(
        cfg.data.train_seed != cfg.data.eval_seed,
        "data.train_seed must differ from data.eval_seed (held-out problems)",
    )
    check_tasks(cfg.data)
    task_configs(cfg.data)  # parses, or raises naming data.task_config
    if cfg.learners:
        _check_learners(cfg)
    return cfg


def learner_config(cfg: ExperimentConfig, learner: LearnerSection) -> ExperimentConfig:
    """The one-learner config of `learner`: the top level with its sections."""
    return dataclasses.replace(
        cfg,
        seed=learner.seed,
        algorithm=learner.algorithm,
        optimizer=learner.optimizer,
        critic=learner.critic,
        data=learner.data,
        eval=learner.eval,
        pipeline=learner.pipeline,
        trainer=dataclasses.replace(cfg.trainer, lora=learner.lora),
        learners=(),
    )


# What the one generation service is built with: the same for every learner.
_SERVICE_FIELDS = ("deterministic", "precompile", "timeout_s")


def _check_learners(cfg: ExperimentConfig) -> None:
    """Several learners on one generation service (docs/learners.md): each a valid
    one-learner config of its own, each with its own adapter of one shape."""
    learners = cfg.learners
    require(
        len(learners) >= 2,
        "learners: one learner is the top-level config itself; name two or more (or none)",
    )
    seen: set[str] = set()
    for i, learner in enumerate(learners):
        name = learner.name
        require(
            bool(name) and name.replace("_", "").replace("-", "").isalnum(),
            f"learners[{i}].name={name!r}: a learner needs a name of letters, digits, '-' "
            "and '_' (its directory under the workdir, and its adapter's)",
        )
        require(
            name not in seen,
            f"learners: two learners named {name!r} (each learner's name is its directory "
            "and its adapter: they must differ)",
        )
        seen.add(name)
        at = f"learners[{i}] ({name})"
        require(
            learner.lora.rank > 0,
            f"{at}: lora.rank must be > 0: learners share the frozen base model on one "
            "generation service, each training its own LoRA adapter",
        )
        first = learners[0].lora
        require(
            (learner.lora.rank, learner.lora.targets) == (first.rank, first.targets),
            f"{at}: lora rank {learner.lora.rank} on {learner.lora.targets} differs from "
            f"{learners[0].name}'s rank {first.rank} on {first.targets}: the engine's "
            "adapter slots are one table of that rank and those matrices (alpha may differ: "
            "each slot's own scale is folded into its B)",
        )
        require(
            learner.lora.alpha > 0,
            f"{at}: lora.alpha={learner.lora.alpha} must be > 0 (the adapter's scale is "
            "alpha / rank)",
        )
        require(
            learner.pipeline.mode != "colocated",
            f"{at}: pipeline.mode='colocated' alternates the devices between one learner's "
            "stages; learners share a generation service: use stream_sync, stream_async or "
            "disaggregated_batch",
        )
        for field in _SERVICE_FIELDS:
            mine, top = getattr(learner.pipeline, field), getattr(cfg.pipeline, field)
            require(
                mine == top,
                f"{at}: pipeline.{field}={mine!r} differs from the top level's {top!r}: it "
                "configures the generation service the learners share",
            )
        try:
            validate(learner_config(cfg, learner))
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from None
    require(
        not cfg.environment.name,
        f"learners with environment.name={cfg.environment.name!r}: multi-turn episodes with "
        "several learners are not built (one learner runs them)",
    )
    require(
        cfg.scheduling.elastic_reserved == 0,
        "learners with scheduling.elastic_reserved > 0: each learner plans its own "
        "dispatch, and their elastic rules would fight over the shared instances",
    )
    require(
        cfg.warmup.steps == 0,
        "learners with warmup.steps > 0: the supervised warm-up changes the base the "
        "learners share; warm up once (init_from its checkpoint) instead",
    )
    require(
        cfg.generation.weight_dtype != "int8",
        "learners with generation.weight_dtype='int8': the engine's adapter slots keep a "
        "float base (int8 merges adapters into the quantised weights)",
    )


def _check_mesh(mode: str, m: MeshSection) -> None:
    """How the devices split into instances and tensor-parallel groups (`mesh.py`).

    The rule is the same in one process and across processes: there each generation
    process holds `generate_devices` (its instances) and each training process
    `train_devices`, whole `train_tp` groups of a training mesh over all of them.
    Colocated mode (one process) puts both roles on all the devices.
    """
    slots = len(m.instance_slots)
    require(slots >= 1, "mesh.instance_slots must name at least one instance")
    require(all(s >= 1 for s in m.instance_slots), "mesh.instance_slots must all be >= 1")
    if mode == "colocated":
        need = m.generate_devices + m.train_devices
        require(
            need % slots == 0,
            f"pipeline.mode='colocated' splits mesh.generate_devices + mesh.train_devices = "
            f"{need} devices into the {slots} instances of mesh.instance_slots, which must "
            "divide them",
        )
        require(
            need % m.train_tp == 0,
            f"mesh.train_tp ({m.train_tp}) must divide the {need} devices of "
            "pipeline.mode='colocated' (mesh.generate_devices + mesh.train_devices)",
        )
        return
    require(
        m.train_devices % m.train_tp == 0,
        f"mesh.train_tp ({m.train_tp}) must divide mesh.train_devices ({m.train_devices})",
    )
    require(
        m.generate_devices % m.instance_tp == 0,
        f"mesh.instance_tp ({m.instance_tp}) must divide mesh.generate_devices "
        f"({m.generate_devices})",
    )
    require(
        m.generate_devices // m.instance_tp == slots,
        f"mesh.instance_slots names {slots} instances but mesh.generate_devices / "
        f"mesh.instance_tp = {m.generate_devices} / {m.instance_tp} makes "
        f"{m.generate_devices // m.instance_tp}",
    )


def episode_tokens(cfg: ExperimentConfig) -> int:
    """An episode's token budget after its prompt (`environment.max_episode_tokens`, or
    what `model.max_context` leaves after the longest prompt)."""
    e = cfg.environment
    return e.max_episode_tokens or cfg.model.max_context - cfg.generation.max_prompt_len


def sample_tokens(cfg: ExperimentConfig) -> int:
    """The tokens a sample holds after its prompt at most: one response
    (`generation.max_new_tokens`), or with an environment an episode's whole budget
    (`episode_tokens`: its turns share one engine slot)."""
    return episode_tokens(cfg) if cfg.environment.name else cfg.generation.max_new_tokens


MULTI_AGENT_KV_HOLD_S = 5.0  # the longest a multi-agent run holds an idle role's KV


def _check_environment(cfg: ExperimentConfig) -> None:
    """Episodes (docs/episodes.md): the rollout wrapper, the limits, what they refuse."""
    e, p, g = cfg.environment, cfg.pipeline, cfg.generation
    wrappers, kind = rollout_names(p.rollout)
    drivers = [w for w in wrappers if w in ("episodes", "agents", "multi_agent")]
    require(
        bool(e.name) == bool(drivers),
        f"environment.name={e.name!r} and pipeline.rollout={p.rollout!r}: an environment "
        "needs the 'episodes' wrapper (e.g. pipeline.rollout='episodes+full'), the "
        "'agents' one or (several agents) 'multi_agent', and the wrapper an environment",
    )
    require(
        len(drivers) <= 1,
        f"pipeline.rollout={p.rollout!r}: 'episodes' (in-process) or 'agents' (scaffolds "
        "through the endpoint), not both, and 'multi_agent' (several agents) alone",
    )
    roles = MULTI_AGENT_ENVIRONMENTS.get(e.name, ())
    require(
        bool(roles) == ("multi_agent" in drivers),
        f"environment.name={e.name!r} and pipeline.rollout={p.rollout!r}: a multi-agent "
        f"environment ({', '.join(MULTI_AGENT_ENVIRONMENTS)}) runs under 'multi_agent' "
        "(e.g. 'multi_agent+full'), and 'multi_agent' needs one",
    )
    if roles:
        require(
            kind == "full",
            f"pipeline.rollout={p.rollout!r}: multi-agent episodes run with 'full' (dynamic "
            "sampling's refills and partial rollout's rounds do not place later agents' "
            "turns yet)",
        )
        require(
            p.group_size % len(roles) == 0,
            f"pipeline.group_size={p.group_size}: a multiple of {e.name!r}'s "
            f"{len(roles)} roles {roles} (each group holds group_size / {len(roles)} "
            "episodes, one seat of each per role)",
        )
        require(
            g.kv_hold_s <= MULTI_AGENT_KV_HOLD_S,
            f"generation.kv_hold_s={g.kv_hold_s}: a multi-agent episode's role keeps its "
            "KV while the other roles act, and their turns need slots too; with more open "
            "conversations than slots they would wait that long for a kept slot (at most "
            f"{MULTI_AGENT_KV_HOLD_S:g} s: the least recently used kept KV is given up "
            "and re-prefilled when its role's turn comes)",
        )
        require(
            cfg.warmup.steps == 0 and cfg.algorithm.sft_coef == 0,
            f"environment.name={e.name!r}: a multi-agent episode has no single "
            "conversation to demonstrate (warmup.steps and algorithm.sft_coef must be 0)",
        )
    require(
        cfg.warmup.steps == 0 or bool(e.name),
        f"warmup.steps={cfg.warmup.steps}: the warm-up trains on an environment's "
        "demonstrations; set environment.name",
    )
    require(
        cfg.algorithm.sft_coef == 0 or (bool(e.name) and e.name != "openenv"),
        f"algorithm.sft_coef={cfg.algorithm.sft_coef}: the supervised loss trains on an "
        f"environment's demonstrations; environment.name={e.name!r} gives none",
    )
    if not e.name:
        return
    require(
        wrappers[-1] == drivers[0],
        f"pipeline.rollout={p.rollout!r}: {drivers[0]!r} must wrap the kind directly (the "
        "last wrapper before it)",
    )
    require(
        drivers[0] != "agents" or kind in ("full", "dynamic_sampling"),
        f"pipeline.rollout={p.rollout!r}: scaffolds' episodes ('agents') run with 'full' or "
        "'dynamic_sampling' (partial rollout of them is not built)",
    )
    require(
        e.scaffold != "environment_group" or drivers[0] == "agents",
        f"environment.scaffold={e.scaffold!r}: a scaffold plays 'agents' episodes; got "
        f"pipeline.rollout={p.rollout!r}",
    )
    require(
        e.scaffold in ("environment", "environment_group")
        or (drivers[0] == "agents" and e.name in FUNCTION_ENVIRONMENTS),
        f"environment.scaffold={e.scaffold!r}: an agent framework plays 'agents' episodes of "
        f"an environment of OpenAI functions ({', '.join(FUNCTION_ENVIRONMENTS)}); got "
        f"environment.name={e.name!r}, pipeline.rollout={p.rollout!r}",
    )
    require(
        e.step_credit == 0 or e.name in STEP_CREDIT_ENVIRONMENTS,
        f"environment.step_credit={e.step_credit}: credit for each correct step, given by "
        f"{', '.join(STEP_CREDIT_ENVIRONMENTS)}; got environment.name={e.name!r}",
    )
    require(
        (e.name == "openenv") == bool(e.openenv),
        f"environment.name={e.name!r}, environment.openenv={e.openenv!r}: name 'openenv' "
        "runs the OpenEnv environment class environment.openenv ('module:Class'), and only it",
    )
    require(
        e.name != "openenv" or kind != "partial",
        "environment.name='openenv' with pipeline.rollout='episodes+partial': an OpenEnv "
        "session is state a checkpoint cannot hold, and partial rollout carries episodes "
        "in checkpoints; use 'episodes+full' or 'episodes+dynamic_sampling'",
    )
    require(
        e.name != "openenv" or cfg.warmup.steps == 0,
        f"warmup.steps={cfg.warmup.steps}: an OpenEnv environment gives no demonstrations",
    )
    require(
        kind != "partial" or p.lag_policy == "drop",
        "pipeline.rollout='episodes+partial' needs pipeline.lag_policy='drop' (an episode "
        "regenerated from its prompt would have to rewind its environment)",
    )
    budget = episode_tokens(cfg)
    require(
        g.max_prompt_len + budget <= cfg.model.max_context,
        f"environment.max_episode_tokens ({e.max_episode_tokens}) + generation.max_prompt_len "
        f"({g.max_prompt_len}) exceeds model.max_context ({cfg.model.max_context})",
    )
    require(
        g.max_new_tokens < budget,
        f"generation.max_new_tokens ({g.max_new_tokens}, each turn's cap) must be below the "
        f"episode's token budget ({budget}: environment.max_episode_tokens, or "
        "model.max_context - generation.max_prompt_len), or a second turn never fits",
    )
    require(
        e.max_turns >= 2 or e.name == "retry",
        f"environment.max_turns={e.max_turns}: a tool environment needs >= 2 turns (a call, "
        "then the answer)",
    )
    require(
        cfg.algorithm.advantage != "gae",
        "algorithm.advantage='gae' with an environment: the critic's GAE would run over the "
        "environment's tokens; use an outcome estimator (grpo, rloo, ...)",
    )
    require(
        cfg.algorithm.overlong_buffer == 0,
        "algorithm.overlong_buffer > 0 with an environment: an episode's length holds the "
        "environment's tokens; the per-turn and per-episode limits bound it instead",
    )
    require(
        not g.length_replay,
        "generation.length_replay with an environment: forced lengths replay single-turn samples",
    )


def _check_dynamic_sampling(p: PipelineSection) -> None:
    """The combinations dynamic sampling refuses (docs/pipeline.md, "Dynamic sampling")."""
    require(
        p.group_size >= 2,
        "pipeline.rollout='dynamic_sampling' needs pipeline.group_size >= 2 (a group of one "
        "sample has no reward variance: every group would be skipped)",
    )
    require(
        p.mini_batches == 1,
        f"pipeline.rollout='dynamic_sampling' needs pipeline.mini_batches=1 (it is "
        f"{p.mini_batches}): a step that ran out of draws holds fewer groups than the "
        "mini-batches split",
    )
    require(
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
      scoring: the last S processes score with the run's judge (`judge.model`); 0: the
        judge, if any, runs in each training process (always in one process).
    """

    total: int | None
    generation: int
    scoring: int = 0

    def __post_init__(self):
        if self.total == 1 and (self.generation, self.scoring) != (0, 0):
            raise ValueError(
                f"one process has no generation or scoring processes, got {self.generation} "
                f"and {self.scoring}"
            )
        if self.total != 1 and not (
            self.generation >= 1
            and self.scoring >= 0
            and (self.total is None or self.generation + self.scoring < self.total)
        ):
            raise ValueError(
                f"{self.total} processes need 1 <= generation and generation + scoring < "
                f"total, got {self.generation} and {self.scoring}"
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
        return None if self.total is None else self.total - self.generation - self.scoring

    def __str__(self) -> str:
        if not self.several:
            return "1 process"
        where = "(STREAMRL_NUM_PROCESSES, STREAMRL_GENERATION_PROCESSES"
        where += ", STREAMRL_SCORING_PROCESSES)" if self.scoring else ")"
        scoring = f" and {self.scoring} scoring" if self.scoring else ""
        if self.total is None:
            return f"several processes, {self.generation} generating{scoring} {where}"
        roles = f"{self.generation} generating, {self.training} training{scoring}"
        if not self.scoring:
            roles = f"{self.generation} generating and {self.training} training"
        return f"{self.total} processes, {roles} {where}"


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
    j = cfg.judge
    require(
        not n.scoring or j.placement == "scoring",
        f"{n.scoring} scoring process(es) with judge.placement={j.placement!r}: the judge "
        "is the generation service's tenant, so scoring processes would have nothing to "
        "score (placement 'scoring' puts it there)",
    )
    require(
        not n.scoring or (j.model and j.mode == "stage" and not cfg.learners),
        f"{n.scoring} scoring process(es) serve the run's judge as a stage of the stream: "
        f"they need judge.model (got {j.model!r}) with judge.mode='stage' (got {j.mode!r}) "
        f"and no learners (got {len(cfg.learners)}); this run has {n}",
    )
    if cfg.learners and n.several:
        return _check_learners_across(cfg, n)
    if not n.several:
        slots = len(cfg.mesh.instance_slots)
        require(
            sc.elastic_reserved < slots,
            f"scheduling.elastic_reserved={sc.elastic_reserved} must leave at least one of the "
            f"{slots} instances in mesh.instance_slots active (in one process it counts "
            "instances; across processes, generation processes)",
        )
        return cfg
    require(
        p.mode != "colocated",
        f"pipeline.mode='colocated' shares one device set between generation and training, "
        f"so it runs in one process; this run has {n}. Use disaggregated_batch, stream_sync "
        "or stream_async, or run one process",
    )
    a = cfg.algorithm
    require(
        a.sft_coef == 0 or n.training is None or a.sft_batch % n.training == 0,
        f"algorithm.sft_batch={a.sft_batch} must be a multiple of the {n.training} training "
        f"processes (each feeds an equal slice of every demonstration batch); this run has {n}",
    )
    if n.training is not None and n.training > 1:
        try:
            check_training_split(
                n.training, p.prompts_per_step // p.mini_batches, p.micro_batch_groups
            )
        except ConfigError as e:
            raise ConfigError(f"this run has {n}: {e}") from None
    require(
        sc.elastic_reserved < n.generation,
        f"scheduling.elastic_reserved={sc.elastic_reserved}: across processes it counts "
        f"reserved generation processes, and must leave at least one active; this run has {n}",
    )
    return cfg


def _check_learners_across(cfg: ExperimentConfig, n: Processes) -> ExperimentConfig:
    """Several learners across processes (pipeline/processes/learners.py): the training
    processes in one equal block per learner, and each learner's config a valid run on
    the generation processes and its block."""
    count = len(cfg.learners)
    require(
        n.training is None or n.training % count == 0,
        f"learners: {count} learners across processes train on equal blocks of the training "
        f"processes (one block each); this run has {n}: use a multiple of {count} training "
        "processes",
    )
    total = None if n.total is None else n.generation + n.training // count
    per = Processes(total=total, generation=n.generation)
    for i, learner in enumerate(cfg.learners):
        try:
            check(learner_config(cfg, learner), per)
        except ConfigError as e:
            raise ConfigError(f"learners[{i}] ({learner.name}) on its block: {e}") from None
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
    require(
        training >= 1 and per_mini % training == 0 and micro % training == 0,
        f"{training} training processes must divide pipeline.micro_batch_groups ({micro}) "
        f"and the groups per mini-batch (pipeline.prompts_per_step / pipeline.mini_batches "
        f"= {per_mini}): each owns an equal slice of every micro-batch",
    )
