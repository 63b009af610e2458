"""Policy kinds: what of the model a learner trains, saves and sends (`protocol.Policy`).

* `full`: every parameter is trained, checkpointed and sent to generation.
* `lora` (`trainer.lora.rank > 0`): LoRA adapters (`nnx.LoRAParam`) on a frozen base.
  The optimizer updates the adapters alone; a checkpoint keeps the adapters (the base
  is the model's source, or `init_from`, loaded again on resume); after W_0 the
  generation side is sent the adapters alone (`WeightSync(adapters_only=True)`).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from streamrl_jax.config.sections import LoraSection
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.trainer import state as state_lib
from streamrl_jax.trainer.step import Trainer
from streamrl_jax.weight_sync import Params


@dataclasses.dataclass(frozen=True)
class Full:
    """Every parameter trained, saved and sent."""

    name: str = "full"
    adapters_only: bool = False

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        return model_cfg

    def complete(self, loaded: Params, trainer: Trainer, seed: int) -> Params:
        del trainer, seed
        return loaded

    def saved(self, params: Params) -> Params:
        return params

    def restored(self, saved: Params, like: Params) -> Params:
        del like
        return saved


@dataclasses.dataclass(frozen=True)
class Lora:
    """LoRA adapters on a frozen base (module docstring)."""

    section: LoraSection
    name: str = "lora"
    adapters_only: bool = True

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        s = self.section
        return model_cfg.replace(
            lora_rank=s.rank, lora_alpha=s.alpha, lora_targets=tuple(s.targets)
        )

    def complete(self, loaded: Params, trainer: Trainer, seed: int) -> Params:
        """`loaded` (a model's params without adapters) and new LoRA adapters (B = 0: the
        model as it was), in the trainer's sharding."""
        spec = trainer.spec
        adapters_sh = state_lib.trainable(trainer.state_shardings.params, True)
        fresh = jax.jit(
            lambda: nnx.state(spec.create(spec.model_cfg, seed), nnx.LoRAParam),
            out_shardings=adapters_sh,
        )()  # the base's initialisers are dead code here: only the adapters are computed
        return nnx.merge_state(loaded, fresh)

    def saved(self, params: Params) -> Params:
        return params.filter(nnx.LoRAParam)

    def restored(self, saved: Params, like: Params) -> Params:
        return nnx.merge_state(saved, state_lib.frozen(like))
