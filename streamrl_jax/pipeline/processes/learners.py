"""Several learners across processes (`ExperimentConfig.learners`, docs/learners.md,
docs/multicontroller.md "Several learners across processes").

The one-process layout (`pipeline/learners.py`) spread over the program's processes:

* **Generation processes.** Each holds one `GenerationService` whose engines keep the
  frozen base once and one adapter slot per learner (`SharedService`: its router hands
  every finished sample to the learner its adapter names). Each learner has a driver of
  its own over its `View` of that service: a `GenerationProcess` of the learner's
  config (its prompts, rollout and version contract), with its own weight receiver and
  sample channels. The first learner to send its W_0 starts the service; each writes its
  own adapter slot before its driver submits anything.
* **Training processes.** The T training processes split into one block of T / L per
  learner, in the learners' order (learner i: training processes G + i*T/L ..): each
  block runs that learner's trainer as a one-learner run does (FSDP over its block),
  sending its adapters alone after its first version. A learner after the first starts
  its adapters on the first learner's frozen base, as in one process (`base_from`).
* **Keys.** Each learner is a run of its own on the program: its config
  (`learner_config`), its workdir `<workdir>/<name>` (metrics, samples, checkpoints), and
  its keys on its own board (`roles.Board("learner/<name>/")`), so its start, samples,
  weights, roster and outcome travel as a one-learner run's do.

The first learner to fail ends the others on the generation processes (their drivers'
samples stop naming it, `SharedService.fail`), and each training process then loses its
generation processes and ends; a resumed program resumes each learner from its own
checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from streamrl_jax import metrics
from streamrl_jax.config import ExperimentConfig, learner_config
from streamrl_jax.distributed import roles
from streamrl_jax.generation.types import ChunkReport
from streamrl_jax.pipeline import components as components_lib
from streamrl_jax.pipeline.learners import SharedService, run_together
from streamrl_jax.pipeline.processes.generation import GenerationProcess
from streamrl_jax.pipeline.processes.plan import CLOSE_TIMEOUT_S
from streamrl_jax.pipeline.processes.training import run_training
from streamrl_jax.pipeline.step_metrics import RunResult
from streamrl_jax.weight_sync import Params


def board(name: str) -> roles.Board:
    """A learner's keys."""
    return roles.Board(f"learner/{name}/")


def blocks(r: roles.Roles, learners: int) -> list[tuple[int, ...]]:
    """Each learner's training processes: the training processes in `learners` equal
    blocks, in order (config.check asks that they split)."""
    t = r.training_processes
    per = len(t) // learners
    return [tuple(t[i * per : (i + 1) * per]) for i in range(learners)]


def learner_roles(r: roles.Roles, block: tuple[int, ...]) -> roles.Roles:
    """The roles as one learner's run sees them: its own training processes."""
    return dataclasses.replace(
        r,
        training_processes=block,
        training_devices=tuple(d for d in r.training_devices if d.process_index in block),
    )


def run_training_learner(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig, r: roles.Roles
) -> RunResult:
    """This training process's learner: the one whose block holds it."""
    configs = [learner_config(cfg, learner) for learner in cfg.learners]
    ((i, block),) = [(i, b) for i, b in enumerate(blocks(r, len(configs))) if r.process_id in b]
    name = cfg.learners[i].name
    mine = learner_roles(r, block)
    logging.info(
        "training process %d: learner %s on %s", r.process_id, name, mine.training_processes
    )
    metrics.set_writer_process(mine.training_processes[0])  # its metrics: its first's
    return run_training(
        configs[i],
        os.path.join(workdir, name),
        dcfg,
        mine,
        board(name),
        base_from=configs[0] if i > 0 else None,
    )


class _Service:
    """The learners' one service on this generation process, started by the first
    learner's W_0 (every learner's W_0 holds the same base); `view` then writes the
    learner's own adapter slot and hands it its `View`."""

    def __init__(self, parts: components_lib.GenerationParts, cfg: ExperimentConfig):
        self.parts, self.cfg = parts, cfg
        self.shared: SharedService | None = None
        self._failed: dict[int, tuple[BaseException, str]] = {}  # before the service began
        self._lock = threading.Lock()

    def view(self, slot: int) -> Callable[[list[Params], int, Callable[[ChunkReport], None]], Any]:
        def make(params: list[Params], version: int, on_chunk: Callable[[ChunkReport], None]):
            with self._lock:
                if slot in self._failed:  # another learner failed before this one started
                    exc, component = self._failed[slot]
                    raise RuntimeError(f"{component} failed: {exc!r}") from exc
                if self.shared is None:
                    self.shared = SharedService.start(self.cfg, self.parts, params, version)
                self.shared.add_meter(on_chunk)
                self.shared.service.update_adapter(slot, params, version, self.shared.alphas[slot])
                return self.shared.view(slot)

        return make

    def fail(self, slot: int, exc: BaseException, component: str) -> None:
        """Learner `slot` ends naming `component` (another learner failed): its samples
        stop, or, before the service began, its driver does not start."""
        with self._lock:
            if self.shared is None:
                self._failed[slot] = (exc, component)
                return
        self.shared.fail(slot, exc, component)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close(CLOSE_TIMEOUT_S)


def run_generation_learners(
    cfg: ExperimentConfig, workdir: str, dcfg: roles.DistributedConfig, r: roles.Roles
) -> None:
    """This generation process: every learner's driver over one shared service (module
    docstring). Raises the first learner's failure."""
    configs = [learner_config(cfg, learner) for learner in cfg.learners]
    names = [learner.name for learner in cfg.learners]
    first = components_lib.build_generation(configs[0], jax.local_devices(), adapters=len(configs))
    sides = [first] + [
        components_lib.build_generation(c, jax.local_devices(), parts=first.parts)
        for c in configs[1:]
    ]
    service = _Service(first.parts, cfg)
    processes = [
        GenerationProcess(
            c,
            os.path.join(workdir, name),
            dcfg,
            learner_roles(r, block),
            board(name),
            side=side,
        )
        for c, name, block, side in zip(configs, names, blocks(r, len(configs)), sides, strict=True)
    ]
    try:
        run_together(names, lambda slot: processes[slot].run(service.view(slot)), service.fail)
    finally:
        service.close()
