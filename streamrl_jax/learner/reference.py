"""The frozen reference policy of the KL penalty (`algorithm.kl_coef > 0`).

A copy of the policy's weights as the run starts (after any warm-up); each micro-batch
gets its log-probs under them (`TrainBatch.ref_logp`). Never trained and never saved: a
resumed run rebuilds it from the same source (`init_from`, `model.source`).
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.protocol import Context, Micro, Target
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.weight_sync import Params


def wanted(cfg: ExperimentConfig) -> bool:
    return cfg.algorithm.kl_coef > 0


def make(ctx: Context) -> Target:
    ref = ctx.trainer.copy_params(ctx.state.params)  # survives the state's donation
    return Target("reference", fill=lambda dev, micro: _fill(ref, dev, micro))


def _fill(ref: Params, dev: TrainBatch, micro: Micro) -> TrainBatch:
    return dev.replace(ref_logp=micro.trainer.logprobs(ref, dev))
