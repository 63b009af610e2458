"""Several learners on one generation service (`ExperimentConfig.learners`, docs/learners.md).

Each learner is a whole run of its own (`learner_config`: its algorithm, learning rate,
prompts and version contract; its metrics, samples and checkpoints under
`<workdir>/<name>`), and each trains its own LoRA adapter on one frozen base. What they
share is the generation side: one `GenerationService` whose engines keep the base once
and one adapter slot per learner (`EngineConfig.adapters`; learner i decodes with slot
i), so one decode batch holds every learner's requests and a row's tokens do not depend
on its batch-mates' adapters (`generation/adapters.py`). On the training side the base
is loaded once (the first learner's) and each learner's adapters start on it; each
learner's train state then holds its own copy of the frozen base (its train step
writes the whole state), so training memory grows by a base per learner.

* `SharedService`: the service and its router. A learner's `View` is the service as its
  driver sees it: `submit` names the learner's adapter slot on every request and keys
  its id by the slot (two learners' batch 0 have the same ids); the router thread takes
  every finished sample off the service and hands it to the learner its adapter names
  (`Sample.adapter`), with its own id back, so a learner's sample never reaches
  another; `update_weights` writes the learner's adapter slot
  (`GenerationService.update_adapter`): each learner's version gate is its own, and a
  weight update of one waits only for that learner's requests (the driver's
  `wait_idle` counts its own).
* `LearnerGeneration`: the `Generation` seam over a view (as `LocalGeneration` is over
  a service of its own).
* `run`: builds the learners (meshes, the generation parts and W_0's base once), starts
  the service, runs every learner's `run_components` on a thread of its own, and ends
  them together: the first learner to fail fails the others' views (their runs end
  naming it, each checkpointing its last step boundary); SIGINT/SIGTERM stop every
  learner at its boundary. Resuming a workdir resumes each learner from its own
  checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.config import ExperimentConfig, Processes, check, learner_config
from streamrl_jax.generation.service import GenerationService, StreamClosed, sample_queue
from streamrl_jax.generation.types import ChunkReport, GenerationRequest, Sample
from streamrl_jax.mailbox import Mailbox
from streamrl_jax.pipeline import components as components_lib
from streamrl_jax.pipeline import datasets
from streamrl_jax.pipeline.components import Components, GenerationParts
from streamrl_jax.pipeline.generation import LocalGeneration, LocalRunning
from streamrl_jax.pipeline.lifecycle import run_components
from streamrl_jax.pipeline.meshes import make_meshes
from streamrl_jax.pipeline.parts import RunParts, Trainers
from streamrl_jax.pipeline.resume import ResumePoint
from streamrl_jax.pipeline.shards import Alone, ownership
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.rewards.base import RewardFn
from streamrl_jax.trainer import state as state_lib
from streamrl_jax.weight_sync import Params, WeightSync, place_on


class SharedService:
    """One `GenerationService` and the router that hands each learner its samples."""

    def __init__(
        self,
        service: GenerationService,
        names: Sequence[str],
        meters: Meters,
        alphas: Sequence[float] | None = None,
        poll_s: float = 0.05,
    ):
        """`meters`: the service's chunk observer, which each learner's meter joins;
        `alphas`: each learner's LoRA alpha (None: the service's model's for all)."""
        self.service, self.names, self._meters = service, list(names), meters
        self.alphas = list(alphas) if alphas is not None else [None] * len(self.names)
        self._boxes: list[Mailbox[Sample]] = [
            sample_queue(None, f"learner {n}'s samples") for n in self.names
        ]
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._router = threading.Thread(target=self._route, name="learner-router", daemon=True)
        self._router.start()

    @classmethod
    def start(
        cls, cfg: ExperimentConfig, parts: GenerationParts, params: Any, version: int
    ) -> SharedService:
        """The learners' (`cfg.learners`) one service on `parts`' instances, holding
        `params` (a learner's W_`version`, whose base every learner shares), each
        learner's meter observing its chunks (`add_meter`), and its router."""
        meters = Meters()
        service = parts.service(
            params,
            version,
            on_chunk=meters,
            precompile=cfg.pipeline.precompile,
            continuations=any(x.pipeline.partial_budget_tokens > 0 for x in cfg.learners),
        )
        names = [x.name for x in cfg.learners]
        return cls(service, names, meters, [x.lora.alpha for x in cfg.learners])

    def view(self, slot: int) -> View:
        return View(self, slot)

    def add_meter(self, meter: Callable[[ChunkReport], None]) -> None:
        self._meters.add(meter)

    def take(self, slot: int, timeout: float) -> Sample:
        """Learner `slot`'s next sample (the service's errors: `GenerationService.get`)."""
        return self._boxes[slot].get(
            timeout=timeout, what=f"a sample of learner {self.names[slot]}"
        )

    def fail(self, slot: int, exc: BaseException, component: str) -> None:
        """Learner `slot`'s samples stop with `exc` (another learner failed)."""
        self._boxes[slot].fail(exc, component)

    def _route(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sample = self.service.get(timeout=self._poll_s)
                except TimeoutError:
                    continue
                slot, rid = self._owner(sample)
                # Unbounded (each learner bounds what it has out), so one learner's slow
                # trainer never holds up another's samples; a learner that has ended (its
                # box failed) takes nothing more.
                self._boxes[slot].offer(
                    dataclasses.replace(sample, request_id=rid), timeout=self._poll_s
                )
        except StreamClosed:
            pass
        except BaseException as e:  # noqa: BLE001 - every learner hears of it
            for box in self._boxes:
                box.fail(e, "generation service")
            return
        for box in self._boxes:
            box.close("the learners' service closed")

    def _owner(self, sample: Sample) -> tuple[int, Any]:
        """The learner a sample goes to (its adapter slot) and its id in that learner."""
        key = sample.request_id
        slot = sample.adapter
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == slot):
            raise RuntimeError(
                f"learners' service: sample {key!r} came back with adapter {slot}, which is "
                "not the slot its request was keyed by"
            )
        if not 0 <= slot < len(self._boxes):
            raise RuntimeError(f"learners' service: sample {key!r} names adapter slot {slot}")
        return slot, key[1]

    def close(self, timeout: float) -> None:
        """Stops the router, then the service (naming what did not stop)."""
        self._stop.set()
        self._router.join(timeout)
        self.service.close(timeout)
        if self._router.is_alive():
            raise TimeoutError(f"learners' service: the router did not stop in {timeout} s")


class View:
    """The shared service as one learner's driver sees it (module docstring)."""

    def __init__(self, shared: SharedService, slot: int):
        self.shared, self.slot = shared, slot
        self.name = f"generation service (learner {shared.names[slot]})"

    def _own(self, r: GenerationRequest) -> GenerationRequest:
        return dataclasses.replace(r, adapter=self.slot, request_id=(self.slot, r.request_id))

    def submit(
        self, requests: Sequence[GenerationRequest], instances: Sequence[int] | None = None
    ) -> None:
        self.shared.service.submit([self._own(r) for r in requests], instances)

    def release(self, request_id: Any) -> None:
        self.shared.service.release((self.slot, request_id))

    def get(self, timeout: float) -> Sample:
        return self.shared.take(self.slot, timeout)

    def update_weights(self, params: Params | Sequence[Params], version: int) -> None:
        """This learner's W_version: its adapter slot, with its own alpha, on every instance."""
        self.shared.service.update_adapter(
            self.slot, params, version, self.shared.alphas[self.slot]
        )

    def close(self, timeout: float) -> None:
        del timeout  # the service is the learners' together: `SharedService.close`


class LearnerGeneration(LocalGeneration):
    """The `Generation` of one learner: its driver over its view of the shared service."""

    def __init__(
        self, cfg: ExperimentConfig, parts: GenerationParts, shared: SharedService, slot: int
    ):
        super().__init__(cfg, parts, initial=[])
        self.shared, self.slot = shared, slot

    def start(self, run: RunParts, resume: ResumePoint) -> LocalRunning:
        # The slot holds W_0's adapter (B = 0 for every learner); a resumed learner's
        # driver loads W_g(start) first.
        self.shared.add_meter(run.meter.chunk)
        return self.drive(self.shared.view(self.slot), run, resume)


@dataclasses.dataclass
class Learners:
    """What `build` makes: each learner's config and components, and the service's parts."""

    configs: list[ExperimentConfig]
    components: list[Components]
    parts: GenerationParts


def build(
    cfg: ExperimentConfig,
    devices: list[jax.Device] | None = None,
    reward_fn: RewardFn | None = None,
) -> Learners:
    """Every learner's components on one set of meshes; the base loaded and placed on
    the generation instances once (the first learner's), the others' adapters on it."""
    configs = [learner_config(cfg, learner) for learner in cfg.learners]
    problems = [datasets.datasets(c) for c in configs]  # a bad file fails first
    meshes = make_meshes(configs[0], devices)
    d = components_lib.describe_model(configs[0])
    parts = components_lib.generation_parts(
        configs[0], d.cfg, d.tokenizer, meshes.generate, adapters=len(configs)
    )
    built: list[Components] = []
    bases: list[Any] | None = None
    base: Params | None = None
    for c, (eval_set, train_set) in zip(configs, problems, strict=True):

        def sync(params: Params, dtype: Any, bases=bases) -> WeightSync:
            del params
            return WeightSync(
                dtype, place_on(parts.param_shardings), adapters_only=True, bases=bases
            )

        # Every learner's model is the first's but for its own alpha (its adapter's scale,
        # folded into its slot's B on the engine: `View.update_weights`).
        mine = dataclasses.replace(d, cfg=d.cfg.replace(lora_alpha=c.trainer.lora.alpha))
        comp = components_lib.learner_components(
            c, meshes, train_set, eval_set, sync, reward_fn=reward_fn, base=base, described=mine
        )
        if base is None:
            base = state_lib.frozen(comp.learner.state.params)
            bases = comp.weight_sync.bases
        built.append(comp)
    return Learners(configs, built, parts)


def run(
    cfg: ExperimentConfig,
    workdir: str,
    devices: list | None = None,
    reward_fn: RewardFn | None = None,
) -> dict[str, RunResult]:
    """Runs every learner of `cfg.learners` to its last step on one generation service;
    each learner's result by name (module docstring)."""
    check(cfg, Processes.one())
    learners = build(cfg, devices, reward_fn)
    names = [learner.name for learner in cfg.learners]
    first = [w.params for w in learners.components[0].initial_weights]
    shared = SharedService.start(cfg, learners.parts, first, 0)
    results: dict[str, RunResult] = {}
    # One stop request for every learner (SIGINT/SIGTERM): each stops at its boundary,
    # and one whose run starts after it stops at once.
    shutdown = threading.Event()

    def one(slot: int) -> None:
        c, comp, name = learners.configs[slot], learners.components[slot], names[slot]
        results[name] = run_components(
            c,
            comp,
            os.path.join(workdir, name),
            generation=LearnerGeneration(c, learners.parts, shared, slot),
            trainers=Trainers(
                share=Alone(ownership(c.pipeline, 1)),
                checkpoint_dir=os.path.join(workdir, name, "checkpoints"),
            ),
            shutdown=shutdown,
        )

    signals = None
    if cfg.checkpoint.on_signal and threading.current_thread() is threading.main_thread():
        signals = ckpt_lib.install_shutdown_handler(lambda sig: shutdown.set())
    try:
        for slot, comp in enumerate(learners.components[1:], start=1):
            params = [w.params for w in comp.initial_weights]
            shared.service.update_adapter(slot, params, 0, shared.alphas[slot])
        run_together(names, one, shared.fail)
    finally:
        if signals is not None:
            signals.uninstall()
        shared.close(cfg.pipeline.timeout_s)
    return results


def run_together(
    names: Sequence[str],
    run: Callable[[int], None],
    fail: Callable[[int, BaseException, str], None],
) -> None:
    """Runs `run(slot)` of every learner on a thread of its own and ends them together:
    the first learner to fail fails the others (`fail(other, exc, component)`: their
    samples stop naming it, and each run ends at its boundary); once every thread is
    done, raises the first failure. Each run bounds its own waits (pipeline.timeout_s)."""
    errors: list[BaseException] = []  # in the order they happened: the first is the cause
    lock = threading.Lock()

    def one(slot: int) -> None:
        try:
            run(slot)
        except BaseException as e:  # noqa: BLE001 - the others end, naming this learner
            with lock:
                errors.append(e)
            logging.error("learner %s failed: %r", names[slot], e)
            for other in range(len(names)):
                if other != slot:
                    fail(other, e, f"learner {names[slot]}")

    threads = [
        threading.Thread(target=one, args=(slot,), name=f"learner-{name}", daemon=True)
        for slot, name in enumerate(names)
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    if errors:
        raise errors[0]


class Meters:
    """The service's chunk observer: every learner's meter (the service is theirs alike)."""

    def __init__(self):
        self._meters: list[Callable[[ChunkReport], None]] = []

    def add(self, meter: Callable[[ChunkReport], None]) -> None:
        self._meters.append(meter)

    def __call__(self, report: ChunkReport) -> None:
        for meter in list(self._meters):
            meter(report)
