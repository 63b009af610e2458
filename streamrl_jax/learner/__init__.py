"""What is trained and what the loss reads, as one protocol (protocol.py; docs/trainer.md).

A `Learner` is a policy kind (`initial.POLICIES`: `full`, `lora`) and the targets the
config asks for, in fill order (`TARGETS`):

* `routes` (`routes.py`, `model.routing_replay`): routing replay's recorded experts,
  replayed by the policy's forward (it sizes them in the trainer's config);
* `behaviour` (`behaviour.py`, `algorithm.tis_cap > 0`): pi_old for truncated
  importance sampling;
* `reference` (`reference.py`, `algorithm.kl_coef > 0`): the KL penalty's frozen
  reference log-probs;
* `teacher` (`teacher.py`, `algorithm.distill_teacher`): on-policy distillation;
* `critic` (`critic.py`, `algorithm.advantage="gae"`): the PPO value model, its GAE
  advantages and its own optimizer step;
* `supervised` (`supervised.py`, `algorithm.sft_coef > 0`): an auxiliary supervised
  loss on the environment's demonstrations, mixed into every RL micro-batch.

A new target is one module beside these (`wanted(cfg)`, `make(ctx) -> Target`, and
`configure` if it changes the trainer's config), one line in `targets.py` and its config
fields. This package never imports `pipeline/`.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.initial import POLICIES, initial_policy, policy_kind
from streamrl_jax.learner.learner import Learner
from streamrl_jax.learner.protocol import (
    Accumulators,
    Context,
    Micro,
    Policy,
    Rows,
    Target,
    Totals,
    Trains,
)
from streamrl_jax.learner.targets import TARGETS, wanted
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import Problem
from streamrl_jax.trainer.state import TrainState
from streamrl_jax.trainer.step import Trainer


def make_learner(
    cfg: ExperimentConfig,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    trainer: Trainer,
    state: TrainState,
    problems: Sequence[Problem] = (),
) -> Learner:
    """The run's learner around the policy's trainer and its starting state (after any
    warm-up): the targets `cfg` asks for, built in order."""
    policy = policy_kind(cfg)
    ctx = Context(cfg, model_cfg, tokenizer, policy, trainer, state, problems)
    targets = [kind.make(ctx) for kind in wanted(cfg)]
    return Learner(policy, trainer, state, targets)


def saved_entries(metadata: dict) -> list[str]:
    """The trained targets' entries a checkpoint holds, from its metadata: `entries`, or
    in a checkpoint written before the learner seam, each target's flag (`"critic":
    true`)."""
    if "entries" in metadata:
        return list(metadata["entries"])
    return [name for name in TARGETS if metadata.get(name) is True]


__all__ = [
    "POLICIES",
    "TARGETS",
    "Accumulators",
    "Context",
    "Learner",
    "Micro",
    "Policy",
    "Rows",
    "Target",
    "Totals",
    "Trains",
    "initial_policy",
    "make_learner",
    "policy_kind",
    "saved_entries",
]
