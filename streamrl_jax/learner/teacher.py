"""On-policy distillation from a frozen teacher (`algorithm.distill_teacher`,
`algorithms/distill.py`).

The teacher's params sit on the training mesh in the policy's structure (with LoRA, new
adapters whose B = 0: the teacher exactly). Each micro-batch's advantages gain
`distill_coef * (log pi_teacher - log pi_student)` per token, the student's log-probs
being those under the weights that sampled (pi_old when `behaviour` filled it); the
step's row gets `distill_reverse_kl`, the student's mean per-token reverse KL to the
teacher on the step's response tokens, before its update.
"""

from __future__ import annotations

from absl import logging

from streamrl_jax.algorithms import distill
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner import weights
from streamrl_jax.learner.protocol import Context, Micro, Reduce, Target, Totals
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.weight_sync import Params

NAME = "teacher"


def wanted(cfg: ExperimentConfig) -> bool:
    return bool(cfg.algorithm.distill_teacher)


def make(ctx: Context) -> Target:
    path = ctx.cfg.algorithm.distill_teacher
    params = weights.from_model_or_run(
        "algorithm.distill_teacher",
        path,
        ctx.cfg,
        ctx.policy,
        ctx.trainer,
        ctx.state.params,
        ctx.model_cfg,
    )
    logging.info("distillation teacher from %s", path)
    coef = ctx.cfg.algorithm.distill_coef
    return Target(NAME, fill=lambda dev, micro: _fill(params, coef, dev, micro), row=_row)


def _fill(teacher_params: Params, coef: float, dev: TrainBatch, micro: Micro) -> TrainBatch:
    t = micro.trainer
    # The student's log-probs under the weights that sampled: pi_old where TIS (the
    # `behaviour` target, filled before this one) computed it.
    tis = t.cfg.tis_cap is not None
    student = dev.old_logp if tis else t.logprobs(micro.state.params, dev)
    teacher = t.logprobs(teacher_params, dev)
    advantages = distill.with_teacher(
        dev.advantages, dev.loss_mask, student, teacher, t.scalar(coef)
    )
    if micro.totals is not None:  # the step's distill_reverse_kl
        micro.totals.setdefault(NAME, []).append(
            distill.reverse_kl_total(student, teacher, dev.loss_mask)
        )
    return dev.replace(advantages=advantages)


def _row(totals: Totals, reduce: Reduce) -> dict[str, float]:
    parts = totals.get(NAME, [])
    kl, n = reduce([float(sum(k for k, _ in parts)), float(sum(t for _, t in parts))])
    return {"distill_reverse_kl": kl / n if n else float("nan")}
