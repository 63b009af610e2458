"""The objects one run shares between its generation side, ingest and trainer loop, made once.

`wire(cfg, components, workdir, ...)` creates them in dependency order: the
supervisor (failure latch, watchdog), the schedule, the weight board, the grouping
sample stream, the trace and metrics writers, the generation meter, the
evaluations, the prompt source, the reward pool, the environment of an episodes run
(which scores its answers on that pool), the rollout (`pipeline.rollout`, from the
registry in `rollouts/`), the scoring stage of a run with a judge, ingest (reward pool,
sample log) and the run's checkpoints (which
save the rollout's state, the prompt source's record and the scheduler's ranker).
The first failure reported to the supervisor fails the stream, the board and the
rollout, so every wait on them wakes at once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import TYPE_CHECKING, Any

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.config import ExperimentConfig, episode_tokens
from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.agents_sdk import openai_agents_scaffold
from streamrl_jax.endpoint.scaffolds import environment_group_scaffold, environment_scaffold
from streamrl_jax.endpoint.turns import Context
from streamrl_jax.endpoint.verifiers_env import verifiers_scaffold
from streamrl_jax.environments import EpisodeKit, EpisodeLimits, make_kit
from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine import EngineConfig, validate_request
from streamrl_jax.metrics import MetricsWriter, Tracer
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.pipeline import scoring
from streamrl_jax.pipeline.components import Components
from streamrl_jax.pipeline.ingest import Evaluations, Ingest
from streamrl_jax.pipeline.micro_batches import Scored, group_key
from streamrl_jax.pipeline.prompts import PromptSource
from streamrl_jax.pipeline.resume import RunCheckpoints
from streamrl_jax.pipeline.rollouts import (
    Kits,
    Outcomes,
    Returned,
    Rollout,
    RolloutContext,
    Verdicts,
    Where,
    make_rollout,
)
from streamrl_jax.pipeline.schedules import Schedule, WeightBoard
from streamrl_jax.pipeline.shards import TrainerShare
from streamrl_jax.pipeline.step_metrics import GenerationMeter
from streamrl_jax.pipeline.supervisor import Shutdown, Supervisor
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.scheduling.sample_log import SampleLog
from streamrl_jax.stream.sample_stream import SampleStream

if TYPE_CHECKING:  # (the endpoint, its server and fastapi: imported by a run with agents)
    from streamrl_jax.endpoint.kit import AgentKit


@dataclasses.dataclass(frozen=True)
class Trainers:
    """Where this process's trainer sits among the run's training processes."""

    share: TrainerShare  # its share of every micro-batch (`shards.Alone`: the only one)
    checkpoint_dir: str  # the run's one checkpoint directory
    checkpoint_processes: tuple[int, ...] | None = None  # orbax's active set (None: this one)


@dataclasses.dataclass(frozen=True)
class RunParts:
    """The shared objects of one run (module docstring)."""

    cfg: ExperimentConfig
    components: Components
    workdir: str
    trainers: Trainers
    supervisor: Supervisor
    schedule: Schedule
    board: WeightBoard
    stream: SampleStream[Scored]
    tracer: Tracer
    writer: MetricsWriter
    meter: GenerationMeter
    evals: Evaluations
    prompts: PromptSource
    rollout: Rollout
    ingest: Ingest
    ckpts: RunCheckpoints
    live: LiveScheduler
    episodes: EpisodeKit | None = None  # the environment (environment.name), closed last
    agents: AgentKit | None = None  # the endpoint and its scaffolds ("agents" rollout)

    def interrupt(self) -> None:
        """SIGINT/SIGTERM (the watchdog's stop): end the trainer's and driver's waits
        with `Shutdown`, which the trainer turns into a checkpointed stop."""
        self.stream.fail(Shutdown("shutdown requested by signal"), "shutdown")
        self.board.fail(Shutdown("shutdown requested by signal"))
        self.rollout.fail(Shutdown("shutdown requested by signal"))


def wire(
    cfg: ExperimentConfig,
    c: Components,
    workdir: str,
    trainers: Trainers,
    live: LiveScheduler,
    *,
    where: Where,
    generation_processes: tuple[int, ...] = (),
    verdicts: Verdicts | None = None,
    outcomes: Outcomes | None = None,
    shutdown: threading.Event | None = None,
) -> RunParts:
    """The run's shared objects. `live`: the scheduler of where generation runs
    (`Generation.scheduler`); `where`, `generation_processes`: which half of the rollout
    runs here ("here": both; "trainer": generation in those processes); `verdicts`, `outcomes`:
    the generation processes' judged groups (dynamic sampling across processes) and the
    training processes' step outcomes (the curriculum across processes); `shutdown`:
    the stop request's event (`Supervisor`; None: the run's own)."""
    p = cfg.pipeline
    sup = Supervisor(p, shutdown)
    schedule = Schedule.from_config(p)
    stream: SampleStream[Scored] = SampleStream(
        group_size=p.group_size,
        group_key=group_key,
        capacity=2 * p.prompts_per_step * p.group_size,
    )
    tracer = Tracer(cfg.log.trace)
    writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard)
    meter = GenerationMeter(tracer, sup.tick)
    evals = Evaluations(len(c.eval_prompts), writer, sup)
    prompts = PromptSource(c.prompts)
    pool = RewardPool(
        c.reward_fn, num_workers=2, on_error=cfg.data.reward_errors, sandbox=c.reward_sandbox
    )
    # Episodes step where they are generated: here, unless generation processes do it.
    episodes = cfg.environment.name and where != "trainer"
    kit = episode_kit(cfg, c.tokenizer, pool) if episodes else None
    agents = None
    if kit is not None and "agents" in p.rollout.split("+"):
        assert c.generation is not None, "scaffolds run where the engine is"
        ecfg = c.generation.engine_cfgs[0]
        agents = agent_kit(cfg, c.tokenizer, ecfg, c.model_cfg.vocab_size, kit)
    rollout = make_rollout(
        p.rollout,
        RolloutContext(
            pipeline=p,
            schedule=schedule,
            stream=stream,
            prompts=prompts,
            latch=sup.latch,
            overlong=OverlongPenalty.from_config(cfg.algorithm, cfg.generation.max_new_tokens),
            trainers=trainers.share,
            seed=cfg.seed,
            where=where,
            generation_processes=generation_processes,
            verdicts=verdicts,
            trainers_judge=where == "trainer" and bool(cfg.judge.model),
            outcomes=outcomes,
        ),
        Kits(episodes=kit, agents=agents),
    )
    # Straight to the rollout, or through the stream's third stage (a run with a judge).
    onward = scoring.onward(
        c.judge,
        cfg.judge,
        rollout.scored,
        supervisor=sup,
        tracer=tracer,
        timeout_s=p.timeout_s,
        log_path=os.path.join(workdir, scoring.JUDGE_LOG) if cfg.log.judge else None,
    )
    ingest = Ingest(
        c.tokenizer,
        pool,
        onward,
        evals,
        supervisor=sup,
        meter=meter,
        tracer=tracer,
        sample_log=(SampleLog(os.path.join(workdir, "samples.jsonl")) if cfg.log.samples else None),
    )
    ckpts = RunCheckpoints(
        cfg,
        c,
        workdir,
        directory=trainers.checkpoint_dir,
        processes=trainers.checkpoint_processes,
        schedule=schedule,
        prompts=prompts,
        rollout=rollout,
        ranker=live.ranker,
    )
    board = WeightBoard()

    def failed(component: str, exc: BaseException) -> None:  # wake every wait at once
        stream.fail(exc, component)
        board.fail(exc)
        rollout.fail(exc)

    sup.latch.add_listener(failed)
    return RunParts(
        cfg=cfg,
        components=c,
        workdir=workdir,
        trainers=trainers,
        supervisor=sup,
        schedule=schedule,
        board=board,
        stream=stream,
        tracer=tracer,
        writer=writer,
        meter=meter,
        evals=evals,
        prompts=prompts,
        rollout=rollout,
        ingest=ingest,
        ckpts=ckpts,
        live=live,
        episodes=kit,
        agents=agents,
    )


def agent_kit(
    cfg: ExperimentConfig, tokenizer: Tokenizer, ecfg: EngineConfig, vocab: int, kit: EpisodeKit
) -> AgentKit:
    """The endpoint on loopback (of this process: a generation process serves its own,
    for the episodes it owns) and its scaffold: the run's environment played through the
    OpenAI API (`endpoint/scaffolds.environment_scaffold`; `environment_group_scaffold`: a
    group's episodes together, their first turns one request of n=G choices; an OpenAI
    Agents SDK agent: `endpoint/agents_sdk.py`, or verifiers' tool-calling loop:
    `endpoint/verifiers_env.py`);
    `ecfg`, `vocab`: the engine the endpoint's requests go to."""
    from streamrl_jax.endpoint.kit import make_agent_kit

    p, g, e = cfg.pipeline, cfg.generation, cfg.environment
    play, needs = {
        "environment": (environment_scaffold, ""),
        "environment_group": (environment_group_scaffold, ""),
        "openai_agents": (openai_agents_scaffold, "the OpenAI Agents SDK (openai-agents)"),
        "verifiers": (verifiers_scaffold, "verifiers 0.4.0 (docs/endpoint.md: its install)"),
    }[e.scaffold]
    try:
        scaffold = play(kit.environment, "policy", e.max_turns, g.max_new_tokens)
    except ImportError as err:
        raise UserError(f"environment.scaffold={e.scaffold!r} needs {needs}: {err}") from None
    per_batch = p.prompts_per_step * p.group_size
    limits = api.Limits(
        max_messages=2 * e.max_turns + 8,
        max_tokens=g.max_new_tokens,
        timeout_s=p.timeout_s,
        max_inflight=4 * per_batch,
        max_n=p.group_size,  # a group's episodes' first turns (`PipelineBackend.choices`)
        episode_tokens=kit.limits.episode_tokens,  # the in-process episodes' budget
    )
    return make_agent_kit(
        Context.of(tokenizer, ecfg),
        # (its engines read stop strings: `components.GenerationParts.detokenize`)
        functools.partial(validate_request, ecfg, vocab, reads_text=True),
        lambda request: Returned(None, [request]),  # an episode's later turn, submitted
        scaffold,
        workers=per_batch * (p.staleness + 2),  # every episode in flight has its thread
        limits=limits,
    )


def episode_kit(cfg: ExperimentConfig, tokenizer: Tokenizer, pool: RewardPool) -> EpisodeKit:
    """The run's environment; its answers are scored on `pool` (the run's reward pool,
    sandboxed where the task needs it), each within the reward deadline."""
    wait = cfg.data.reward_timeout_s + 30.0  # the pool's own deadline fires first

    def score(text: str, metadata: dict[str, Any]) -> RewardResult:
        return pool.submit(text, metadata).result(timeout=wait)

    g = cfg.generation
    limits = EpisodeLimits(
        max_turns=cfg.environment.max_turns,
        turn_tokens=g.max_new_tokens,
        episode_tokens=episode_tokens(cfg),
        prompt_tokens=g.max_prompt_len,
    )
    return make_kit(cfg.environment, tokenizer, score, limits)
