"""Routing replay's routes (`model.routing_replay`, model/routes.py, docs/model.md).

A mixture-of-experts engine records the experts each fed token went to; the samples carry
them into the batch (`TrainBatch.routes`) and the policy's forward uses them instead of
routing again. This target owns that: it sets the route size in the policy trainer's
config (`configure`, read before the trainer is built), checks that each placed
micro-batch carries routes, and adds `routes_replayed` to the step's row: the share of
the loss's positions whose route came from generation (the rest, samples that came
without a record, the trainer routed itself). It trains and saves nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.protocol import Context, Micro, Reduce, Target, Totals
from streamrl_jax.model import routes as routes_lib
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig

NAME = "routes"


def wanted(cfg: ExperimentConfig) -> bool:
    return cfg.model.routing_replay


def configure(cfg: ExperimentConfig, model_cfg: ModelConfig, tcfg: TrainerConfig) -> TrainerConfig:
    """The policy trainer's config replaying routes of `model_cfg`'s size (a dense
    model was refused by name where the run described it: `components.describe_model`)."""
    del cfg
    return tcfg.replace(routing_replay=routes_lib.Spec.of(model_cfg))


def make(ctx: Context) -> Target:
    spec = ctx.trainer.cfg.routing_replay
    if spec is None:  # configure() runs on the trainer's config before it is built
        raise ValueError("routing replay: the policy trainer was built without route sizes")
    return Target(NAME, fill=lambda dev, micro: _fill(spec, dev, micro), row=_row)


@functools.partial(jax.jit, static_argnums=2)
def _replayed(routes: jax.Array, loss_mask: jax.Array, no_route: int):
    recorded = routes[:, :, 0, 0] != no_route
    return (
        jnp.sum(loss_mask & recorded, dtype=jnp.float32),
        jnp.sum(loss_mask, dtype=jnp.float32),
    )


def _fill(spec: routes_lib.Spec, dev: TrainBatch, micro: Micro) -> TrainBatch:
    if dev.routes is None:
        raise ValueError("routing replay: a micro-batch came without routes")
    if micro.totals is not None:  # the step's routes_replayed
        replayed = _replayed(dev.routes, dev.loss_mask, spec.no_route)
        micro.totals.setdefault(NAME, []).append(replayed)
    return dev


def _row(totals: Totals, reduce: Reduce) -> dict[str, float]:
    parts = totals.get(NAME, [])
    replayed, n = reduce([float(sum(r for r, _ in parts)), float(sum(t for _, t in parts))])
    return {"routes_replayed": replayed / n if n else float("nan")}
