"""The pipeline across processes: G generation processes and T training processes.

Every process runs the same `python -m streamrl_jax.launch --config=...`;
`run_process` joins the program (`roles.initialize`) and runs this process's
role (processes 0 .. G-1 generate, the others train; several training processes
run one SPMD trainer over a mesh of all their devices, each feeding its own
slice of every micro-batch: `shards.py`):

* **generation process k of G** (`run_generation`): builds only the generation
  side (`build.build_generation`: its instances on its own devices, the
  tokenizer, the same seeded prompt pipeline), takes W_0 from the trainer and
  runs the same `GenerationDriver` as one process does, with its hooks pointed
  across processes: `weights(v)` takes W_v from a `WeightReceiver` (versions
  arrive in order; one the driver does not need is dropped), every process
  draws every batch's prompts and keeps the groups whose index is k mod G
  (held-out prompts likewise), and `emit` sends each finished sample to the
  trainer over a `SampleClient`. Decode-chunk and weight-arrival reports travel
  the same way, so the trainer's trace and `gen_busy` see every instance.
* **training process** (`run_training`): a `SampleServer` whose `on_sample`
  hands each sample to the run (decode, reward, into the `SampleStream`); the
  channel's credit comes back only once the sample is in the stream, so the
  stream's back-pressure reaches the generation processes. `build_training`
  with a `SenderWeightSync`: the cast to the generation dtype runs on the
  training mesh as in one process, then `WeightSender.send` pushes W_v to every
  generation process (in stream_async on `WeightSync`'s background thread,
  overlapping the next step). Then `run.run_components`: the same trainer loop,
  version gate, eval bookkeeping, metrics and trace as one process.

Addresses go through the coordination service (`roles.publish` / `lookup`);
no port is configured.

**End of a run.** The trainer publishes its outcome (`ok`, `stopped`, or
`failed: ...`) under `run_end` and closes the weight channel; each generation
process, having taken every weight set, reads the outcome, closes its sample
channel in order and returns (raising for a failure); the trainer waits for
every sample channel to close. All processes then meet in
`jax.distributed.shutdown` within seconds of each other (its barrier allows
`STREAMRL_SHUTDOWN_TIMEOUT_S`).

**Failure.** A lost process is `PeerLost` on the channels (a killed one at
once, a silent one after `CHANNEL_TIMEOUT_S`); it is logged as `lost peer:
...` naming it and ends the survivors with an error. A generation process that
fails tells the trainer why (`GenerationFailed`) before it exits. JAX's own
heartbeat (`STREAMRL_HEARTBEAT_TIMEOUT_S`, 10 s) aborts any survivor still
waiting after that.

**Exactness.** A sample depends only on (weights, prompt, per-sample seed)
and the weight transfer is bit-exact, so with `pipeline.deterministic=True`
the final parameters equal a one-process run's (tests/multicontroller_test.py).

Not supported across processes yet (an error at start-up, on every process):
colocated mode; checkpoints and resume (orbax's CheckpointManager would need
`MultiprocessingOptions(primary_host=<the training process>,
active_processes={...})`); elastic instances and the online ranker refresh;
training processes that cannot split every micro-batch equally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any

import jax
from absl import logging

from streamrl_jax import build as build_lib
from streamrl_jax import metrics
from streamrl_jax import run as run_lib
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.distributed import roles
from streamrl_jax.distributed.channel import ChannelClosed, PeerLost, TransportError
from streamrl_jax.distributed.shards import Ownership, TrainingGroup, host
from streamrl_jax.distributed.transport import SampleClient, SampleServer
from streamrl_jax.distributed.weights import WeightReceiver, WeightSender
from streamrl_jax.driver import GenerationDriver
from streamrl_jax.generation.types import Sample
from streamrl_jax.scheduling.live import LiveScheduler
from streamrl_jax.weight_sync import Published, SyncStats, WeightSync

SAMPLES_KEY, WEIGHTS_KEY, RUN_END_KEY = "samples", "weights", "run_end"
CHANNEL_TIMEOUT_S = 30.0  # silence after which a peer is lost (heartbeats every 5 s)
IN_FLIGHT = 8  # samples being scored or waiting for stream room, over all producers
CLOSE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ChunkReport:
    """One decode chunk of a generation instance (wall times), for `gen_busy` and the trace."""

    instance: str  # "p<process>.<instance>"
    t0: float
    t1: float
    tokens: int
    running: int
    steps: int
    prefilled: int


@dataclasses.dataclass(frozen=True)
class SpanReport:
    """A span for the trainer's trace (wall times), e.g. a weight set's arrival."""

    track: str
    name: str
    t0: float
    t1: float
    args: dict[str, float]


@dataclasses.dataclass(frozen=True)
class GenerationFailed:
    """A generation process's last message before it exits with an error."""

    process: int
    reason: str


def check_supported(
    cfg: ExperimentConfig, num_processes: int | None, generation_processes: int, workdir: str
) -> None:
    """Raises ValueError naming the setting that does not work across processes yet.

    Runs before `jax.distributed.initialize`, on every process, so all of them fail
    the same way at once.
    """
    n = "several processes" if num_processes is None else f"{num_processes} processes"
    if cfg.pipeline.mode == "colocated":
        raise ValueError(
            f"pipeline.mode='colocated' shares one device set between generation and "
            f"training, so it runs in one process; this program has {n} "
            "(STREAMRL_NUM_PROCESSES). Use disaggregated_batch, stream_sync or stream_async, "
            "or run one process."
        )
    if num_processes is not None and num_processes - generation_processes > 1:
        try:
            ownership(cfg, num_processes - generation_processes)
        except ValueError as e:
            raise ValueError(
                f"STREAMRL_NUM_PROCESSES={num_processes}, STREAMRL_GENERATION_PROCESSES="
                f"{generation_processes}: {e}"
            ) from None
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if cfg.checkpoint.every > 0 or os.path.isdir(ckpt_dir):
        raise ValueError(
            f"checkpoint.every={cfg.checkpoint.every} / {ckpt_dir}: checkpoints and resume are "
            f"not supported with {n} yet (orbax's CheckpointManager would need "
            "MultiprocessingOptions for the training process alone); set checkpoint.every=0 "
            "and use a fresh --workdir"
        )
    s = cfg.scheduling
    if s.elastic_reserved > 0:
        raise ValueError(
            f"scheduling.elastic_reserved={s.elastic_reserved}: elastic instances are not "
            f"supported with {n} yet"
        )
    if s.ranker_online and (s.dispatch == "skew_aware" or s.ranker_path):
        raise ValueError(
            f"scheduling.ranker_online=True with a ranker: the online refresh is not supported "
            f"with {n} yet; set scheduling.ranker_online=False"
        )


def ownership(cfg: ExperimentConfig, training_processes: int) -> Ownership:
    """Which training process trains which group (`shards.py`); ValueError if the
    processes cannot split every micro-batch equally."""
    p = cfg.pipeline
    return Ownership(training_processes, p.prompts_per_step // p.mini_batches, p.micro_batch_groups)


def run_process(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig
) -> run_lib.RunResult | None:
    """Joins the program and runs this process's role (the training process returns the
    run's result, a generation process None). The caller then calls
    `jax.distributed.shutdown()`."""
    check_supported(cfg, dcfg.num_processes, dcfg.generation_processes, workdir)
    r = roles.initialize(dcfg)
    check_supported(cfg, r.num_processes, len(r.generation_processes), workdir)
    metrics.set_writer_process(r.training_processes[0])  # it has the metrics
    if r.role == "generation":
        run_generation(cfg, dcfg, r)
        return None
    return run_training(cfg, workdir, dcfg, r)


# ---------------------------------------------------------------------- training side
class SenderWeightSync(WeightSync):
    """`WeightSync` whose move is a `WeightSender.send` to every generation process.

    The cast to the generation dtype runs on the training mesh as in one process;
    the cast copy stays here (the weight board keeps it); the seconds cover the cast,
    `device_get`, checksums and the wire to every receiver (not their placement,
    which each generation process reports as a `weight_receive/generation-<k>` span).

    Several training processes: the cast also gathers the params, replicated over the
    training mesh (a collective every training process joins, on its trainer thread);
    the first training process sends its full local copy (`sender`), the others have
    no sender and only take part in the gather.
    """

    def __init__(self, sender: WeightSender | None, params: Any, dtype: Any, timeout_s: float):
        super().__init__([jax.tree.map(lambda x: x.sharding, params)], dtype)
        self.sender, self.timeout_s = sender, timeout_s
        mesh = jax.tree.leaves(params)[0].sharding.mesh
        if mesh.is_multi_process:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._cast = jax.jit(self._cast_fn, out_shardings=replicated)

    def _move(self, cast: Any, version: int, t0: float) -> tuple[list[Published], SyncStats]:
        if self.sender is None:
            jax.block_until_ready(cast)
            stats = SyncStats(version, 0, time.perf_counter() - t0, 0)
        else:
            sent = self.sender.send(host(cast), version, timeout=self.timeout_s)
            stats = SyncStats(
                version=version,
                bytes=sent.bytes,
                seconds=time.perf_counter() - t0,
                destinations=self.sender.num_receivers,
            )
        self.history.append(stats)
        return [Published(cast, version)], stats


class TrainingLink:
    """The training process's `run.GenerationLink`: sample server and weight sender."""

    def __init__(self, cfg: ExperimentConfig, dcfg: roles.DistributedConfig, r: roles.Roles):
        g = len(r.generation_processes)
        p = cfg.pipeline
        # Several training processes: this one's index; the first sends the weights,
        # writes the metrics and scores the held-out prompts.
        self.index = r.training_processes.index(r.process_id)
        self.group: TrainingGroup | None = None  # set once the training mesh exists
        self.timeout = p.timeout_s
        self.num_instances = g * len(cfg.mesh.instance_slots)
        self._attached = threading.Event()
        self._closed = False
        self._hooks: tuple[Any, ...] = ()
        self._early: list[tuple[str, BaseException]] = []  # failures before attach
        self._inflight = threading.BoundedSemaphore(IN_FLIGHT)
        address = roles.advertised_host(dcfg)
        self.server = SampleServer(
            f"{address}:0",
            authkey=dcfg.authkey,
            capacity=max(2 * g, p.prompts_per_step * p.group_size),
            timeout_s=CHANNEL_TIMEOUT_S,
            num_producers=g,
            on_sample=self._on_message,
            on_error=lambda exc: self._failed("generation process", exc),
            name=f"training-{self.index}",
        )
        self.sender = None
        if self.index == 0:
            self.sender = WeightSender(
                f"{address}:0",
                authkey=dcfg.authkey,
                num_receivers=g,
                timeout_s=CHANNEL_TIMEOUT_S,
                name="training",
            )
            roles.publish(WEIGHTS_KEY, "{}:{}".format(*self.sender.address))
        roles.publish(f"{SAMPLES_KEY}-{self.index}", "{}:{}".format(*self.server.address))

    def _failed(self, component: str, exc: BaseException) -> None:
        if isinstance(exc, PeerLost):
            logging.error("lost peer: %s", exc)
        if self._attached.is_set():
            self._hooks[3](component, exc)
        else:
            self._early.append((component, exc))

    def attach(self, on_sample, on_chunk, on_span, on_error) -> None:
        self._hooks = (on_sample, on_chunk, on_span, on_error)
        self._attached.set()
        for component, exc in self._early:
            on_error(component, exc)

    def _wait(self, wait: Any, what: str) -> None:
        """`wait(timeout=...)` in short slices, so a closing link never waits long."""
        deadline = time.monotonic() + self.timeout
        while not wait(timeout=0.5):
            if self._closed:
                raise ChannelClosed(f"training: closing ({what})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"training: {what} for {self.timeout:.0f} s")

    def _on_message(self, msg: Any) -> None:
        """A sample channel's reader thread: one message from a generation process."""
        self._wait(self._attached.wait, "the run did not start")
        on_sample, on_chunk, on_span, _ = self._hooks
        if isinstance(msg, Sample):
            # Back-pressure: the reader (and so the producer's credit) waits here while
            # IN_FLIGHT samples are still being scored or waiting for stream room.
            self._wait(
                self._inflight.acquire,
                "no room for samples (reward pool / sample stream / trainer stalled)",
            )
            on_sample(msg, self._inflight.release)
        elif isinstance(msg, ChunkReport):
            m = msg
            on_chunk(m.instance, m.t0, m.t1, m.tokens, m.running, m.steps, m.prefilled)
        elif isinstance(msg, SpanReport):
            on_span(msg.track, msg.name, msg.t0, msg.t1, **msg.args)
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
        if self.index == 0:
            try:
                roles.publish(RUN_END_KEY, outcome)
            except Exception as e:  # noqa: BLE001 - the coordination service may be gone
                logging.warning("could not publish the run's outcome: %r", e)
        wait = min(timeout, 60.0 if outcome == "ok" else CLOSE_TIMEOUT_S)
        if self.sender is not None:
            self.sender.close(CLOSE_TIMEOUT_S)
        try:
            self.server.get(timeout=wait)  # callback mode: returns only by raising
        except ChannelClosed:
            pass  # every generation process closed in order
        except TransportError as e:
            if outcome == "ok":
                logging.warning("generation processes at the end of the run: %s", e)
        finally:
            self.server.close(CLOSE_TIMEOUT_S)


def run_training(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig, r: roles.Roles
) -> run_lib.RunResult:
    link = TrainingLink(cfg, dcfg, r)
    # The training mesh: the first mesh.train_devices devices of every training process.
    per = cfg.mesh.train_devices
    devices = [
        d
        for pid in r.training_processes
        for d in [d for d in r.training_devices if d.process_index == pid][:per]
    ]

    def weight_sync(params: Any, dtype: Any) -> SenderWeightSync:
        return SenderWeightSync(link.sender, params, dtype, cfg.pipeline.timeout_s)

    try:
        components = build_lib.build_training(
            cfg, devices, weight_sync, processes=len(r.training_processes)
        )
        if len(r.training_processes) > 1:
            link.group = TrainingGroup(
                components.trainer.mesh, ownership(cfg, len(r.training_processes)), link.index
            )
        if link.index > 0:
            # The first training process scores the held-out prompts and writes the
            # metrics; this one keeps its own trace and sample logs apart.
            components.eval_prompts = []
            workdir = os.path.join(workdir, f"training-{link.index}")
        return run_lib.run_components(cfg, components, workdir, link=link)
    except BaseException as e:
        if len(r.training_processes) > 1 and "gloo" in str(e).lower():
            # A collective of the training mesh broke: another training process is gone.
            others = [p for p in r.training_processes if p != r.process_id]
            logging.error("lost peer: a collective over the training processes %s failed", others)
        link.close(f"failed: training process: {e!r}", CLOSE_TIMEOUT_S)  # if the run did not
        raise


# ---------------------------------------------------------------------- generation side
class _Stopped(Exception):
    """The training process stopped the run (signal) while this one still generated."""


class _GenerationProcess:
    """One generation process: W_0, its service and driver, the end protocol."""

    def __init__(self, cfg: ExperimentConfig, dcfg: roles.DistributedConfig, r: roles.Roles):
        self.cfg, self.r = cfg, r
        self.timeout = cfg.pipeline.timeout_s
        self.pid = r.process_id
        self.share = (r.generation_processes.index(self.pid), len(r.generation_processes))
        self.side = build_lib.build_generation(cfg, jax.local_devices())
        name = f"generation-{self.pid}"
        # One sample channel per training process: each group goes to its owner
        # (shards.py); held-out samples and reports go to the first.
        t = len(r.training_processes)
        self.own = ownership(cfg, t) if t > 1 else None
        self.clients = [
            SampleClient(
                roles.lookup(f"{SAMPLES_KEY}-{i}", self.timeout),
                authkey=dcfg.authkey,
                timeout_s=CHANNEL_TIMEOUT_S,
                name=name,
            )
            for i in range(t)
        ]
        self.client = self.clients[0]
        self.receiver = WeightReceiver(
            roles.lookup(WEIGHTS_KEY, self.timeout),
            authkey=dcfg.authkey,
            timeout_s=CHANNEL_TIMEOUT_S,
            name=name,
        )
        self._cv = threading.Condition()
        self._error: tuple[str, BaseException] | None = None

    # ------------------------------------------------------------------ hooks
    def _send(self, msg: Any) -> None:
        client = self.client
        if self.own is not None and isinstance(msg, Sample) and "eval_version" not in msg.metadata:
            client = self.clients[self.own.owner(msg.metadata["group"])]
        client.send(msg, timeout=self.timeout)  # back-pressure waits up to the stall bound

    def _channel_error(self) -> BaseException | None:
        return next((c.error for c in self.clients if c.error is not None), None)

    def _receive(self, version: int) -> list[Any]:
        """W_version placed on every instance; earlier versions the driver skips are dropped."""
        shardings = self.side.parts.param_shardings
        while True:
            params, got, stats = self.receiver.receive(shardings[0], self.timeout)
            t1 = time.time()
            self._send(
                SpanReport(
                    f"weight_receive/generation-{self.pid}",
                    f"W{got}",
                    t1 - stats.seconds,
                    t1,
                    {"wire_s": stats.wire_s, "place_s": stats.place_s, "bytes": stats.bytes},
                )
            )
            if got >= version:
                break
        if got != version:
            raise RuntimeError(f"generation-{self.pid}: needed W_{version}, received W_{got}")
        return [params] + [jax.device_put(params, s) for s in shardings[1:]]

    def _on_chunk(self, instance, t0, t1, tokens, running, steps=0, prefilled=0) -> None:
        label = f"p{self.pid}.{instance}"
        with contextlib.suppress(TransportError):  # a lost channel: the main loop reports it
            self._send(ChunkReport(label, t0, t1, tokens, running, steps, prefilled))

    def _fail(self, component: str, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = (component, exc)
                logging.error("%s failed: %r", component, exc)
            self._cv.notify_all()

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        params = self._receive(0)
        service = self.side.parts.service(params, 0)
        for engine in service.engines:
            engine.on_chunk = self._on_chunk
        live = LiveScheduler(self.cfg, self.cfg.mesh.instance_slots, self.side.vocab_size)
        driver = GenerationDriver(
            self.cfg,
            service,
            live,
            self.side.eval_prompts,
            weights=self._receive,
            draw=lambda batch, n: self.side.prompts.next_prompts(n),
            emit=self._send,
            on_error=self._fail,
            share=self.share,
            emit_component="sample channel",
        )
        ok = False
        try:
            driver.start_threads()
            self._wait(driver)
            outcome = self._drain()
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
            for th in driver.threads:
                th.join(CLOSE_TIMEOUT_S)
            service.close(CLOSE_TIMEOUT_S)
        if outcome == "stopped":
            logging.warning("generation-%d: the training process stopped the run", self.pid)
        elif outcome != "ok":
            raise RuntimeError(
                f"generation-{self.pid}: the training process ended the run: {outcome}"
            )

    def _reason(self) -> BaseException | str:
        return self._error[1] if self._error is not None else "interrupted"

    def _wait(self, driver: GenerationDriver) -> None:
        """Until every batch (and the final eval) is generated and sent, watching the
        sample channel so a lost trainer ends this process at once."""
        while driver.driving or driver.pending() > 0:
            with self._cv:
                self._cv.wait(0.1)
                error = self._error
            if error is not None:
                self._raise(error[1])
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
            return roles.lookup(RUN_END_KEY, timeout)
        except TimeoutError:
            return None

    def _drain(self) -> str:
        """Takes the weight sets nobody needs any more until the trainer closes the
        channel, then reads the run's outcome."""
        shardings = self.side.parts.param_shardings[0]
        while True:
            try:
                self.receiver.receive(shardings, self.timeout)
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


def run_generation(cfg: ExperimentConfig, dcfg: roles.DistributedConfig, r: roles.Roles) -> None:
    _GenerationProcess(cfg, dcfg, r).run()
