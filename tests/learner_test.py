"""The Learner seam (`streamrl_jax/learner/`): targets built from the config through the
registry."""

from __future__ import annotations

import jax
from support import tiny_config

from streamrl_jax import learner as learner_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.pipeline import components


def _learner(cfg, problems):
    d = components.describe_model(cfg)
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    trainer, state = learner_lib.initial_policy(cfg, d, mesh)
    made = learner_lib.make_learner(cfg, d.cfg, d.tokenizer, trainer, state, problems)
    return made, d.tokenizer


def test_the_registry_builds_the_targets_the_config_asks_for():
    cfg = tiny_config(algorithm__kl_coef=0.1, algorithm__tis_cap=2.0, algorithm__advantage="gae")
    made, _ = _learner(cfg, [])
    assert [t.name for t in made.targets] == ["behaviour", "reference", "critic"]
    assert made.entries() == ["critic"] and made.policy.name == "full"
    assert [t.name for t in _learner(tiny_config(), [])[0].targets] == []
