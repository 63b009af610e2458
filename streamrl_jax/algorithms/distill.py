"""On-policy distillation: the per-token reverse KL to a frozen teacher as an advantage.

The student samples; a frozen teacher scores the student's own tokens on the training
mesh; each response token's advantage gains `coef * (log pi_teacher - log pi_student)`
at that token, the negative of the per-token reverse KL estimate (log pi_student -
log pi_teacher of a token drawn from the student), added to whatever the task reward
gave (0 for distillation alone). The policy loss then pushes up the tokens the teacher
likes more than the student does, token by token (no credit carried across tokens: a
discount of 0, as Thinking Machines' on-policy distillation and Tinker do).

Why an advantage and not a loss: the sampled term log pi_s(y) - log pi_t(y) with y ~ pi_s
is an unbiased estimate of KL(pi_s || pi_t) per token, but its pathwise gradient is
grad log pi_s(y), whose expectation under pi_s is zero; the gradient of the expected
reverse KL is the score-function one, E[(log pi_s - log pi_t)(y) grad log pi_s(y)],
which is what a policy-gradient step with this advantage computes. It also composes with
PPO's clipping, the token aggregation and a task reward without a loss of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_kl(student_logp_BxT: jax.Array, teacher_logp_BxT: jax.Array, mask_BxT) -> jax.Array:
    """Per-token log pi_student - log pi_teacher at the loss positions (0 elsewhere)."""
    return jnp.where(mask_BxT, student_logp_BxT - teacher_logp_BxT, 0.0)


@jax.jit
def with_teacher(
    advantages_BxT: jax.Array,
    mask_BxT: jax.Array,
    student_logp_BxT: jax.Array,
    teacher_logp_BxT: jax.Array,
    coef: jax.Array,
) -> jax.Array:
    """`advantages_BxT` plus `coef` times the negative per-token reverse KL."""
    return advantages_BxT - coef * reverse_kl(student_logp_BxT, teacher_logp_BxT, mask_BxT)


@jax.jit
def reverse_kl_total(
    student_logp_BxT: jax.Array, teacher_logp_BxT: jax.Array, mask_BxT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(the sum of the per-token reverse KL over the loss positions, their count): a step's
    `distill_reverse_kl` is the ratio of their totals over its micro-batches."""
    kl = reverse_kl(student_logp_BxT, teacher_logp_BxT, mask_BxT)
    return jnp.sum(kl), jnp.sum(mask_BxT.astype(jnp.float32))
