"""The scheduling switches of a running pipeline: dispatch, online ranker, elastic instances.

`LiveScheduler` is what the pipeline's generation driver asks where each request goes:

* `scheduling.dispatch`:
  * `"round_robin"` (default): the service deals requests in turn, FIFO admission;
  * `"random"`: the paper's baseline (shuffled, dealt by slot count, FIFO);
  * `"skew_aware"`: Algorithm 2 (dispatch.py) with the ranker's scores, P50/P90 of
    the recent output lengths and PTL(BS) (`scheduling.ptl_profile`, a JSON written by
    tools/profile_ptl.py; default flat, which is what this repo's fixed-shape decode
    step costs), plus longest-predicted-first admission inside each engine;
  * `"oracle"`: the same plan with the true lengths (length-replay runs only, where
    every request carries its forced length).
* The ranker starts from `scheduling.ranker_path` (arrays + JSON from tools/train_ranker.py,
  `ranker_file.py`)
  or untrained, and with `scheduling.ranker_online` refreshes from the samples the
  run completes, once per step on a thread this object owns (`refresh_async`,
  joined by `close`), so generation never waits for it.
  Its state is saved with the run's checkpoints. In a multi-controller run the
  refresh runs on the training process, where the samples arrive, and
  `on_refresh` sends the new parameters to every generation process's dispatcher
  (`pipeline/processes/`).
* Elastic generation (`scheduling.elastic_reserved = R`): the last R instances of
  `mesh.instance_slots` are built at start (they hold the current weights, since
  every weight update goes to every engine, so the version contract is unchanged)
  but get no requests until the elastic rule (balance.ElasticController, delta >=
  delta') activates one, between two batches, without stopping the trainer. T_gen
  is the batch's generation span (first admission to last completion), T_train the
  trainer's busy seconds of the step. Across processes the units are generation
  processes: the first training process runs the rule over `ElasticUnits` and
  activates a reserved process from a later batch through the roster
  (`pipeline/processes/roster.py`); the generation processes' schedulers reserve nothing.

Every plan and elastic decision is logged (`decisions`), and the step metrics carry
`active_instances`, `plan_long_instances` and the ranker's refresh loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from absl import logging

from streamrl_jax.config import SchedulingSection
from streamrl_jax.generation.types import GenerationRequest
from streamrl_jax.scheduling import balance, dispatch
from streamrl_jax.scheduling.ranker import Ranker, RankerConfig
from streamrl_jax.scheduling.ranker_file import load_ranker

DISPATCH = ("round_robin", "random", "skew_aware", "oracle")


class ElasticUnits(Protocol):
    """Units the elastic rule adds that are not this scheduler's own instances (a
    multi-controller trainer's generation processes, `pipeline/processes/training.py`)."""

    def counts(self) -> tuple[int, int]:
        """(active units, reserved units neither lost nor active), read before each
        decision (a loss may have activated one already)."""

    def activate(self, step: int) -> bool:
        """The rule added a unit at the end of `step`: activates the next reserved one
        (False if none could be)."""


class LiveScheduler:
    """Dispatch, ranker and elasticity of one run (see the module docstring)."""

    def __init__(
        self,
        section: SchedulingSection,
        instance_slots: Sequence[int],
        *,
        vocab_size: int,
        seed: int,
        initial_length: float,
        reserved: int,
        refresh: bool = True,
        on_refresh: Callable[[Ranker], None] | None = None,
        units: ElasticUnits | None = None,
    ):
        """Args:
        section: the run's `scheduling` config.
        instance_slots: slots of each generation instance this scheduler dispatches to.
        vocab_size, seed: the ranker's (an untrained one is built from them).
        initial_length: the dispatcher's output-length estimate before it has observed any.
        reserved: instances of `instance_slots` held back for the elastic rule (0 where
          the reserved units are processes: `units`).
        refresh: whether this process refreshes the ranker online (with
          `scheduling.ranker_online`); a multi-controller generation process only scores
          with the refreshes its trainer sends.
        on_refresh: after each refresh that trained, on the refresh thread (a
          multi-controller trainer sends the new parameters to the generation processes).
        units: the elastic rule's units when they are not this scheduler's instances.
        """
        s = section
        self.kind = s.dispatch
        self.slots = list(instance_slots)
        self.active = len(self.slots) - reserved
        self.decisions: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.ranker: Ranker | None = None
        if s.dispatch == "skew_aware" or s.ranker_path:
            self.ranker = (
                load_ranker(s.ranker_path)
                if s.ranker_path
                else Ranker(
                    RankerConfig(vocab_size=vocab_size, seed=seed, min_buffer=s.ranker_min_samples)
                )
            )
        self.online = refresh and s.ranker_online and self.ranker is not None
        ptl = (
            dispatch.PTLProfile.from_json(s.ptl_profile)
            if s.ptl_profile
            else dispatch.PTLProfile((1,), (1.0,))
        )
        self.dispatcher = dispatch.SkewAwareDispatcher(
            self.ranker.score if self.ranker is not None else (lambda p: np.zeros(len(p))),
            ptl,
            dispatch.DispatchConfig(
                objective=s.objective,
                planner=s.planner,
                initial_length=initial_length,
                # The engine decodes the batch bucket covering its running slots
                # (generation/compact.py): a step costs PTL(active batch), as on GPUs.
                static_batch=False,
            ),
        )
        self.random = dispatch.RandomDispatcher(seed=seed)
        self.elastic: balance.ElasticController | None = None
        self._units = units
        if units is not None:
            active, left = units.counts()
            self.elastic = balance.ElasticController(
                active, active + left, saving=balance.ideal_saving
            )
        elif reserved:
            self.elastic = balance.ElasticController(
                self.active, len(self.slots), saving=balance.ideal_saving
            )
        self._pending: list[tuple[tuple[int, ...], int]] = []
        self._refresh: threading.Thread | None = None
        self._written = 0  # decisions already written by `write_decisions`
        self.last_loss = float("nan")
        self._on_refresh = on_refresh

    @property
    def lpt(self) -> bool:
        """Engines admit longest-predicted first."""
        return self.kind in ("skew_aware", "oracle")

    # ------------------------------------------------------------------ dispatch
    def plan(
        self, batch: int, requests: list[GenerationRequest]
    ) -> tuple[list[GenerationRequest], list[int] | None]:
        """(requests with admission priorities, target instance per request or None)."""
        with self._lock:
            active = self.active
        if self.kind == "round_robin" and active == len(self.slots):
            return requests, None
        slots = self.slots[:active]
        prompts = [r.prompt for r in requests]
        if self.kind == "skew_aware":
            plan = self.dispatcher.plan(prompts, active, slots)
        elif self.kind == "oracle":
            if any(r.forced_length is None for r in requests):
                raise ValueError(
                    "scheduling.dispatch='oracle' needs forced lengths "
                    "(generation.length_replay=True)"
                )
            lengths = np.array([r.forced_length for r in requests], np.float64)
            plan = self.dispatcher.plan_scores(lengths, active, slots)
        elif self.kind == "random":
            plan = self.random.plan(prompts, active, slots)
        else:  # round robin over the active instances
            plan = dispatch.DispatchPlan(
                [i % active for i in range(len(requests))], [0.0] * len(requests)
            )
        out = [
            dataclasses.replace(r, priority=float(p))
            for r, p in zip(requests, plan.priority_per_request, strict=True)
        ]
        counts = np.bincount(plan.instance_per_request, minlength=active).tolist()
        self.decisions.append(
            {
                "batch": batch,
                "kind": "dispatch",
                "dispatch": self.kind,
                "active_instances": active,
                "requests_per_instance": counts,
                "long_instances": list(plan.long_instances),
                "predicted_s": plan.predicted_s,
            }
        )
        return out, list(plan.instance_per_request)

    # ------------------------------------------------------------------ feedback
    def observe(self, prompt: Sequence[int], length: int) -> None:
        """A finished training sample (collector thread)."""
        self.dispatcher.observe([length])
        if self.online:
            with self._lock:
                self._pending.append((tuple(int(t) for t in prompt), int(length)))

    def refresh_async(self, step: int) -> None:
        """Starts an online ranker refresh on the samples observed since the last one, on
        a thread this object owns (one at a time: skipped while the previous one still
        runs, its samples wait for the next). A step hook of the trainer loop."""
        del step
        if not self.online or (self._refresh is not None and self._refresh.is_alive()):
            return
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._refresh = threading.Thread(
                target=self.refresh, args=(batch,), name="ranker-refresh", daemon=True
            )
            self._refresh.start()

    def refresh(self, batch: list[tuple[tuple[int, ...], int]]) -> None:
        """Online ranker update (a few optimizer steps); a failure only logs."""
        try:
            loss = self.ranker.update(batch)
            if loss is not None:
                self.last_loss = loss
                if self._on_refresh is not None:
                    self._on_refresh(self.ranker)
        except Exception as e:  # noqa: BLE001 - scheduling quality only; never fails the run
            logging.warning("ranker refresh failed (dispatch keeps the previous ranker): %r", e)

    def write_decisions(self, path: str) -> None:
        """Appends the dispatch / elastic decisions made since the last call to `path`
        (JSON lines). A step hook of the trainer loop."""
        new = self.decisions[self._written :]
        if not new:
            return
        self._written += len(new)
        with open(path, "a", encoding="utf-8") as f:
            for d in new:
                f.write(json.dumps(d, default=float) + "\n")

    def close(self, timeout: float) -> None:
        """Joins a running refresh.

        Raises:
          TimeoutError: naming the ranker refresh when it did not finish in time.
        """
        if self._refresh is not None:
            self._refresh.join(timeout)
            if self._refresh.is_alive():
                raise TimeoutError(f"ranker refresh did not finish within {timeout:.0f} s")

    def end_of_step(self, step: int, t_gen: float, t_train: float) -> dict[str, float]:
        """Once per training step: the elastic rule; returns the step's scheduling metrics."""
        out = {
            "active_instances": float(self.active),
            "ranker_steps": float(self.ranker.steps if self.ranker is not None else 0),
        }
        if math.isfinite(self.last_loss):  # NaN until the first refresh: no row entry
            out["ranker_loss"] = self.last_loss
        if self.elastic is not None and t_gen > 0:
            if self._units is not None:  # the roster's truth, losses included
                active, left = self._units.counts()
                self.elastic.instances, self.elastic.max_instances = active, active + left
            d = self.elastic.observe(step, t_gen, t_train)
            record = {"batch": step, "kind": "elastic", **dataclasses.asdict(d)}
            if d.add and self._units is not None:
                record["activated"] = self._units.activate(step)  # a generation process
            elif d.add:
                with self._lock:
                    self.active = self.elastic.instances
                logging.info(
                    "elastic: instance %d activated for batches after %d", self.active - 1, step
                )
            self.decisions.append(record)
            out |= {"elastic_delta": d.delta, "elastic_delta_prime": d.delta_prime}
            if self._units is not None:
                out["active_generation_processes"] = float(self._units.counts()[0])
        return out
