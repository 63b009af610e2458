"""pi_old for truncated importance sampling (`algorithm.tis_cap > 0`, docs/trainer.md).

The micro-batch's log-probs under the trainer's weights, not yet updated this batch
(`tis_cap` needs one mini-batch), go in as pi_old, so the TIS weight
min(pi_old / mu, cap) sees the sampler's mismatch: int8 rollout, staleness, a mid-sample
weight swap.
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.protocol import Context, Micro, Target
from streamrl_jax.trainer.batch import TrainBatch


def wanted(cfg: ExperimentConfig) -> bool:
    return bool(cfg.algorithm.tis_cap)  # 0: off (`TrainerConfig.tis_cap`)


def make(ctx: Context) -> Target:
    del ctx
    return Target("behaviour", fill=fill)


def fill(dev: TrainBatch, micro: Micro) -> TrainBatch:
    return dev.replace(old_logp=micro.trainer.logprobs(micro.state.params, dev))
