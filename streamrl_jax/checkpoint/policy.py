"""A run's policy at a checkpoint, LoRA-aware: `policy_params`.

A run's checkpoint holds the policy's trainable params (`pipeline/resume.py`): all
of them (full fine-tuning), or with LoRA (`trainer.lora.rank > 0`) the adapters
alone (`nnx.LoRAParam`), whose frozen base is the model the run started from
(`model.source`, or `init_from`) and is loaded, never saved. Reading "the policy
at checkpoint k" therefore needs the policy as it started, and what the
checkpoint holds decides which part of it is replaced. One function does that for
`init_from`, the distillation teacher, export and the tools.
"""

from __future__ import annotations

import os

from flax import nnx

from streamrl_jax.checkpoint.manager import restore_params_only, saved_params
from streamrl_jax.checkpoint.trees import abstract_tree, model_fingerprint, signature
from streamrl_jax.errors import UserError
from streamrl_jax.model.config import ModelConfig

Params = nnx.State


def policy_params(
    model_cfg: ModelConfig,
    checkpoint: str | os.PathLike,
    start: Params,
    shardings: Params | None = None,
) -> Params:
    """The policy of a run of `model_cfg` at `checkpoint`, in the structure of `start`.

    What the checkpoint holds decides what is read (its manifest's params signature,
    read before any array):

    * the whole policy (a full fine-tuning run's params, `start` without adapters):
      restored whole;
    * a LoRA run's adapters (`model_cfg.lora_rank > 0`): restored over `start`'s base,
      the base `start` holds (the model the run started from);
    * a full fine-tuning run's params while `model_cfg` has adapters (`init_from`, a
      distillation teacher): they become the base, `start`'s adapters kept (new ones,
      B = 0, give the checkpoint's model exactly).

    Args:
      model_cfg: the model of the run that reads the checkpoint (its LoRA fields
        included); its architecture fingerprint is checked against the checkpoint's.
      checkpoint: a checkpoint root (its latest step) or one step directory.
      start: the policy as the run starts (`pipeline.components.initial_policy`'s
        params, or any params of that structure). Leaves the checkpoint replaces are
        read for their shapes and shardings only and may be `jax.ShapeDtypeStruct`s.
      shardings: the params' target shardings, a tree like `start`; None keeps
        `start`'s own.

    Returns:
      The policy's params, `start`'s structure: base and adapters in one `nnx.State`.

    Raises:
      FileNotFoundError: `checkpoint` does not exist or holds no step.
      UserError: the checkpoint is of another model, or holds neither the policy nor
        its adapters nor its base; the message names the step directory.
    """
    fingerprint = model_fingerprint(model_cfg)
    where, saved = saved_params(checkpoint, fingerprint=fingerprint)
    lora = model_cfg.lora_rank > 0
    adapters, base = nnx.LoRAParam, nnx.Not(nnx.LoRAParam)
    if lora and _holds(saved, start.filter(adapters)):
        read, kept = adapters, base
    elif _holds(saved, start):
        read, kept = None, None
    elif lora and _holds(saved, start.filter(base)):
        read, kept = base, adapters
    else:
        held = "LoRA adapters" if any("lora_" in k for k in saved) else "full params"
        wanted = (
            f"LoRA adapters (rank {model_cfg.lora_rank}, targets {model_cfg.lora_targets}) "
            "or a full model"
            if lora
            else "a full model"
        )
        raise UserError(
            f"checkpoint {where} holds {held} ({len(saved)} arrays) that do not fit this "
            f"run's policy: it reads {wanted} of {model_cfg.num_params():,} params; a "
            "checkpoint is read with the config of the run that wrote it (its "
            "trainer.lora and model sections)"
        )
    part = (lambda tree: tree) if read is None else (lambda tree: tree.filter(read))
    out = restore_params_only(
        checkpoint,
        abstract_tree(part(start)),
        None if shardings is None else part(shardings),
        fingerprint=fingerprint,
    )
    return out if kept is None else nnx.merge_state(start.filter(kept), out)


def _holds(saved: dict[str, str], tree: Params) -> bool:
    """Whether the checkpoint's params signature is exactly `tree`'s (same leaves,
    shapes and dtypes): a whole policy is not mistaken for its adapters."""
    return bool(saved) and saved == signature(abstract_tree(tree))
