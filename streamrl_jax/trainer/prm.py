"""The implicit process reward model's trainer: its loss, forward and advantage fill
(`algorithms/prm.py`; the learner target that runs it: `learner/prm.py`).

The PRM is a causal LM of the policy's architecture with its own params and optimizer
(`algorithm.prm_learning_rate`); every parameter trains (a policy's LoRA setting does
not carry over). Its loss reads `batch.ref_logp` (log pi_ref of the batch's tokens) and
`batch.rewards` (each sequence's outcome reward at its last loss position).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from streamrl_jax.algorithms import prm as prm_lib
from streamrl_jax.model import llama
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.config import TrainerConfig
from streamrl_jax.trainer.policy import policy_forward, policy_logprobs
from streamrl_jax.trainer.state import LossOutput
from streamrl_jax.trainer.step import Trainer, build_trainer


def prm_loss(
    model: llama.Llama, cfg: TrainerConfig, batch: TrainBatch, normalizer: jax.Array
) -> LossOutput:
    """`algorithms.prm.implicit_prm_loss` of the PRM's log-probs (`(loss, metrics, {})`)."""
    logp_BxT, _ = policy_logprobs(model, batch, cfg.logprob_chunk)
    loss, metrics = prm_lib.implicit_prm_loss(
        logp_BxT,
        batch.ref_logp,
        batch.rewards,
        batch.loss_mask,
        batch.segment_ids,
        beta=cfg.algorithm.prm_beta,
        normalizer=normalizer,
        aggregation=cfg.algorithm.aggregation,
    )
    return loss, metrics, {}


def with_process_rewards(batch: TrainBatch, prm_logp_BxT: jax.Array, cfg: TrainerConfig):
    """`batch` with `prm_coef` times each position's process-reward return (after the
    group's leave-one-out baseline with `prm_baseline="leave_one_out"`) added to its
    advantage (`batch.ref_logp` filled: log pi_ref)."""
    a = cfg.algorithm
    r_BxT = prm_lib.process_rewards(prm_logp_BxT, batch.ref_logp, batch.loss_mask, a.prm_beta)
    if a.prm_baseline == "leave_one_out":
        r_BxT = prm_lib.leave_one_out(r_BxT, batch.loss_mask, batch.segment_ids, batch.group_ids)
    rtg_BxT = prm_lib.returns_to_go(r_BxT, batch.loss_mask, batch.segment_ids)
    return batch.replace(advantages=batch.advantages + a.prm_coef * rtg_BxT)


def make_prm_trainer(
    model_cfg: ModelConfig, cfg: TrainerConfig, mesh: Mesh, *, model_seed: int = 0
) -> Trainer:
    """The PRM's trainer on the training mesh: `fill(params, batch)` adds the process
    rewards to a placed batch's advantages; `accumulate`/`apply` train its loss with the
    policy's normaliser contract."""
    return build_trainer(
        "prm",
        llama.create,
        model_cfg.replace(lora_rank=0),
        cfg,
        mesh,
        model_seed=model_seed,
        loss=prm_loss,
        forward=policy_forward,  # log pi_prm at loss positions: a causal LM as the policy
        targets=with_process_rewards,
    )
