"""The targets' registry: name -> module, in the order they fill a micro-batch.

Each module has `wanted(cfg) -> bool` and `make(ctx: Context) -> Target`; a target that
changes the policy trainer's config (routing replay's route sizes) also has
`configure(cfg, model_cfg, tcfg) -> TrainerConfig`, applied before the trainer is built
(`trainer_config`). A later target reads what an earlier one filled (the teacher reads
behaviour's pi_old).
"""

from __future__ import annotations

from types import ModuleType

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner import behaviour, critic, prm, reference, routes, supervised, teacher
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer.config import TrainerConfig

TARGETS: dict[str, ModuleType] = {
    "routes": routes,
    "behaviour": behaviour,
    "reference": reference,
    "prm": prm,
    "teacher": teacher,
    "critic": critic,
    "supervised": supervised,
}


def wanted(cfg: ExperimentConfig) -> list[ModuleType]:
    """The modules of the targets `cfg` asks for, in fill order."""
    return [kind for kind in TARGETS.values() if kind.wanted(cfg)]


def trainer_config(
    cfg: ExperimentConfig, model_cfg: ModelConfig, tcfg: TrainerConfig
) -> TrainerConfig:
    """The policy trainer's config with what the wanted targets change in it."""
    for kind in wanted(cfg):
        configure = getattr(kind, "configure", None)
        if configure is not None:
            tcfg = configure(cfg, model_cfg, tcfg)
    return tcfg
