"""`pipeline/evaluation.py`: the run's held-out set, a run's policy over its base, refusals.

The evaluator's accuracy needs a real model (the benches run it); here its parts: the
held-out set it reads is the run's, a run's policy at its start is the base exactly
(LoRA: zero adapters on it), and a checkpoint's adapters land on the base given.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from support import agent_config, tiny_config

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.errors import UserError
from streamrl_jax.model import llama
from streamrl_jax.model.loader import Pretrained
from streamrl_jax.pipeline import components, datasets, evaluation
from streamrl_jax.trainer import TrainerConfig, make_policy_trainer

LORA = {"rank": 4, "alpha": 8.0, "targets": ("q", "v")}


def test_the_held_out_set_is_the_runs_and_follows_the_eval_seed():
    cfg = tiny_config(eval__num_problems=6)
    held_out, _ = datasets.datasets(cfg)
    assert datasets.eval_set(cfg).questions() == held_out.questions()
    other = evaluation.with_eval_seed(cfg, cfg.data.eval_seed + 1, problems=3)
    assert other.eval.num_problems == 3 and other.data.train_seed == cfg.data.train_seed
    assert len(datasets.eval_set(other)) == 3
    assert not datasets.eval_set(other).questions() <= held_out.questions()


def test_an_environment_config_is_refused_naming_the_field():
    with pytest.raises(UserError, match="environment.name='retry': the evaluator scores single"):
        evaluation.Evaluator(agent_config(environment__name="retry"), problems=2)


def _base(cfg) -> Pretrained:
    """The tiny model `cfg` starts from, as a loader would hand it over."""
    model_cfg = components.describe_model(cfg).cfg
    graphdef, params = nnx.split(llama.create(model_cfg, seed=3))
    return Pretrained(model_cfg, graphdef, params, None, {}, "tiny")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_runs_policy_is_its_adapters_on_the_base(tmp_path):
    full = _base(tiny_config())
    start = evaluation.run_policy(tiny_config(), full, None)
    assert start.params is full.params and start.model_cfg == full.cfg
    lora_cfg = tiny_config(trainer__lora=LORA)
    policy = evaluation.run_policy(lora_cfg, full, None)
    assert (policy.model_cfg.lora_rank, policy.model_cfg.lora_targets) == (4, ("q", "v"))
    base, adapters = (
        policy.params.filter(nnx.Not(nnx.LoRAParam)),
        policy.params.filter(nnx.LoRAParam),
    )
    for x, y in zip(_leaves(base), _leaves(full.params), strict=True):
        np.testing.assert_array_equal(x, y)
    assert all(not a.any() for a in _leaves(adapters))  # A = B = 0: the base exactly
    # A LoRA run's checkpoint (its adapters alone, as resume saves them) over that base.
    trained = jax.tree.map(lambda x: x + 0.5, adapters)
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    trainer = make_policy_trainer(policy.model_cfg, TrainerConfig(), mesh)
    state = trainer.state_from_params(nnx.merge_state(base, trained))
    with ckpt_lib.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, state.replace(params=state.params.filter(nnx.LoRAParam)), force=True)
        ckpt.wait()
    got = evaluation.run_policy(lora_cfg, full, tmp_path / "ckpt")
    for x, y in zip(_leaves(got.params.filter(nnx.LoRAParam)), _leaves(trained), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(
        _leaves(got.params.filter(nnx.Not(nnx.LoRAParam))), _leaves(full.params), strict=True
    ):
        np.testing.assert_array_equal(x, y)
