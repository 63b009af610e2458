"""The experiment config's sections: frozen, keyword-only dataclasses, a comment a field.

Every registry name a field may take is a tuple here, as the user writes it;
`fields.py` checks them (and every numeric range), `parse.py` builds these from
a ConfigDict.
"""

from __future__ import annotations

import dataclasses

from streamrl_jax.errors import UserError


class ConfigError(UserError):
    """A mistake in the user's config, named by field: `launch` prints it as one line and
    exits with status 2 (no traceback)."""


# Registry names, as the user writes them. config/ is the bottom layer and imports
# no registry; tests/config_test.py asserts these equal the registries' keys
# (streamrl_jax.algorithms, model.config, scheduling.dispatch, rewards.jsonl).
MODES = ("colocated", "disaggregated_batch", "stream_sync", "stream_async")
NONFINITE = ("skip", "stop")
WEIGHT_TRANSPORTS = ("channel", "xla")  # several processes: how weight shards travel
# When the generation side takes new weights (docs/pipeline.md, "In-flight weight updates"):
# "boundary" once every earlier request finished (no sample mixes versions), "inflight" at
# the next decode-chunk boundary without draining (stream_async only).
WEIGHT_UPDATES = ("boundary", "inflight")
# A partial sample whose lag would pass pipeline.max_lag: "drop" its group (counted) or
# "regenerate" it from its prompt under the current weights (counted).
LAG_POLICIES = ("drop", "regenerate")
# pipeline.rollout: a kind, after optional wrappers joined with "+" (pipeline/rollouts/).
ROLLOUTS = ("full", "dynamic_sampling", "partial")
ROLLOUT_WRAPPERS = ("curriculum", "episodes", "agents", "multi_agent")
# environment.name (streamrl_jax/environments/): "" = single-turn samples, no environment.
ENVIRONMENTS = ("", "calculator", "retry", "openenv", "chained_calculator", "solve_verify")
# Multi-agent environments (pipeline.rollout 'multi_agent+full') and their roles, in seat
# order (environments/protocol.MultiAgentEnvironment; a test holds them equal)
MULTI_AGENT_ENVIRONMENTS = {"solve_verify": ("solver", "verifier")}
# ... those whose tools are OpenAI functions (an agent framework can play them)
FUNCTION_ENVIRONMENTS = ("chained_calculator", "openenv")
# Environments that can tell a correct step of an episode (environment.step_credit)
STEP_CREDIT_ENVIRONMENTS = ("chained_calculator",)
# environment.scaffold (endpoint/): what plays an 'agents' episode through the endpoint:
# the environment's own loop, the same for a prompt's G episodes together (their first
# turns one request with n=G), an OpenAI Agents SDK agent (openai-agents), or verifiers'
# tool-calling loop (verifiers 0.4.0)
SCAFFOLDS = ("environment", "environment_group", "openai_agents", "verifiers")
# environment.tool_format (environments/tool_calls.py): "auto" = the model's convention.
TOOL_FORMATS = ("auto", "hermes", "simple")
# The generation copy's matrices (generation/quant.py): "auto" = model.generate_dtype,
# "int8" = per-channel int8 weights with W8A8 matmuls (needs algorithm.tis_cap > 0).
WEIGHT_DTYPES = ("auto", "int8")
# CPU backend: the library of the decode chunk's f32/bf16 matmuls (generation/engine_config.py)
CPU_DOTS = ("auto", "eigen", "ynnpack")
# Outcome estimators (algorithms.ADVANTAGES) and, with a critic, "gae"
# (algorithms.CRITIC_ADVANTAGES; selects the critic section).
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
POLICY_LOSSES = ("ppo_clip", "dapo")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
# The implicit PRM's process rewards, before their returns reach the advantages: as they
# are, or with PRIME's leave-one-out baseline over each group (algorithms/prm.py)
PRM_BASELINES = ("none", "leave_one_out")
LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("dots_attention", "minimal", "full", "none")  # = model.config's
BAD_ROWS = ("error", "skip")
OVERLONG_PROMPTS = ("drop", "error", "truncate")
REWARD_ERRORS = ("raise", "zero")
REWARDS = ("task", "vowels")
REWARD_SANDBOXES = ("auto", "process", "inline")
DISPATCHES = ("round_robin", "random", "skew_aware", "oracle")
OBJECTIVES = ("max", "sum")
PLANNERS = ("lpt", "groups")
WHITENING = ("group", "none")  # trainer/critic.py
JUDGE_MODES = ("stage", "blocking")  # pipeline/scoring.py
# where a judge's forwards run: its own scoring mesh or scoring processes, or the
# generation service's instances as a tenant (pipeline/tenant.py)
JUDGE_PLACEMENTS = ("scoring", "generation")
# rewards/judge.py: the score tokens' probabilities, or the last score the judge writes
JUDGE_VERDICTS = ("probability", "parsed")
# The default judge prompt (rewards/judge.py): Yes or No, read from the two tokens'
# probabilities (SmolLM2-135M puts ~0.45 of its mass on them here; on a 1-5 grade, ~0.17).
JUDGE_RUBRIC = (
    "A good response solves the question with short working and ends with its final "
    "answer inside <answer></answer> tags."
)
JUDGE_TEMPLATE = (
    "{rubric}\n\nQuestion: {question}\n\nResponse: {response}\n\n"
    "Does the response follow the rubric? Answer Yes or No."
)
JUDGE_SCORES = ("No", "Yes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model, and its numerics."""

    source: str = "smollm2"  # "smollm2" (embedded GGUF), "tiny" (random), or a path
    param_dtype: str = "float32"  # trainer master weights
    dtype: str = "float32"  # trainer compute dtype
    generate_dtype: str = "float32"  # generation weights / KV cache dtype
    # what the backward keeps of each block: one of REMAT_POLICIES (ModelConfig.remat)
    remat: str = "dots_attention"
    # the trainer's residual stream sharded over mesh.train_tp along the sequence
    # between blocks (ModelConfig.sequence_parallel): 1/tp of the kept activations
    sequence_parallel: bool = False
    max_context: int = 512  # cap on prompt + response length used by this run
    # a mixture of experts: generation records each token's experts, training replays
    # them instead of routing again (model/routes.py)
    routing_replay: bool = False


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
    weight_dtype: str = "auto"  # one of WEIGHT_DTYPES: "int8" = quantised rollout (FlashRL)
    # one of CPU_DOTS: the CPU decode chunk's matmuls, "eigen", XLA:CPU's default "ynnpack"
    # or "auto" (Eigen for wide models: faster for SmolLM2 at 8-16 rows, slower for the tiny
    # model); other backends and int8 engines ignore it
    cpu_dots: str = "auto"
    # a group's members (same prompt) prefill it once, the rest copy its KV (bitwise equal)
    share_prefill: bool = True
    # an episode's slot is kept for its next turn; once requests wait for a slot, a slot
    # kept longer than this is given up, least recently used first (its next turn then
    # re-prefills); 0: at once (a served endpoint: no request waits on an idle episode)
    kv_hold_s: float = 120.0
    # each sampled token's k most likely alternatives and their log-probs, kept for the
    # endpoint's `top_logprobs` (a request may ask up to k); compiled into prefill and
    # decode, 0 (training: nothing reads them) adds nothing; at most 64
    top_logprobs: int = 0


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
    weight_update: str = "boundary"  # one of WEIGHT_UPDATES; "inflight": stream_async only
    # most lag (trainer step - the sample's oldest token version) a trained sample may have;
    # a sample beyond it is counted and dropped (or raises with strict_versions).
    # 0 = pipeline.staleness (the four modes' contract)
    max_lag: int = 0
    # What a step trains (pipeline/rollouts/): "full" (every group of batch b),
    # "dynamic_sampling" (DAPO: groups without reward variance skipped and replaced),
    # "partial" (rounds of partial_budget_tokens, unfinished samples carried over), and
    # wrappers before a kind: "curriculum+dynamic_sampling".
    rollout: str = "full"
    # partial rollout (stream_async): each step's generation is a round in which every
    # sample generates at most this many tokens; unfinished ones pause and continue in the
    # next round under newer weights (re-prefilled); needs max_lag > staleness
    partial_budget_tokens: int = 0
    lag_policy: str = "drop"  # one of LAG_POLICIES: a paused sample that would pass max_lag
    # micro-batches in group order, one decode shape: bitwise-reproducible training
    deterministic: bool = False
    # compile before the first step what the run will meet: every generation instance's
    # decode and prefill shapes, and with generation.length_replay the trainer's
    # reachable micro-batch shapes (pipeline/precompile.py): no mid-run compilation
    precompile: bool = False
    nonfinite: str = "skip"  # NaN/Inf loss or gradients: "skip" the update (counted) | "stop"
    watchdog_s: float = 120.0  # warn when a stage with work makes no progress this long
    timeout_s: float = 600.0  # longest wait on any pipeline stage before it is reported stalled
    # Several processes: how weight shards reach the generation processes: "channel" (the
    # CURVE channel) | "xla" (jax.experimental.transfer, device to device; NO
    # authentication, trusted networks only: docs/multicontroller.md).
    weight_transport: str = "channel"
    weight_checksum: bool = False  # several processes: crc32 of every weight piece, checked
    # dynamic sampling: most replacement prompts drawn per step; past it the step trains
    # what it has (dynamic_short = 1 in its metrics). 0 = skip only, never refill
    dynamic_sampling_max_draws: int = 16
    # curriculum: a prompt whose group was all right or all wrong has its draw probability
    # multiplied by this; a group with both sets it back to 1
    curriculum_decay: float = 0.5
    curriculum_floor: float = 0.1  # the lowest draw probability: nothing starves


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
    # Mixture-of-experts models: the router's load-balancing loss (Switch Transformer's,
    # as transformers computes it) times this (0 = off; Qwen3-MoE pretrained with 0.001)
    router_aux_coef: float = 0.0
    tis_cap: float = 0.0  # truncated importance-sampling cap vs behaviour log-probs (0 = off)
    # DAPO soft overlong punishment (algorithms/overlong.py): responses longer than
    # generation.max_new_tokens - overlong_buffer lose up to overlong_penalty reward,
    # linearly in the buffer, all of it at the cap (truncated). 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the maximum penalty (reward units), >= 0
    # On-policy distillation (algorithms/distill.py): a frozen teacher of the policy's
    # architecture (a run's checkpoint, an HF directory or a GGUF file) scores the
    # student's tokens; each token's advantage gains distill_coef * (log pi_teacher -
    # log pi_student). "" = off
    distill_teacher: str = ""
    distill_coef: float = 1.0
    # An auxiliary supervised loss on the environment's demonstrations, mixed into RL
    # steps (learner/supervised.py): with every RL micro-batch, sft_batch demonstrations
    # trained with advantage sft_coef (sft_coef x their negative log-likelihood). 0 = off
    sft_coef: float = 0.0
    sft_batch: int = 8  # demonstrations per RL micro-batch
    # Implicit process rewards (PRIME; algorithms/prm.py, learner/prm.py): a process reward
    # model of the policy's architecture, starting as the policy, trained online on the
    # outcome labels with its own optimizer (learning rate prm_learning_rate); each
    # response token's advantage gains prm_coef * the sum of the process rewards
    # beta * (log pi_prm - log pi_ref) from it to the sample's end. 0 = off
    prm_coef: float = 0.0
    prm_beta: float = 0.05
    prm_learning_rate: float = 1e-6
    # one of PRM_BASELINES: "leave_one_out" is PRIME's (each token's process reward less
    # the mean process reward of the group's other samples), "none" adds them as they are
    prm_baseline: str = "none"


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


# The matrices a LoRA adapter may target (model/lora.py), by the names users know.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
    """LoRA: the policy trains adapters of rank `rank` on the `targets` matrices of every
    block, the base stays frozen (model/lora.py; docs/model.md, "LoRA")."""

    rank: int = 0  # 0 = full fine-tuning
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    # of q, k, v, o, gate, up, down (a mixture of experts' gate/up/down: its experts')
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSection:
    """How the trainer lays out a micro-batch (trainer/batch.py, trainer/packing.py).

    Both switches change only the layout, never the loss or its gradient (beyond
    float summation order), for every advantage estimator and aggregation.
    """

    # a GRPO group's prompt runs once per row and its G responses follow it, each
    # attending to the prompt and to itself: P + G*R (+ G - 1) trained tokens, not G*(P + R)
    shared_prompt: bool = True
    pack: bool = True  # several groups (or samples) share a row when they fit
    # longest training row in tokens; a longer group is split over rows, each with the
    # prompt (0 = auto: max(model.max_context, min(the longest possible group, 1024)))
    row_tokens: int = 0
    lora: LoraSection = LoraSection()


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
    # a reward call that raised, timed out or lost its worker: "raise" (end the run) | "zero"
    # (score 0, counted in reward_errors / reward_timeouts)
    reward_errors: str = "raise"
    # where scorers run (rewards/sandbox.py): "process" (confined workers with a deadline),
    # "inline" (threads here), "auto" (inline only when every task's scorer is known not
    # to evaluate model text: rewards.tasks.INLINE_SAFE_TASKS)
    reward_sandbox: str = "auto"
    reward_timeout_s: float = 10.0  # deadline of one sandboxed reward call
    reward_memory_mb: int = 2048  # address space of a sandboxed reward worker
    # "task": the dataset's scorer; "vowels": a dense stand-in (rewards/vowels.py) for
    # tests of untrained tiny models, which never earn the task reward
    reward: str = "task"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    """Held-out evaluation (greedy)."""

    every: int = 5  # evaluate every N steps (0 = only at start and end)
    num_problems: int = 32  # held-out problems per evaluation (greedy)
    at_start: bool = True  # also the starting policy's (step 0): the curve's first point


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentSection:
    """Multi-turn episodes (docs/episodes.md): with a name, `pipeline.rollout` starts with
    "episodes+" and every sample (held-out ones too) is an episode of this environment."""

    name: str = ""  # one of ENVIRONMENTS ("" = single-turn)
    tool_format: str = "auto"  # auto (the model's convention) | hermes | simple
    max_turns: int = 4  # policy turns per episode (the episode ends after the last)
    # Tokens after the prompt (policy + environment) per episode; 0 = up to model.max_context.
    # Each turn's policy tokens are capped by generation.max_new_tokens.
    max_episode_tokens: int = 0
    max_attempts: int = 3  # retry: answers per episode
    attempt_discount: float = 0.5  # retry: reward x discount^(attempt - 1)
    # Process credit (STEP_CREDIT_ENVIRONMENTS): the reward of a whole correct chain of
    # steps, each correct step earning its share as it is taken, each call once the chain is
    # done costing one (the answer earns its score)
    step_credit: float = 0.0
    tool_sandbox: bool = True  # run tools in confined worker processes (False: threads)
    tool_timeout_s: float = 5.0  # deadline of one tool call
    tool_memory_mb: int = 1024  # address-space limit of a tool worker
    tool_output_chars: int = 256  # a longer tool result is cut (and counted as a failure)
    workers: int = 2  # environment steps (and tool workers) run at once
    # pipeline.rollout="agents+...": who plays an episode through the endpoint, one of
    # SCAFFOLDS ("environment_group": the environment's loop playing a group's episodes
    # together, their first turns one request with n=G; "openai_agents": an OpenAI Agents
    # SDK agent, "verifiers": verifiers' tool environment loop; both for
    # FUNCTION_ENVIRONMENTS)
    scaffold: str = "environment"
    # name="openenv" (environments/openenv.py): an OpenEnv MCP environment class,
    # "module:Class", built per episode with the JSON object `openenv_kwargs`; the policy's
    # final answer goes to its tool `openenv_answer_tool`.
    openenv: str = ""
    openenv_kwargs: str = "{}"
    openenv_answer_tool: str = "submit_answer"


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeSection:
    """A generative judge scored as a stage of the stream between generation and the
    trainer (pipeline/scoring.py, rewards/judge.py): the trained reward is
    rule_coef * rule score + coef * verdict; held-out metrics stay the rule's."""

    model: str = ""  # "" = off; "smollm2" (the embedded GGUF), "tiny" (random) or a path
    coef: float = 1.0  # weight of the verdict (in [0, 1]) in the trained reward
    rule_coef: float = 1.0  # weight of the rule reward beside it (0: the judge alone)
    rubric: str = JUDGE_RUBRIC  # the template's {rubric}
    # {rubric} {question} {response} {answer}: one user message in the judge's chat template
    template: str = JUDGE_TEMPLATE
    scores: tuple[str, ...] = JUDGE_SCORES  # grades, worst first (one token each: probability)
    # one of JUDGE_VERDICTS: "probability" (of the score tokens, one forward) | "parsed"
    # (the last score in the judge's greedy answer of up to verdict_tokens tokens)
    verdict: str = "probability"
    verdict_tokens: int = 64
    min_mass: float = 0.1  # less probability than this on the score tokens: unparsable
    mode: str = "stage"  # one of JUDGE_MODES: "stage" | "blocking" (in the reward call)
    # one of JUDGE_PLACEMENTS: "scoring" (a scoring mesh of `devices`, or scoring
    # processes) | "generation" (a tenant of the generation service: each instance holds
    # the judge and runs its forwards between decode chunks, no devices of its own)
    placement: str = "scoring"
    devices: int = 1  # the scoring mesh: devices after the generation and training ones
    batch: int = 8  # samples per judge forward
    queue: int = 64  # most samples waiting for the judge (back-pressure beyond)
    max_wait_s: float = 0.05  # after a first sample, wait this long for a fuller forward
    max_tokens: int = 256  # the judge's prompt cap (the response's head is cut past it)
    timeout_s: float = 120.0  # a forward without verdicts by then: its samples are masked
    max_failure_rate: float = 0.1  # masked / judged over the run past this ends the run


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSection:
    """Supervised warm-up on the environment's demonstrations before RL (a fresh run only;
    pipeline/warmup.py)."""

    steps: int = 0  # optimizer steps (0 = off)
    batch: int = 16  # demonstrations per step
    learning_rate: float = 1e-4  # constant; RL then starts with a fresh optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogSection:
    tensorboard: bool = True
    trace: bool = True  # write trace.json
    progress: bool = True
    samples: bool = True  # append every completed training sample to samples.jsonl (ranker data)
    # a run with a judge: each judged sample's verdict, the judge's probability mass on its
    # score tokens and, for a parsed verdict, what the judge wrote, in judge.jsonl
    judge: bool = True
    final_params: bool = False  # write <workdir>/final_params.npz at the end (compare runs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulingSection:
    """Skew-aware scheduling (streamrl_jax/scheduling/live.py, docs/scheduling.md)."""

    dispatch: str = "round_robin"  # round_robin | random | skew_aware | oracle
    objective: str = "max"  # Algorithm 2 objective: max (makespan) | sum (paper's pseudocode)
    planner: str = "lpt"  # lpt (list scheduling, for fixed-shape engines) | groups (Algorithm 2)
    ranker_path: str = ""  # a ranker .npz from tools/train_ranker.py ("" = untrained)
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


# What one learner of several may set apart from the others (`LearnerSection`); the rest
# (model, mesh, generation, scheduling, trainer layout, logging, checkpoints) belongs to
# the one generation service and process they share.
LEARNER_SECTIONS = ("algorithm", "optimizer", "critic", "data", "eval", "pipeline", "lora")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSection:
    """One of several learners training at once on one generation service
    (`ExperimentConfig.learners`, docs/learners.md): its own LoRA adapter (slot = its
    place in `learners`), algorithm, learning rate, prompts and version contract
    (`pipeline.mode`, `staleness`). A config names only what differs from the top level;
    parsing fills in the rest from it, so each section here is whole."""

    name: str = ""  # its directory under the workdir; unique
    seed: int = 0
    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerSection = OptimizerSection()
    critic: CriticSection = CriticSection()
    data: DataSection = DataSection()
    eval: EvalSection = EvalSection()
    pipeline: PipelineSection = PipelineSection()
    lora: LoraSection = LoraSection()  # its adapter (trainer.lora)


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
    trainer: TrainerSection = TrainerSection()
    data: DataSection = DataSection()
    eval: EvalSection = EvalSection()
    environment: EnvironmentSection = EnvironmentSection()
    warmup: WarmupSection = WarmupSection()
    judge: JudgeSection = JudgeSection()
    log: LogSection = LogSection()
    checkpoint: CheckpointSection = CheckpointSection()
    scheduling: SchedulingSection = SchedulingSection()
    # () = one learner (this config); two or more = as many learners, each its own run
    # under <workdir>/<name>, sharing one generation service (docs/learners.md)
    learners: tuple[LearnerSection, ...] = ()
