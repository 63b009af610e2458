"""RL maths as pure JAX functions on arrays, chosen by config name.

* `ADVANTAGES`: "grpo", "dr_grpo", "rloo", "reinforce_pp" (outcome estimators).
* `CRITIC_ADVANTAGES`: "gae" (needs a critic's values).
* `POLICY_LOSSES`: "ppo_clip", "dapo".
* `KL_ESTIMATORS`: "k1", "k2", "k3".
* `AGGREGATIONS`: "token_mean", "seq_mean_token_sum", "seq_mean_token_mean".

See `losses` for the normaliser contract that makes streamed gradient
accumulation equal to one step on the whole batch.
"""

from streamrl_jax.algorithms.advantages import (
    ADVANTAGES,
    CRITIC_ADVANTAGES,
    gae,
    last_token_rewards,
)
from streamrl_jax.algorithms.kl import KL_ESTIMATORS
from streamrl_jax.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    actor_loss,
    aggregate,
    finalize_metrics,
    normalizer_part,
    value_loss,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CRITIC_ADVANTAGES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "actor_loss",
    "aggregate",
    "finalize_metrics",
    "gae",
    "last_token_rewards",
    "normalizer_part",
    "value_loss",
]
