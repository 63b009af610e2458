"""Exports a run's policy as a Hugging Face safetensors directory, LoRA adapters merged.

    python tools/export_hf.py --config=configs/quickstart.py --config.trainer.lora.rank=8 \
        --checkpoint=workdir/quickstart --out=/tmp/policy_hf

`--config` is the run's config (the same file and overrides it ran with: the model and
its adapters); `--checkpoint` a checkpoint root (its latest step) or one step directory.
The directory written (`model/hf_export.py`) holds config.json, model.safetensors and the
tokenizer; `model.source=<out>` and transformers' `from_pretrained` read it. The last
line is JSON: the directory, the step, the parameter count.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint root or step directory.")
_OUT = flags.DEFINE_string("out", None, "Directory to write.")


def main(argv: list[str]) -> None:
    del argv
    import jax
    from flax import nnx

    from streamrl_jax import config as config_lib
    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax.checkpoint.policy import policy_params
    from streamrl_jax.model import hf_export, llama
    from streamrl_jax.pipeline import components

    if not (_CONFIG.value and _CHECKPOINT.value and _OUT.value):
        sys.exit("export_hf: --config, --checkpoint and --out are all required")
    cfg = config_lib.from_config_dict(_CONFIG.value)
    d = components.describe_model(cfg)
    model_cfg = d.cfg
    # The run's policy as it started (a LoRA checkpoint holds the adapters alone: the
    # base is the model's source, or init_from), then the checkpoint's params over it.
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    _, state = components.initial_policy(cfg, mesh)
    params = policy_params(model_cfg, _CHECKPOINT.value, state.params)
    model = llama.create(model_cfg)
    nnx.update(model, jax.device_get(params))
    source = components.model_path(cfg) if cfg.model.source != "tiny" else None
    out = hf_export.export(model, model_cfg, _OUT.value, source=source, tokenizer=d.tokenizer)
    print(json.dumps({"tool": "export_hf", "out": out, "lora_rank": model_cfg.lora_rank,
                      "params": model_cfg.num_params()}))  # fmt: skip


if __name__ == "__main__":
    flags.mark_flags_as_required(["checkpoint", "out"])
    app.run(main)
