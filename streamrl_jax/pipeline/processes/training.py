"""A training process of a multi-controller run (docs/multicontroller.md).

`run_training` makes a `TrainingLink`, the run's `Generation` (pipeline/generation.py):
its `SampleServer` hands each sample to the run's ingest (decode, reward, to the
rollout), each decode-chunk report to its meter and each round report to its rollout
(the trainer's half of partial rollout). A sample from the
wire carries no task metadata: the training process scores it against its own
copy of the problem, looked up by `tag.prompt_id` (`ProblemTable`), after
checking its token ids and lengths against the run's limits. The channel's
credit comes back only once the sample is in the stream, so the stream's
back-pressure reaches the generation processes. The weight sync's mover sends
this process's shards of W_v to the generation processes that need them through
a `ShardSender` (`distributed/shard_sync.py`) after the cast to the generation
dtype on the training mesh (in stream_async on the weight sync's background
thread, overlapping the next step). Then
`lifecycle.run_components`: the same trainer loop, version gate, evaluation
bookkeeping, metrics and trace as one process.

Checkpoints: every training process saves and restores its own shards into the
run's one `<workdir>/checkpoints` (orbax's active set, `parts.Trainers`);
`TrainingLink.begin` then tells the generation processes where the run starts and
sends a restored run's generation weights. Each step the link draws the batch's prompts
as the generation processes do (`step_started`: the checkpoints record the prompt
iterator) and checks every group against them (`verify`). The online ranker refresh
runs here, where the samples arrive; each refresh goes to the generation processes'
dispatchers through a second `ShardSender` (`TrainingLink.scheduler`).

Several training processes: each sends only the shards it addresses (a shard
replicated over processes by one of them: `distributed/reshard.py`); nothing is
gathered. The first writes the metrics and scores the held-out prompts.

**End of a run.** The trainer publishes its outcome (`ok`, `stopped`, or
`failed: ...`) under `run_end` and closes the weight channel; it then waits
(bounded) for every sample channel to close. **Failure.** A lost process is
`PeerLost` on the channels (a killed one at once, a silent one after
`STREAMRL_PEER_TIMEOUT_S`, default 30 s); it is logged as `lost peer: ...` naming it.
A lost *generation* process does not end the run while another is left: the
`Roster` (`roster.py`) records it, the first training process publishes who is lost
and which groups it already has, the others generate its groups again, the weight
sender drops it, and only the first copy of every sample is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from absl import logging
from flax import nnx

from streamrl_jax.config import ExperimentConfig, sample_tokens
from streamrl_jax.config.fields import rollout_names
from streamrl_jax.distributed import roles
from streamrl_jax.distributed.channel import ChannelClosed, PeerLost, TransportError
from streamrl_jax.distributed.judge_channel import RemoteJudge
from streamrl_jax.distributed.messages import (
    ChunkReport,
    GenerationFailed,
    RoundClosed,
    SpanReport,
)
from streamrl_jax.distributed.shard_sync import ShardSender
from streamrl_jax.distributed.transport import SampleServer
from streamrl_jax.distributed.wire import Message
from streamrl_jax.distributed.xla_pull import pull_server
from streamrl_jax.generation.types import Sample
from streamrl_jax.pipeline import components as components_lib
from streamrl_jax.pipeline.lifecycle import run_components
from streamrl_jax.pipeline.micro_batches import Group
from streamrl_jax.pipeline.parts import RunParts, Trainers
from streamrl_jax.pipeline.processes.outcomes import StoreOutcomes
from streamrl_jax.pipeline.processes.plan import (
    CLOSE_TIMEOUT_S,
    IN_FLIGHT,
    RANKER_KEY,
    RUN_END_KEY,
    SAMPLES_KEY,
    START_KEY,
    WEIGHTS_KEY,
    ranker_online,
)
from streamrl_jax.pipeline.processes.roster import ROSTER_KEY, Roster, reserved_processes
from streamrl_jax.pipeline.processes.verdicts import StoreVerdicts
from streamrl_jax.pipeline.resume import ResumePoint
from streamrl_jax.pipeline.rollouts import Where
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import Alone, TrainingGroup, ownership
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.scheduling.ranker import Ranker
from streamrl_jax.weight_sync import Mover, Params, Published, WeightSync, adapter_leaves


def send_to_generation(sender: ShardSender, timeout_s: float, adapters_only: bool = False) -> Mover:
    """The weight sync's mover in a training process: `ShardSender.send` of this
    process's shards of the cast weights to the generation processes that need them
    (the cast copy stays here: the weight board keeps it). Its seconds cover the cast,
    `device_get` of the shards sent, checksums and the wire, not the receivers'
    placement (each reports a `weight_receive/generation-<k>` span); its report (bytes
    to each receiver, GB/s, checksum) goes on the `weight_sync/transfer` span.

    `adapters_only` (LoRA, `WeightSync(adapters_only=True)`): the first version is sent
    whole and its base kept; every later one arrives as the adapters alone and goes out
    as a delta of their leaves (`ShardSender.send(changed=)`): the generation processes
    keep the base they received, and a restarted one is caught up with whole versions."""
    first: dict[str, Any] = {}

    def move(cast: Params, version: int) -> tuple[list[Published], int, dict[str, float]]:
        tree, changed = cast, None
        if adapters_only and not first:
            first["base"] = cast.filter(nnx.Not(nnx.LoRAParam))
        elif adapters_only:
            tree = nnx.merge_state(cast, first["base"])
            changed = adapter_leaves(tree)
        stats = sender.send(tree, version, timeout=timeout_s, changed=changed)
        return [Published(cast, version)], sender.num_receivers, stats.report()

    return move


class ProblemTable:
    """The training process's own problems, by id: what a wire sample is scored against."""

    def __init__(self, components: components_lib.Components, cfg: ExperimentConfig):
        problems = [*components.prompts.dataset, *(p.problem for p in components.eval_prompts)]
        self._metadata = {p.prompt_id: p.metadata for p in problems}
        self._vocab = components.model_cfg.vocab_size
        self._max_prompt = cfg.generation.max_prompt_len
        # An episodes run's samples are whole episodes (docs/episodes.md) in one engine
        # slot: prompt and episode within the slot's context, the engine's bound (the
        # episode's own budget after its prompt, in-process and through the endpoint
        # alike, is within it); a plain sample's response within max_new_tokens.
        self._episodes = bool(cfg.environment.name)
        self._max_new = None if self._episodes else cfg.generation.max_new_tokens
        self._max_total = self._max_prompt + sample_tokens(cfg)

    def attach(self, sample: Sample, source: str) -> Sample:
        """`sample` with its problem's metadata; TransportError if it is not one of ours."""
        tag = sample.tag
        metadata = self._metadata.get(tag.prompt_id)
        problem = None
        if metadata is None:
            problem = f"names prompt {tag.prompt_id!r}, which is in neither dataset"
        elif not 0 < sample.prompt.shape[0] <= self._max_prompt:
            problem = f"has a {sample.prompt.shape[0]}-token prompt (max {self._max_prompt})"
        elif self._max_new is not None and sample.num_tokens > self._max_new:
            problem = f"has {sample.num_tokens} response tokens (max {self._max_new})"
        elif sample.prompt.shape[0] + sample.num_tokens > self._max_total:
            problem = (
                f"has {sample.prompt.shape[0]} prompt and {sample.num_tokens} response tokens, "
                f"over the {self._max_total} of a slot's context"
            )
        elif ("episode" in sample.metadata) != self._episodes:
            problem = (
                "is an episode, but this run has no environment"
                if not self._episodes
                else "is not an episode, but this run's samples are (environment.name)"
            )
        else:
            for name in ("prompt", "response"):
                ids = getattr(sample, name)
                if ids.min() < 0 or ids.max() >= self._vocab:
                    problem = f"has {name} token ids outside [0, {self._vocab})"
        if problem is not None:
            raise TransportError(f"sample {sample.request_id!r} from {source} {problem}")
        return dataclasses.replace(sample, metadata={**metadata, **sample.metadata})


class TrainingLink:
    """The training process's `Generation` (pipeline/generation.py) and, once started, its
    `Running`: samples in, weights out."""

    where: Where = "trainer"  # the trainer's half of the rollout runs here

    def __init__(
        self,
        cfg: ExperimentConfig,
        dcfg: roles.DistributedConfig,
        r: roles.Roles,
        board: roles.Board = roles.PROGRAM,
    ):
        """`r`: the roles as this run sees them (a learner's: its own training processes);
        `board`: the run's keys (a learner's own, `processes/learners.py`)."""
        g = len(r.generation_processes)
        p = cfg.pipeline
        self.cfg, self.board = cfg, board
        self.verdicts = StoreVerdicts(board)  # the generation processes' judged groups
        # Several training processes: this one's index; the first sends the weights,
        # writes the metrics and scores the held-out prompts.
        self.index = r.training_processes.index(r.process_id)
        self.timeout = p.timeout_s
        self.num_instances = g * len(cfg.mesh.instance_slots)
        self.generation_processes = tuple(r.generation_processes)
        self.threads: list[threading.Thread] = []  # the channels own their threads
        self._attached = threading.Event()
        self._closed = False
        self._run: RunParts | None = None  # the run, once it started
        self._early: list[tuple[str, BaseException]] = []  # failures before the start
        self._inflight = threading.BoundedSemaphore(IN_FLIGHT)
        self._drawn: dict[int, list[str]] = {}  # batch -> its prompt ids (`verify`)
        self._start = 0  # the run's first batch (a resumed run's)
        # Lost generation processes and the samples received (first copies only).
        t = len(r.training_processes)
        self.outcomes = StoreOutcomes(t, board)  # the trainers' step outcomes (curriculum)
        own = ownership(p, t)
        groups = [i for i in range(p.prompts_per_step) if own.owner(i) == self.index]
        # The reserved (elastic) generation processes own nothing until activated.
        reserved = reserved_processes(g, cfg.scheduling.elastic_reserved)
        self.roster = Roster(g, groups, p.group_size, num_evals=0, reserved=reserved)
        self.steps = p.steps
        self.versions = Schedule.from_config(p)  # g(b): the version batch b needs
        # Partial rollout: a lost generation process ends the run (`_lost`).
        self.partial = rollout_names(p.rollout)[1] == "partial"
        self.duplicates = 0
        address = roles.advertised_host(dcfg)
        self.server = SampleServer(
            f"{address}:0",
            authkey=dcfg.authkey,
            capacity=max(2 * g, p.prompts_per_step * p.group_size),
            timeout_s=dcfg.peer_timeout_s,
            num_producers=g,
            on_sample=self._on_message,
            on_error=lambda exc: self._failed("generation process", exc),
            on_lost=self._lost,
            name=f"training-{self.index}",
        )
        # Every training process sends its own shards of the weights (device to device
        # with pipeline.weight_transport="xla": unauthenticated, opt-in).
        self.sender = ShardSender(
            f"{address}:0",
            authkey=dcfg.authkey,
            process=r.process_id,
            num_receivers=g,
            timeout_s=dcfg.peer_timeout_s,
            name=f"training-{self.index}",
            checksum=p.weight_checksum,
            xla=pull_server(p, address),
            on_lost=lambda k, exc: self._lost(f"generation-{k}", exc),
            on_rejoin=self._rejoined,
            keep=p.staleness + 2,  # what a restarted generation process may still need
        )
        self.board.publish(f"{WEIGHTS_KEY}-{self.index}", "{}:{}".format(*self.sender.address))
        # The online ranker refresh runs here, where the samples arrive; its parameters
        # (a host tree: whole leaves of this process) go through the shard sync to every
        # generation process's dispatcher (version = the ranker's steps).
        self.live: LiveScheduler | None = None  # made by `scheduler`
        self.ranker_sender: ShardSender | None = None
        if self.index == 0 and ranker_online(cfg):
            self.ranker_sender = ShardSender(
                f"{address}:0",
                authkey=dcfg.authkey,
                process=r.process_id,
                num_receivers=g,
                timeout_s=dcfg.peer_timeout_s,
                name="training-ranker",
            )
            self.board.publish(RANKER_KEY, "{}:{}".format(*self.ranker_sender.address))
        self.board.publish(f"{SAMPLES_KEY}-{self.index}", "{}:{}".format(*self.server.address))

    def _lost(self, name: str, exc: BaseException) -> bool:
        """A generation process is lost (a sample channel or the weight sender saw it):
        True when the run goes on with the others (the first training process publishes
        the new roster), False when none is left (the run fails naming it)."""
        try:
            k = int(name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            return False
        if self.partial:
            logging.error(
                "lost peer: %s; partial rollout: its paused samples and open rounds are "
                "gone with it, so the run ends (launched again, it resumes from the last "
                "checkpoint)",
                exc,
            )
            return False
        try:
            update = self.roster.lose(k)
        except ValueError as e:
            logging.error("lost peer: %s; %s", exc, e)
            return False
        if update is None:
            return True  # already known (its other channel)
        self.sender.drop(k)
        if self.ranker_sender is not None:  # its restarted process is admitted again
            self.ranker_sender.drop(k)
        logging.error(
            "lost peer: %s; going on with generation processes %s, which generate its "
            "groups again (roster epoch %d)",
            exc,
            self.roster.live(),
            update.epoch,
        )
        self._mark(f"lost generation-{k}")
        if self.index == 0:
            try:
                self.board.publish(f"{ROSTER_KEY}/{update.epoch}", update.encode())
            except Exception as e:  # noqa: BLE001 - the coordination service is this process's
                logging.error("could not publish the roster: %r", e)
                return False
        return True

    def _rejoined(self, k: int) -> None:
        """A lost generation process connected its weight channel again (the weight
        sender's I/O thread): publish the roster that gives it back its share from the
        first batch the trainer lacks, and send it the weights from that batch's version
        on (a thread of its own: it waits for the receiver's room)."""
        update = self.roster.rejoin(k)
        if update is None:
            return

        def catch_up() -> None:
            try:
                if self.index == 0:
                    self.board.publish(f"{ROSTER_KEY}/{update.epoch}", update.encode())
                first = self.versions.generation_version(update.floor)
                sent = self.sender.catch_up(k, first, self.timeout)
                self._mark(f"rejoined generation-{k}")
                logging.warning(
                    "generation-%d rejoined (roster epoch %d): it generates from batch %d; "
                    "sent it weights %s",
                    k,
                    update.epoch,
                    update.floor,
                    sent,
                )
            except Exception as e:  # noqa: BLE001 - the run cannot take it back
                self._failed(f"generation process {k} (rejoining)", e)

        threading.Thread(target=catch_up, name=f"rejoin-{k}", daemon=True).start()

    def _mark(self, what: str) -> None:
        """A roster change on the trace's `roster` track (the run's record of it)."""
        if self._attached.is_set():
            now = time.time()
            self._run.tracer.add_wall("roster", what, now, now + 1e-3)

    def _failed(self, component: str, exc: BaseException) -> None:
        if isinstance(exc, PeerLost):
            logging.error("lost peer: %s", exc)
        if self._attached.is_set():
            self._run.supervisor.fail(component, exc)
        else:
            self._early.append((component, exc))

    # ------------------------------------------------------------------ Generation
    def scheduler(self, vocab_size: int) -> LiveScheduler:
        """The run's scheduler here: the online ranker refresh (the samples arrive here),
        each refresh sent to the generation processes' dispatchers; on the first training
        process the elastic rule over reserved generation processes."""
        cfg = self.cfg
        units = _Processes(self.roster, self._activate)
        self.live = LiveScheduler(
            cfg.scheduling,
            cfg.mesh.instance_slots,
            vocab_size=vocab_size,
            seed=cfg.seed,
            initial_length=max(cfg.generation.max_new_tokens / 4, 1.0),
            reserved=0,  # the reserved units are generation processes
            on_refresh=self._send_ranker if self.ranker_sender is not None else None,
            units=units if self.index == 0 and self.roster.reserved else None,
        )
        return self.live

    def start(self, run: RunParts, resume: ResumePoint) -> TrainingLink:
        """Samples to the run's ingest (checked against this process's own problems),
        reports to its meter, trace and rollout, failures to its supervisor."""
        del resume  # `begin` told the generation processes where the run starts
        self.problems = ProblemTable(run.components, self.cfg)
        self.roster.num_evals = len(run.components.eval_prompts)
        self._run = run
        self._attached.set()
        for component, exc in self._early:
            run.supervisor.fail(component, exc)
        return self

    def step_started(self, batch: int) -> None:
        """The generation processes draw every batch from the same seeded pipeline: this
        process draws it too, through the run's rollout as they do (the curriculum's draws
        pass prompts over; the checkpoints record its iterator, `verify` its ids)."""
        drawn = self._run.rollout.draw(batch)
        self._drawn[batch] = [q.problem.prompt_id for q in drawn]
        # Partial rollout trains groups of batches up to max_lag - s steps back.
        for old in [j for j in self._drawn if j < batch - self._run.schedule.max_lag - 1]:
            del self._drawn[old]

    def verify(self, groups: list[Group]) -> None:
        """Every group's prompt is the one this process drew for its batch and index, so
        the seeded prompt pipelines of all processes stay in step. (A resumed partial-
        rollout run also trains groups of batches before its start, carried work the
        generation processes took back from their checkpointed shares: this process
        drew none of them, and its own draws from the start on are checked. A batch's
        refills, dynamic sampling's, are checked where they are drawn: the rollout's
        mirror of the refill rounds, which sees the prompts as the rollout drew them, a
        curriculum's passed-over ones left out.)"""
        for g in groups:
            tag = g[0].sample.tag
            if tag.batch < self._start:
                continue
            ids = self._drawn.get(tag.batch)
            if ids is not None and tag.group >= len(ids):  # a refill (dynamic sampling)
                continue
            if ids is None or tag.group >= len(ids) or tag.prompt_id != ids[tag.group]:
                want = (
                    "a batch it no longer keeps"
                    if ids is None
                    else ids[tag.group]
                    if tag.group < len(ids)
                    else f"{len(ids)} groups"
                )
                raise RuntimeError(
                    f"batch {tag.batch} group {tag.group}: generated for prompt "
                    f"{tag.prompt_id}, the trainer drew {want} (prompt pipelines out of step)"
                )

    # ------------------------------------------------------------------ Running
    def pending(self) -> int:
        return 0  # the generation processes watch their own work

    def stop(self) -> None:
        pass  # `close` ends the channels

    def _activate(self, step: int) -> bool:
        """The elastic rule added a generation instance at the end of `step`: the next
        reserved generation process generates its share of every batch from the first
        one whose weights (version >= step + 2) the trainer has not begun to send. The
        roster update is published here, before those weights leave (the generation
        processes read the roster before they draw a batch: roster.py). False when no
        reserved process is left or no batch is."""
        g = self.versions.generation_version
        first = next((b for b in range(step + 1, self.steps) if g(b) >= step + 2), None)
        if first is None:
            logging.info("elastic: the rule fired at step %d, but no batch is left to give", step)
            return False
        taken = self.roster.activate(first)
        if taken is None:
            return False
        k, update = taken
        self.board.publish(f"{ROSTER_KEY}/{update.epoch}", update.encode())
        self._mark(f"activated generation-{k}")
        logging.warning(
            "elastic: generation process %d activated at step %d; it generates its share "
            "from batch %d (roster epoch %d)",
            k,
            step,
            first,
            update.epoch,
        )
        return True

    def _send_ranker(self, ranker: Ranker, live_only: bool = True) -> None:
        """The refresh thread: the new ranker parameters to every generation process.
        `live_only` (refreshes): to the generation processes connected now, a lost one
        skipped (and dropped), a restarted one (its ranker receiver dialed in again)
        served from the next refresh; a resumed run's restored ranker waits for every
        receiver."""
        try:
            self.ranker_sender.send(
                ranker.params(), ranker.steps, timeout=self.timeout, live_only=live_only
            )
        except ChannelClosed:  # the run ended while the refresh ran: nobody dispatches
            logging.info("ranker v%d: the run ended before it was sent", ranker.steps)

    def begin(self, resume: ResumePoint, restored: dict[int, list[Published]]) -> None:
        """Publishes where generation starts (`START_KEY`: batch 0, or a restored run's
        batch, prompt-iterator state and in-flight prompt ids), then sends the restored
        generation weights in version order. Publish first: a generation process reads
        it before it takes W_0, and the sender waits for room at the receivers."""
        start: dict[str, Any] = {"batch": 0}
        if resume.resumed:
            start = {
                "batch": resume.batch,
                "prompts": resume.prompts,
                "expected_ids": {str(b): ids for b, ids in resume.expected_ids.items()},
                # partial rollout: which generation processes' carried work to read
                "carried_by": resume.rollout.get("carried_by"),
            }
        self._start = start["batch"]
        # Partial rollout trains groups of batches up to max_lag + 1 before the start.
        lag = self.cfg.pipeline.max_lag + 1 if self.partial else 0
        self.roster.start(max(start["batch"] - lag, 0))
        if self.index == 0:
            self.board.publish(START_KEY, json.dumps(start))
            if self.board != roles.PROGRAM:  # a learner's: the program is under way too
                roles.publish(roles.RUN_STARTED_KEY, "{}", overwrite=True)
        if resume.resumed:
            # Every training process sends its own shards of each restored version.
            for v in sorted(restored):
                self.sender.send(restored[v][0].params, v, timeout=self.timeout)
            ranker = self.live.ranker
            if self.ranker_sender is not None and ranker is not None and ranker.steps > 0:
                logging.info("restored ranker v%d to the generation processes", ranker.steps)
                self._send_ranker(ranker, live_only=False)

    def _wait(self, wait: Callable[..., bool], what: str) -> None:
        """`wait(timeout=...)` in short slices, so a closing link never waits long."""
        deadline = time.monotonic() + self.timeout
        while not wait(timeout=0.5):
            if self._closed:
                raise ChannelClosed(f"training: closing ({what})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"training: {what} for {self.timeout:.0f} s")

    def _on_message(self, msg: Message, peer: str) -> None:
        """A sample channel's reader thread: one message from a generation process
        (`peer`: its name, e.g. "generation-0")."""
        self._wait(self._attached.wait, "the run did not start")
        run = self._run
        if isinstance(msg, Sample):
            msg = self.problems.attach(msg, "a generation process")
            if not self.roster.first(msg.tag):
                self.duplicates += 1  # generated again after a loss: the first copy counts
                return
            if not msg.tag.is_eval and msg.finish_reason != "paused":
                run.live.observe(msg.prompt, msg.num_tokens)  # the ranker refresh's data
            # Back-pressure: the reader (and so the producer's credit) waits here while
            # IN_FLIGHT samples are still being scored or waiting for stream room.
            self._wait(
                self._inflight.acquire,
                "no room for samples (reward pool / sample stream / trainer stalled)",
            )
            run.ingest.on_sample(msg, self._inflight.release)
        elif isinstance(msg, ChunkReport):
            run.meter.chunk(msg)
        elif isinstance(msg, SpanReport):
            run.tracer.add_wall(msg.track, msg.name, msg.t0, msg.t1, **msg.args)
        elif isinstance(msg, RoundClosed):
            if peer != f"generation-{msg.process}":  # a report speaks for its sender only
                raise TransportError(f"{peer} sent a round report for generation-{msg.process}")
            run.rollout.report(msg)
        elif isinstance(msg, GenerationFailed):
            self._failed(
                f"generation process {msg.process}",
                RuntimeError(f"generation process {msg.process} failed: {msg.reason}"),
            )
        else:
            raise TypeError(f"training: unexpected message {type(msg).__name__} on the samples")

    def close(self, outcome: str, timeout: float) -> None:
        """Publishes the outcome, closes the weight channel, then waits (bounded) for
        every generation process to close its sample channel. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.roster.epoch:
            logging.warning(
                "roster changed %d time(s) during the run (lost at the end: %s); %d "
                "duplicate samples dropped",
                self.roster.epoch,
                sorted(self.roster.lost),
                self.duplicates,
            )
        if self.index == 0:
            try:
                self.board.publish(RUN_END_KEY, outcome)
            except Exception as e:  # noqa: BLE001 - the coordination service may be gone
                logging.warning("could not publish the run's outcome: %r", e)
        wait = min(timeout, 60.0 if outcome == "ok" else CLOSE_TIMEOUT_S)
        for sender in (self.sender, self.ranker_sender):
            if sender is not None:
                sender.close(CLOSE_TIMEOUT_S)
        try:
            self.server.get(timeout=wait)  # callback mode: returns only by raising
        except ChannelClosed:
            pass  # every generation process closed in order
        except TransportError as e:
            if outcome == "ok":
                logging.warning("generation processes at the end of the run: %s", e)
        finally:
            self.server.close(CLOSE_TIMEOUT_S)


class _Processes:
    """The elastic rule's units on the first training process: reserved generation
    processes, activated through the roster (`scheduling.live.ElasticUnits`)."""

    def __init__(self, roster: Roster, activate: Callable[[int], bool]):
        self.roster, self._activate = roster, activate

    def counts(self) -> tuple[int, int]:
        return self.roster.counts()

    def activate(self, step: int) -> bool:
        return self._activate(step)


def run_training(
    cfg: ExperimentConfig,
    workdir: str,
    dcfg: roles.DistributedConfig,
    r: roles.Roles,
    board: roles.Board = roles.PROGRAM,
    base_from: ExperimentConfig | None = None,
) -> RunResult:
    """This training process's run: the program's, or a learner's (`r` as it sees the
    roles, `board` its keys, `base_from` the first learner's config, whose frozen base
    its adapters start on: `processes/learners.py`)."""
    link = TrainingLink(cfg, dcfg, r, board)
    # The training mesh: the first mesh.train_devices devices of every training process.
    per = cfg.mesh.train_devices
    devices = [
        d
        for pid in r.training_processes
        for d in [d for d in r.training_devices if d.process_index == pid][:per]
    ]

    def weight_sync(params: Params, dtype: jnp.dtype) -> WeightSync:
        # The cast keeps the training sharding: each process sends its own shards.
        lora = cfg.trainer.lora.rank > 0  # adapters alone after the first version
        move = send_to_generation(link.sender, cfg.pipeline.timeout_s, adapters_only=lora)
        return WeightSync(dtype, move, adapters_only=lora)

    t = len(r.training_processes)
    judge = None
    try:
        # The judge is the scoring processes', or the generation processes' (their
        # service's tenant): this process sends its forwards there.
        tenant = cfg.judge.model and cfg.judge.placement == "generation"
        if r.scoring_processes or tenant:
            servers = r.generation_processes if tenant else r.scoring_processes
            judge = RemoteJudge(
                len(servers),
                cfg.judge.batch,
                authkey=dcfg.authkey,
                name=f"training-{link.index}",
                timeout_s=cfg.judge.timeout_s,
                peer_timeout_s=dcfg.peer_timeout_s,
                serving="generation process" if tenant else "scoring process",
            )
            # (A generation process serves it once W_0 has reached it, after this build:
            # no wait then, each forward dials: `RemoteJudge._open`.)
            if not tenant:
                judge.connect(cfg.pipeline.timeout_s)
        # The first training process scores the held-out prompts and writes the metrics;
        # another keeps its own trace and sample logs apart.
        components = components_lib.build_training(
            cfg,
            devices,
            weight_sync,
            processes=t,
            held_out=link.index == 0,
            warm=not components_lib.has_checkpoint(os.path.join(workdir, "checkpoints")),
            base_from=base_from,
            judge=judge,
        )
        own = ownership(cfg.pipeline, t)
        mesh = components.learner.trainer.mesh
        share = Alone(own) if t == 1 else TrainingGroup(mesh, own, link.index)
        trainers = Trainers(
            share=share,
            checkpoint_dir=os.path.join(workdir, "checkpoints"),  # the run's one directory
            checkpoint_processes=tuple(r.training_processes),  # orbax's active set
        )
        if link.index > 0:
            workdir = os.path.join(workdir, f"training-{link.index}")
        return run_components(cfg, components, workdir, generation=link, trainers=trainers)
    except BaseException as e:
        if t > 1 and "gloo" in str(e).lower():
            # A collective of the training mesh broke: another training process is gone.
            others = [p for p in r.training_processes if p != r.process_id]
            logging.error("lost peer: a collective over the training processes %s failed", others)
        link.close(f"failed: training process: {e!r}", CLOSE_TIMEOUT_S)  # if the run did not
        raise
    finally:
        if judge is not None:
            if judge.resent:
                logging.warning(
                    "%d judge forwards sent again (a %s lost)", judge.resent, judge.serving
                )
            judge.close(CLOSE_TIMEOUT_S)
