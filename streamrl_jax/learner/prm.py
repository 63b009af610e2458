"""Implicit process rewards (`algorithm.prm_coef > 0`; algorithms/prm.py, trainer/prm.py).

A process reward model of the policy's architecture, its params a copy of the policy's
as the run starts (so it equals pi_ref and every process reward starts at 0), with its
own trainer and optimizer (`algorithm.prm_learning_rate`). Each micro-batch gets its
log-probs under pi_ref in `ref_logp` (the `reference` target's when the KL penalty is on;
else this target's own frozen copy fills it, and the policy's loss, with `kl_coef` 0,
does not read it), then `prm_coef` times each position's process-reward return in its
advantages, under the PRM's weights from before its update on this batch (per sample:
any split into micro-batches gives the same advantages). The PRM's cross-entropy on the
outcome labels accumulates beside the policy's gradients and it steps after the policy
at every optimizer step (its metrics in the row as `prm_*`). Its TrainState is part of
every checkpoint (entry "prm"); a resumed run rebuilds pi_ref from the same source.
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.own_model import OwnModel
from streamrl_jax.learner.protocol import Context, Micro, Target
from streamrl_jax.trainer import prm as prm_lib
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import own_model_trainer_config

NAME = "prm"


def wanted(cfg: ExperimentConfig) -> bool:
    return cfg.algorithm.prm_coef > 0


def make(ctx: Context) -> Target:
    mesh, lr = ctx.trainer.mesh, ctx.cfg.algorithm.prm_learning_rate
    tcfg = own_model_trainer_config(ctx.cfg, fsdp=mesh.shape["fsdp"], learning_rate=lr)
    trainer = prm_lib.make_prm_trainer(ctx.model_cfg, tcfg, mesh)
    start = ctx.trainer.copy_params(ctx.state.params)  # survives the state's donation
    prm = OwnModel(NAME, trainer, trainer.state_from_params(start, ctx.cfg.seed))
    ref = None if ctx.cfg.algorithm.kl_coef > 0 else start  # else `reference` fills it

    def fill(dev: TrainBatch, micro: Micro) -> TrainBatch:
        if ref is not None:
            dev = dev.replace(ref_logp=micro.trainer.logprobs(ref, dev))
        return trainer.fill(prm.state.params, dev)

    return Target(NAME, fill=fill, trains=prm)
