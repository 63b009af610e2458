"""A generation process of a multi-controller run (docs/multicontroller.md).

It builds only the generation side (`components.build_generation`: its
instances on its own devices, the same seeded prompt pipeline, the held-out prompts),
takes W_0 from the trainer and runs the same `GenerationDriver` as one process
does, with the generation half of the run's rollout (`rollouts/`, `where="generator"`)
and its collaborators pointed across processes: its `Weights` (this object) take W_v
from a `ShardReceiver` (`distributed/shard_receiver.py`: its slices of every leaf,
from the training processes that hold them; versions arrive in order; one the driver
does not need is dropped), every process draws every batch's prompts and its `Share`
(`roster_share.RosterShare`) keeps the groups it owns (index k mod G while none is
lost, `roster.py`; held-out prompts likewise), and `emit` sends each finished sample to
the training process that owns its group over a `SampleClient`.
Decode-chunk and weight-arrival reports travel the same way. It starts at the
batch the trainer publishes under `START_KEY` (0, or a restored checkpoint's, with
the prompt iterator's state there), and with an online ranker it scores with the
trainer's refreshes (`_ranker_channel`) instead of refreshing its own.

**In-flight weight updates** (`pipeline.weight_update="inflight"`) need nothing more: the
driver hands each version it receives to the instances without draining, and every
sample carries its per-token versions over the wire. **Partial rollout**
(`pipeline.partial_budget_tokens`) runs the rounds of this process's groups in the same
`PartialRollout` as one process: paused samples stay here and continue in the next
round under the weights this process holds by then, and a `round-reporter` thread
(`start_reporter`) sends every training process a `RoundClosed` per round, which is
what their steps wait for (`rollouts/partial.RemoteRounds`).

**End of a run.** Having taken every weight set, it reads the trainer's outcome,
closes its sample channels in order and returns (raising for a failure). A
generation process that fails tells the trainer why (`GenerationFailed`) before
it exits; a lost trainer ends it at once.

**Another generation process lost, or a reserved one activated.** A `roster-watcher`
thread reads the trainer's roster updates (`roster_share.py`, `roster/<epoch>`), and so
does the driver before it draws each batch (an elastic activation names the batch it
starts from; the trainer publishes it before the weights that batch needs); the share
then hands the driver the lost process's groups of the batches already drawn that this
process owns now, generated under their own version (the last `staleness + 2` placed
versions are kept for it), and owns its share of every later batch. **Restarted** (the
same command and id, `roles.Roles.rejoined`): it waits for the roster update that takes
it back, moves its prompt iterator to that update's batch by drawing, takes that batch's
weights (the trainer's `ShardSender.catch_up`) and generates its share from there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import msgspec
from absl import logging

from streamrl_jax.algorithms.overlong import OverlongPenalty
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.config.fields import rollout_names
from streamrl_jax.distributed import roles
from streamrl_jax.distributed.channel import (
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.judge_channel import JudgeServer, publish_address
from streamrl_jax.distributed.messages import ChunkReport, GenerationFailed, RoundClosed, SpanReport
from streamrl_jax.distributed.shard_receiver import ShardReceiver
from streamrl_jax.distributed.shard_wire import ShardStats, need_of
from streamrl_jax.distributed.transport import SampleClient
from streamrl_jax.distributed.xla_pull import pull_server
from streamrl_jax.environments import EpisodeKit
from streamrl_jax.generation.types import Sample
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline import components as components_lib
from streamrl_jax.pipeline.driver import DriverPlan, GenerationDriver
from streamrl_jax.pipeline.hooks import generation_hooks
from streamrl_jax.pipeline.micro_batches import Scored, group_key
from streamrl_jax.pipeline.parts import agent_kit, episode_kit
from streamrl_jax.pipeline.processes import carried, roster_share
from streamrl_jax.pipeline.processes.outcomes import StoreOutcomes
from streamrl_jax.pipeline.processes.plan import (
    CLOSE_TIMEOUT_S,
    RANKER_KEY,
    RUN_END_KEY,
    SAMPLES_KEY,
    START_KEY,
    WEIGHTS_KEY,
    ranker_online,
)
from streamrl_jax.pipeline.processes.roster import RosterUpdate, reserved_processes
from streamrl_jax.pipeline.processes.roster import owner as roster_owner
from streamrl_jax.pipeline.processes.roster_share import RosterShare
from streamrl_jax.pipeline.processes.verdicts import StoreVerdicts
from streamrl_jax.pipeline.prompts import PromptSource
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.pipeline.rollouts import Kits, Rollout, RolloutContext, make_rollout
from streamrl_jax.pipeline.rollouts.partial import PartialRollout
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import Alone, ownership
from streamrl_jax.pipeline.tenant import TenantJudge
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.stream.sample_stream import SampleStream, StreamError
from streamrl_jax.weight_sync import Params

if TYPE_CHECKING:  # (the endpoint's server and fastapi: imported where a run builds its kit)
    from streamrl_jax.endpoint.kit import AgentKit

# A driver's service from W_v placed (one tree per instance), v, and its chunk observer.
MakeService = Callable[[list[Params], int, Callable[[ChunkReport], None]], Any]


class _Stopped(Exception):
    """The training process stopped the run (signal) while this one still generated."""


class _RunEnded(Exception):
    """A restarted process found the run already ended (the trainer's outcome)."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


REJOIN_DIAL_S = 2.0  # a restarted process's dial attempts (it checks the outcome between)
_Dialed = TypeVar("_Dialed")


class GenerationProcess:
    """One generation process: W_0, its service and driver, the end protocol."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        workdir: str,
        dcfg: roles.DistributedConfig,
        r: roles.Roles,
        board: roles.Board = roles.PROGRAM,
        side: components_lib.GenerationSide | None = None,
    ):
        """`r`: the roles as this run sees them and `board` its keys (a learner's:
        `processes/learners.py`); `side`: the generation side already built (None: build
        it on this process's devices)."""
        self.cfg, self.r, self.dcfg, self.workdir = cfg, r, dcfg, workdir
        self.board = board
        self.ranker_receiver: ShardReceiver | None = None
        self.carried_by: object = None  # a resumed partial run's share writers (`_start`)
        self._stopping = threading.Event()
        self.timeout = cfg.pipeline.timeout_s
        self.pid = r.process_id
        self.share = (r.generation_processes.index(self.pid), len(r.generation_processes))
        if side is None:
            side = components_lib.build_generation(cfg, jax.local_devices())
        self.parts, self.held_out = side.parts, side.eval_prompts
        self.prompts = PromptSource(side.prompts)
        # An episodes run: the environment steps here; its answers are scored on a reward
        # pool of this process (the trainer scores the episodes by their outcome).
        self.pool: RewardPool | None = None
        self.kit: EpisodeKit | None = None
        self.tokenizer = side.tokenizer
        _, kind = rollout_names(cfg.pipeline.rollout)
        # Dynamic sampling judges its groups here too (rollouts/dynamic_sampling.py),
        # unless a judge's verdicts are part of the reward: the trainers judge then.
        if cfg.environment.name or (kind == "dynamic_sampling" and not cfg.judge.model):
            self.pool = RewardPool(
                side.reward_fn,
                num_workers=2,
                on_error=cfg.data.reward_errors,
                sandbox=side.reward_sandbox,
            )
        if cfg.environment.name:
            self.kit = episode_kit(cfg, side.tokenizer, self.pool)
        # Agents: this process serves its own endpoint (loopback, its own token) to the
        # scaffolds of the episodes it owns (rollouts/agents.py).
        self.agents: AgentKit | None = None
        if self.kit is not None and "agents" in cfg.pipeline.rollout.split("+"):
            ecfg, vocab = side.parts.engine_cfgs[0], side.parts.model_cfg.vocab_size
            self.agents = agent_kit(cfg, side.tokenizer, ecfg, vocab, self.kit)
        name = f"generation-{self.pid}"
        # A restarted process: the roster so far; the update taking it back comes after.
        self.epoch0 = roster_share.last_epoch(board) if r.rejoined else 0
        # One sample channel per training process: each group goes to its owner
        # (shards.py); held-out samples and reports go to the first.
        t = len(r.training_processes)
        self.own = ownership(cfg.pipeline, t)
        self.clients = [
            self._dial(
                lambda dial_s, address=address: SampleClient(
                    address,
                    authkey=dcfg.authkey,
                    timeout_s=dcfg.peer_timeout_s,
                    name=name,
                    dial_timeout_s=dial_s,
                ),
                "sample",
            )
            for address in [self.board.lookup(f"{SAMPLES_KEY}-{i}", self.timeout) for i in range(t)]
        ]
        self.client = self.clients[0]
        # Dials every training process; its need (the boxes its first instance's devices
        # hold of every leaf) is what each sender plans against and what every piece is
        # checked against before anything is allocated.
        parts = self.parts
        weights = [self.board.lookup(f"{WEIGHTS_KEY}-{i}", self.timeout) for i in range(t)]
        need = need_of(parts.param_shardings[0], parts.abstract_params, self.pid)
        xla = pull_server(cfg.pipeline, roles.advertised_host(dcfg))
        self.receiver = self._dial(
            lambda dial_s: ShardReceiver(
                weights,
                need,
                authkey=dcfg.authkey,
                timeout_s=dcfg.peer_timeout_s,
                name=name,
                xla=xla,
                dial_timeout_s=dial_s,
                # LoRA: after the first version the trainer sends the adapters alone.
                deltas=cfg.trainer.lora.rank > 0,
            ),
            "weights",
        )
        self._placed: dict[int, list[Params]] = {}  # recent versions, for groups made again
        self.schedule = Schedule.from_config(cfg.pipeline)
        self.latch = FailureLatch(name)
        self.latch.add_listener(
            lambda component, exc: logging.error("%s failed: %r", component, exc)
        )

    def _dial(self, make: Callable[[float], _Dialed], kind: str) -> _Dialed:
        """`make(dial_s)` dials the training processes' `kind` ("sample", "weights")
        servers (giving up after `dial_s`; the channels' silence bound stays the peer
        timeout). A restarted process dials in short attempts and, between them, looks
        for the run's outcome: the run may end while this process starts (a server then
        closes or no longer admits anyone), and that ends this process cleanly
        (`_RunEnded`), not as a dial timeout once the coordination service is gone too."""
        total = self.dcfg.peer_timeout_s
        if not self.r.rejoined:
            return make(total)
        deadline = time.monotonic() + total
        while True:
            try:
                return make(max(min(REJOIN_DIAL_S, deadline - time.monotonic()), 0.1))
            except TransportTimeout as e:
                if (outcome := self.board.try_lookup(RUN_END_KEY)) is not None:
                    raise _RunEnded(outcome) from e
                if time.monotonic() >= deadline:
                    raise TransportTimeout(
                        f"generation-{self.pid}: no {kind} server admitted this restarted "
                        f"process within {total:.1f} s ({e})"
                    ) from e

    # ------------------------------------------------------------------ hooks
    def _send(self, msg: Sample | ChunkReport | SpanReport | RoundClosed) -> None:
        client = self.client
        if isinstance(msg, Sample) and not msg.tag.is_eval:
            client = self.clients[self.own.owner(msg.tag.group)]
        client.send(msg, timeout=self.timeout)  # back-pressure waits up to the stall bound

    def _channel_error(self) -> BaseException | None:
        return next((c.error for c in self.clients if c.error is not None), None)

    # ------------------------------------------------------------------ the driver's Weights
    def wait(self, version: int, idle: Callable[[], None]) -> list[Params]:
        """W_version placed on every instance; earlier versions the driver skips are
        dropped; `idle()` runs while it waits (the driver generates a lost process's
        groups again: the trainer may be waiting for them before it makes W_version)."""
        shardings = self.parts.param_shardings
        while True:
            params, got, stats = self._next_weights(shardings[0], idle)
            t1 = time.time()
            self._send(
                SpanReport(
                    f"weight_receive/generation-{self.pid}",
                    f"W{got}",
                    t1 - stats.seconds,
                    t1,
                    stats.report(),  # version, seconds, GB/s, checksum, bytes per sender
                )
            )
            if got >= version:
                break
        if got != version:
            raise RuntimeError(f"generation-{self.pid}: needed W_{version}, received W_{got}")
        placed = [params] + [jax.device_put(params, s) for s in shardings[1:]]
        self._placed[version] = placed
        for v in [v for v in self._placed if v < version - self.cfg.pipeline.staleness - 2]:
            del self._placed[v]
        return placed

    def kept(self, version: int) -> list[Params] | None:
        return self._placed.get(version)

    def _next_weights(
        self, shardings: Params, idle: Callable[[], None]
    ) -> tuple[Params, int, ShardStats]:
        """The next weight version (bounded by the stall timeout), running `idle()`
        between attempts."""
        deadline = time.monotonic() + self.timeout
        while True:
            idle()
            try:
                return self.receiver.receive(shardings, min(0.5, self.timeout))
            except TransportTimeout:
                if time.monotonic() > deadline:
                    raise
                if self.latch.failed or self._stopping.is_set():
                    raise

    def _on_chunk(self, report: ChunkReport) -> None:
        labelled = msgspec.structs.replace(report, instance=f"p{self.pid}.{report.instance}")
        with contextlib.suppress(TransportError):  # a lost channel: the main loop reports it
            self._send(labelled)

    def _ranker_channel(self, live: LiveScheduler) -> threading.Thread | None:
        """With an online ranker: the trainer refreshes it (it sees the samples), this
        process only scores with it; a thread places each refresh into `live.ranker`."""
        if not ranker_online(self.cfg):
            return None
        ranker = live.ranker
        # The ranker's parameters, whole on one device: the need (every piece is checked
        # against it before anything is allocated) is its whole tree.
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = ranker.params()
        shardings = jax.tree.map(lambda _: device, abstract)
        self.ranker_receiver = ShardReceiver(
            [self.board.lookup(RANKER_KEY, self.timeout)],
            need_of(shardings, abstract, self.pid),
            authkey=self.dcfg.authkey,
            timeout_s=self.dcfg.peer_timeout_s,
            name=f"generation-{self.pid}-ranker",
        )

        def take() -> None:
            while not self._stopping.is_set():
                try:
                    params, version, stats = self.ranker_receiver.receive(shardings, 1.0)
                except TransportTimeout:
                    continue  # no refresh this step; stop is checked every second
                except ChannelClosed:
                    return
                except TransportError as e:  # the trainer is gone: the main loop reports it
                    logging.warning("generation-%d: ranker channel: %s", self.pid, e)
                    return
                ranker.set_params(jax.device_get(params), version)
                logging.info("generation-%d: ranker v%d from the trainer", self.pid, version)
                t1 = time.time()
                with contextlib.suppress(TransportError):
                    self._send(
                        SpanReport(
                            f"ranker/generation-{self.pid}",
                            f"R{version}",
                            t1 - stats.seconds,
                            t1,
                            stats.report(),  # version, seconds, bytes
                        )
                    )

        thread = threading.Thread(target=take, name="ranker-receiver", daemon=True)
        thread.start()
        return thread

    def _round_reporter(
        self, rounds: PartialRollout, rollout: Rollout, first: int
    ) -> threading.Thread:
        """Partial rollout: the thread that reports this process's rounds (`rounds`, the
        kind under the run's `rollout`'s wrappers) to the trainers (`start_reporter`),
        keeping the rollout's carried work for the checkpoints."""
        ck = self.cfg.checkpoint
        keep = None
        if ck.every > 0 or ck.on_signal:  # a checkpoint may hold the work carried into r + 1

            def keep(r: int) -> None:
                carried.write(self.workdir, r + 1, self.pid, rollout.state(r + 1))
                recent = self.cfg.pipeline.staleness + 3
                carried.prune(self.workdir, self.pid, r + 1, ck.every, ck.keep, recent)

        return start_reporter(
            rounds,
            range(first, self.cfg.pipeline.steps),
            self.pid,
            self._report,
            self._stopping,
            lambda e: self.latch.fail("round reporter", e),
            keep,
        )

    def _restore_carried(self, rollout: Rollout, batch: int, roster: RosterUpdate) -> None:
        """A resumed partial-rollout run: the work carried into round `batch` that this
        process owns now (`carried.py`): its paused samples continue in that round, the
        finished members of incomplete groups go to their training process again."""
        writers = self.carried_by
        if not isinstance(writers, list) or not all(isinstance(w, int) for w in writers):
            raise ValueError(
                f"generation-{self.pid}: resuming a partial-rollout run at batch {batch}, "
                f"the checkpoint names no carried work ({START_KEY}: carried_by={writers!r})"
            )
        g = len(self.r.generation_processes)
        k = self.r.generation_processes.index(self.pid)
        work = carried.owned(
            carried.read(self.workdir, batch, writers),
            lambda b, group: roster_owner(group, g, roster.lost_at(b)) == k,
        )
        finished = rollout.restore(batch, work)
        logging.info(
            "generation-%d: restored %d paused samples and %d finished members carried into "
            "round %d",
            self.pid,
            len(work["paused"]),
            len(finished),
            batch,
        )
        for sample in finished:
            self._send(sample)

    def _report(self, closed: RoundClosed) -> None:
        """A round's closure to every training process: each trains its own groups of
        every round (`rollouts/partial.RemoteRounds`)."""
        for client in self.clients:
            client.send(closed, timeout=self.timeout)

    # ------------------------------------------------------------------ run
    def _start(self) -> tuple[int, int, RosterUpdate]:
        """Where this process starts: (first batch, the version its service must hold
        first, the roster in force); the prompt source is set there."""
        # Batch 0, or a restored checkpoint's batch with the prompt iterator's state there
        # and the prompt ids the batches drawn before it must draw again.
        try:
            start = json.loads(self.board.lookup(START_KEY, self.timeout))
        except TimeoutError as e:
            raise TimeoutError(
                f"generation-{self.pid}: the training process did not say where the run "
                f"starts ({START_KEY!r}) within {self.timeout:.0f} s (still restoring a "
                "checkpoint or building, or gone)"
            ) from e
        batch = int(start["batch"])
        self.carried_by = start.get("carried_by")  # partial rollout's shares (resumed)
        expected = {int(b): ids for b, ids in start.get("expected_ids", {}).items()}
        if batch > 0:
            self.prompts.restore(start["prompts"], expected)
        g = len(self.r.generation_processes)
        reserved = reserved_processes(g, self.cfg.scheduling.elastic_reserved)
        roster = RosterUpdate(0, (), 0, {}, (), {}, reserved=reserved)
        # A resumed run's service holds the build's W_0: load W_g(batch) first (-1).
        loaded = 0 if batch == 0 else -1
        if self.r.rejoined:
            # Restarted into the run: start where the trainer's roster says, with
            # that batch's weights; the prompt iterator is moved there by drawing.
            roster = roster_share.rejoin(self.pid, self.epoch0, self.timeout, self.board)
            self.prompts.skip_to(roster.floor, self._drawn_per_batch(), batch)
            batch = roster.floor
            loaded = self.schedule.generation_version(batch)
        return batch, loaded, roster

    def _drawn_per_batch(self) -> Callable[[int], int]:
        """How many prompts each earlier batch drew (a restarted process moves its prompt
        iterator past them): `prompts_per_step`, and with dynamic sampling its refills
        too, which the first training process publishes as it trains each batch
        (`StoreVerdicts.drawn`; a batch still refilling is waited for)."""
        n = self.cfg.pipeline.prompts_per_step
        if rollout_names(self.cfg.pipeline.rollout)[1] != "dynamic_sampling":
            return lambda b: n
        return lambda b: n + StoreVerdicts(self.board).drawn(b, self.timeout)

    def _rollout(self) -> PartialRollout | Rollout:
        """The generation half of the run's rollout."""
        p = self.cfg.pipeline
        # Nothing here trains: the rollout's stream (its trainer half) stays empty.
        unused: SampleStream[Scored] = SampleStream(
            group_size=p.group_size, group_key=group_key, capacity=p.group_size
        )
        rollout = make_rollout(
            p.rollout,
            RolloutContext(
                pipeline=p,
                schedule=self.schedule,
                stream=unused,
                prompts=self.prompts,
                latch=self.latch,
                overlong=OverlongPenalty.from_config(
                    self.cfg.algorithm, self.cfg.generation.max_new_tokens
                ),
                trainers=Alone(ownership(p, 1)),
                seed=self.cfg.seed,
                where="generator",
                score=self._score if self.pool is not None else None,
                verdicts=StoreVerdicts(self.board),
                outcomes=StoreOutcomes(len(self.r.training_processes), self.board),
                trainers_judge=bool(self.cfg.judge.model),
            ),
            Kits(episodes=self.kit, agents=self.agents),
        )
        self.latch.add_listener(lambda component, exc: rollout.fail(exc))
        return rollout

    def _score(self, sample: Sample) -> concurrent.futures.Future[Scored]:
        """A training sample scored on this process's reward pool (dynamic sampling's
        judge here; the trainer scores the sample it receives again, alike)."""
        text = self.tokenizer.decode(sample.response)
        out: concurrent.futures.Future[Scored] = concurrent.futures.Future()

        def done(future: concurrent.futures.Future) -> None:
            try:
                out.set_result(Scored(sample, text, future.result()))
            except BaseException as e:  # noqa: BLE001 - handed to the rollout
                out.set_exception(e)

        self.pool.submit(text, sample.metadata).add_done_callback(done)
        return out

    def _serve_judge(self, tenant: TenantJudge) -> JudgeServer:
        """Serves this process's instances' judge (`judge.placement="generation"`: the
        service's tenant, `pipeline/tenant.py`) to the training processes, published
        under `judge/<k>` (k: this process's index among the generation processes; a
        restarted process publishes a new address). A lost training process is this
        process's sample channels' to report: here it is logged."""
        k, name = self.share[0], f"generation-{self.pid}"

        def on_lost(peer: str, exc: TransportError) -> None:
            logging.warning("%s: the judge's channel to %s: %s", name, peer, exc)

        server = JudgeServer(
            tenant,
            f"{roles.advertised_host(self.dcfg)}:0",
            authkey=self.dcfg.authkey,
            peers=len(self.r.training_processes),
            timeout_s=self.dcfg.peer_timeout_s,
            name=name,
            on_lost=on_lost,
        )
        publish_address(k, server.address, self.board)
        logging.info("%s: the judge served at %s:%d (its service's tenant)", name, *server.address)
        return server

    def run(self, make_service: MakeService | None = None) -> None:
        """Generates the run to its end. `make_service(params, version, on_chunk)`: the
        service this process's driver uses, holding `params` at `version` (None: one of
        its own on its instances; several learners: their shared one's view)."""
        batch, loaded, roster = self._start()
        p = self.cfg.pipeline
        params = self.wait(max(loaded, 0), idle=lambda: None)
        if make_service is None:
            service = self.parts.service(
                params,
                max(loaded, 0),
                on_chunk=self._on_chunk,
                precompile=p.precompile,
                continuations=p.partial_budget_tokens > 0,
            )
        else:
            service = make_service(params, max(loaded, 0), self._on_chunk)
        judge_servers = [self._serve_judge(t) for t in self.parts.tenants]
        # Every instance of this process dispatches; the reserved units are processes,
        # and an online ranker is refreshed by the trainer (`_ranker_channel`).
        live = LiveScheduler(
            self.cfg.scheduling,
            self.cfg.mesh.instance_slots,
            vocab_size=self.parts.model_cfg.vocab_size,
            seed=self.cfg.seed,
            initial_length=max(self.cfg.generation.max_new_tokens / 4, 1.0),
            reserved=0,
            refresh=False,
        )
        ranker_thread = self._ranker_channel(live)
        rollout = self._rollout()
        share = RosterShare(
            self.pid,
            self.share,
            roster,
            self.schedule.generation_version,
            p.staleness + 2,
            self.board,
        )
        driver = GenerationDriver(
            service,
            rollout,
            live,
            self,
            share,
            Requests.from_config(self.cfg),
            self._send,
            self.latch,
            DriverPlan(
                schedule=self.schedule,
                start=batch,
                steps=p.steps,
                loaded_version=loaded,
                held_out=self.held_out if self.cfg.eval.num_problems else (),
                timeout=self.timeout,
                emit_component="sample channel",
            ),
        )
        hooks = generation_hooks(self.cfg, driver.evaluate, self.prompts)
        ok = False
        roster_thread = share.start_watcher(
            self._stopping, lambda e: self.latch.fail("roster watcher", e)
        )
        reporters: list[threading.Thread] = []
        try:
            rounds = rollout
            while not isinstance(rounds, PartialRollout) and hasattr(rounds, "inner"):
                rounds = rounds.inner  # the kind under its wrappers
            partial = isinstance(rounds, PartialRollout)
            if partial and batch > 0:  # before the driver opens the round they continue in
                self._restore_carried(rollout, batch, roster)
            driver.start_threads(hooks)
            if partial:  # its rounds' closures to the trainer
                reporters.append(self._round_reporter(rounds, rollout, batch))
            self._wait(driver, reporters)
            outcome = self._drain(driver)
            ok = True
        except _Stopped:
            outcome, ok = "stopped", True
        finally:
            driver.stop()
            if not ok:
                # Tell every training process why, so they fail naming this process.
                failed = GenerationFailed(self.pid, repr(self._reason()))
                for client in self.clients:
                    if client.error is None:
                        with contextlib.suppress(TransportError):
                            client.send(failed, timeout=2)
            # Closing the channels first wakes a driver thread blocked on one of them.
            for client in self.clients:
                client.close(CLOSE_TIMEOUT_S)
            self.receiver.close(CLOSE_TIMEOUT_S)
            self._stopping.set()
            if self.ranker_receiver is not None:
                self.ranker_receiver.close(CLOSE_TIMEOUT_S)
            extra = [roster_thread, *reporters, *([ranker_thread] if ranker_thread else [])]
            for th in [*driver.threads, *extra]:
                th.join(CLOSE_TIMEOUT_S)
            if self.agents is not None:
                self.agents.close()
            for server in judge_servers:  # before the service their forwards run on
                server.close(CLOSE_TIMEOUT_S)
            service.close(CLOSE_TIMEOUT_S)
            if self.kit is not None:
                self.kit.close()
            if self.pool is not None:
                self.pool.close(cancel_pending=True)
        if outcome == "stopped":
            logging.warning("generation-%d: the training process stopped the run", self.pid)
        elif outcome != "ok":
            raise RuntimeError(
                f"generation-{self.pid}: the training process ended the run: {outcome}"
            )

    def _reason(self) -> BaseException | str:
        return self.latch.error if self.latch.failed else "interrupted"

    def _wait(self, driver: GenerationDriver, reporters: list[threading.Thread]) -> None:
        """Until every batch (and the final eval) is generated and sent (and, with partial
        rollout, every round reported), watching the sample channel so a lost trainer
        ends this process at once."""
        reporting = lambda: any(r.is_alive() for r in reporters)  # noqa: E731
        while driver.driving or driver.pending() > 0 or reporting():
            if not driver.driving:
                driver.regenerate()  # the driver thread has ended: this thread does it
            if self.latch.wait(0.1):
                self._raise(self.latch.error)
            error = self._channel_error()
            if error is not None:
                self._raise(error)

    def _raise(self, exc: BaseException) -> None:
        if isinstance(exc, PeerLost):
            logging.error("lost peer: %s", exc)
        outcome = self._outcome(timeout=2.0)
        if outcome == "stopped":
            raise _Stopped() from exc
        if outcome is not None and outcome != "ok":
            raise RuntimeError(
                f"generation-{self.pid}: the training process ended the run: {outcome}"
            ) from exc
        raise exc

    def _outcome(self, timeout: float) -> str | None:
        try:
            return self.board.lookup(RUN_END_KEY, timeout)
        except TimeoutError:
            return None

    def _drain(self, driver: GenerationDriver) -> str:
        """Takes the weight sets nobody needs any more until the trainer closes the
        channel, then reads the run's outcome."""
        shardings = self.parts.param_shardings[0]
        while True:
            try:
                self._next_weights(shardings, driver.regenerate)
                driver.wait_idle()  # what it generated again is sent
            except ChannelClosed:
                break
            except TransportError as e:
                self._raise(e)
        outcome = self._outcome(timeout=CLOSE_TIMEOUT_S)
        if outcome == "stopped":
            return outcome
        if outcome is None:
            raise RuntimeError(f"generation-{self.pid}: the trainer closed without an outcome")
        return outcome


def run_generation(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig, r: roles.Roles
) -> None:
    if r.rejoined and "curriculum" in rollout_names(cfg.pipeline.rollout)[0]:
        # Its draws depend on its place in the prompt pipeline counted from the run's
        # start and on the prompts it passed over, which a restarted process cannot
        # rebuild from what the trainer publishes (each batch's refill count): it would
        # draw out of step. The run goes on with the generation processes it has.
        raise RuntimeError(
            f"generation-{r.process_id}: restarted into a run of the curriculum "
            f"(pipeline.rollout={cfg.pipeline.rollout!r}): a restarted generation process "
            "cannot rejoin it (its prompt draws would not be the others'); the run goes on "
            "with the generation processes it has"
        )
    if r.rejoined:
        try:
            outcome = roles.lookup(RUN_END_KEY, 0.1)
        except TimeoutError:
            outcome = None
        if outcome is not None:  # restarted after the trainer finished: nothing to join
            logging.warning("generation-%d: the run already ended (%s)", r.process_id, outcome)
            return
    try:
        process = GenerationProcess(cfg, workdir, dcfg, r)
    except _RunEnded as e:  # it ended while this restarted process started
        logging.warning(
            "generation-%d: the run ended (%s) while this process rejoined", r.process_id, e.outcome
        )
        return
    process.run()


def start_reporter(
    rollout: PartialRollout,
    rounds: Iterable[int],
    process: int,
    send: Callable[[RoundClosed], None],
    stopping: threading.Event,
    fail: Callable[[BaseException], None],
    keep: Callable[[int], None] | None = None,
) -> threading.Thread:
    """Partial rollout across processes: a thread that sends a `RoundClosed` per round of
    `rounds`, in order, once this process's `rollout` closed it (every segment of the
    round returned); the trainer's half (`rollouts/partial.RemoteRounds`) trains each
    step on it. It ends when `stopping` is set (checked twice a second) or the rollout
    fails (the run's failure is already known); a send that raises fails the run
    through `fail` (a lost channel, or a bug, named as the round reporter's). `keep(r)`,
    when given, runs before round r's report: it keeps the work carried into round
    r + 1 for the checkpoints (`carried.py`)."""

    def report() -> None:
        for r in rounds:
            while True:
                if stopping.is_set():
                    return
                try:
                    groups = rollout.wait_round(r, 0.5)
                    break
                except TimeoutError:
                    continue
                except StreamError:
                    return
            counts = rollout.in_flight()
            try:
                if keep is not None:
                    keep(r)
            except Exception as e:
                fail(e)
                return
            closed = RoundClosed(
                process,
                r,
                tuple(groups),
                counts["paused"],
                counts["waiting_members"],
                rollout.regenerated,
                rollout.dropped,
            )
            try:
                send(closed)
            except Exception as e:
                fail(e)
                return

    thread = threading.Thread(target=report, name="round-reporter", daemon=True)
    thread.start()
    return thread
