"""`checkpoint.policy.policy_params`: a run's policy at a checkpoint, full or LoRA.

Checkpoints are written as a run writes them (`pipeline/resume.py`): a full run's
TrainState whole, a LoRA run's with its params cut to the adapters. Every equality
is exact: restoring copies bytes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.checkpoint.policy import policy_params
from streamrl_jax.errors import UserError
from streamrl_jax.model import config as model_config
from streamrl_jax.trainer import TrainerConfig, make_policy_trainer

TCFG = TrainerConfig()  # nothing is trained: the optimizer state is only saved
FULL = model_config.tiny()
LORA = FULL.replace(lora_rank=4, lora_alpha=8.0)
ADAPTERS, BASE = nnx.LoRAParam, nnx.Not(nnx.LoRAParam)


def _trainer(model_cfg):
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:2]).train
    return make_policy_trainer(model_cfg, TCFG, mesh)


@pytest.fixture(scope="module")
def full():
    return _trainer(FULL)


@pytest.fixture(scope="module")
def lora():
    return _trainer(LORA)


def _moved(params, by: float):
    """`params` with every leaf shifted: a policy no fresh initialisation gives."""
    return jax.tree.map(lambda x: x + by, params)


def _save(root, trainer, params, *, adapters_only: bool, step: int = 3):
    state = trainer.state_from_params(params, 0)
    if adapters_only:  # what a LoRA run saves (resume.save)
        state = state.replace(params=state.params.filter(ADAPTERS))
    fingerprint = ckpt_lib.model_fingerprint(trainer.spec.model_cfg)
    with ckpt_lib.Checkpointer(root, fingerprint=fingerprint) as ckpt:
        ckpt.save(step, state, force=True)
        ckpt.wait()


def _assert_equal(a, b):
    la, lb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_full_runs_checkpoint_is_its_policy(tmp_path, full):
    start = full.init_state(0).params
    trained = _moved(start, 0.5)
    _save(tmp_path / "ckpt", full, trained, adapters_only=False)
    got = policy_params(FULL, tmp_path / "ckpt", start, full.state_shardings.params)
    _assert_equal(got, trained)
    sharding = jax.tree.leaves(full.state_shardings.params)[0]
    assert jax.tree.leaves(got)[0].sharding == sharding
    # The step directory reads the same step; the start may be shapes alone.
    got = policy_params(FULL, tmp_path / "ckpt" / "3", ckpt_lib.abstract_tree(start))
    _assert_equal(got, trained)


def test_a_lora_runs_checkpoint_is_its_adapters_on_the_runs_base(tmp_path, lora):
    start = lora.init_state(0).params
    trained = nnx.merge_state(start.filter(BASE), _moved(start.filter(ADAPTERS), 0.25))
    _save(tmp_path / "ckpt", lora, trained, adapters_only=True)
    got = policy_params(LORA, tmp_path / "ckpt", start)
    _assert_equal(got, trained)
    # Only the adapters are read: the base is the start's, whatever it holds.
    other_base = nnx.merge_state(_moved(start.filter(BASE), 1.0), start.filter(ADAPTERS))
    got = policy_params(LORA, tmp_path / "ckpt", other_base)
    _assert_equal(got.filter(BASE), other_base.filter(BASE))
    _assert_equal(got.filter(ADAPTERS), trained.filter(ADAPTERS))


def test_a_full_checkpoint_read_by_a_lora_run_is_the_base(tmp_path, full, lora):
    # init_from and a distillation teacher: a full run's weights under new adapters.
    trained = _moved(full.init_state(0).params, 0.5)
    _save(tmp_path / "ckpt", full, trained, adapters_only=False)
    start = lora.init_state(0).params
    got = policy_params(LORA, tmp_path / "ckpt", start, lora.state_shardings.params)
    _assert_equal(got.filter(BASE), trained)
    _assert_equal(got.filter(ADAPTERS), start.filter(ADAPTERS))


def test_a_checkpoint_that_does_not_fit_the_config_is_named(tmp_path, full, lora):
    start = lora.init_state(0).params
    _save(tmp_path / "lora", lora, start, adapters_only=True, step=5)
    step_dir = tmp_path / "lora" / "5"
    # Adapters read with a full run's config: there is no base to put them on.
    with pytest.raises(UserError, match=f"checkpoint {step_dir} holds LoRA adapters"):
        policy_params(FULL, tmp_path / "lora", full.init_state(0).params)
    # Adapters of another rank.
    lora8 = FULL.replace(lora_rank=8, lora_alpha=8.0)
    with pytest.raises(UserError, match=f"{step_dir} holds LoRA adapters .*\\(rank 8"):
        policy_params(lora8, tmp_path / "lora", _trainer(lora8).init_state(0).params)
    # Another architecture: the fingerprint names the field.
    wide = FULL.replace(hidden_size=FULL.hidden_size * 2)
    with pytest.raises(UserError, match=f"checkpoint {step_dir} is from another model: hidden"):
        policy_params(wide.replace(lora_rank=4, lora_alpha=8.0), tmp_path / "lora", start)
    with pytest.raises(FileNotFoundError, match="checkpoint .*nowhere does not exist"):
        policy_params(LORA, tmp_path / "nowhere", start)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint to restore in .*empty"):
        policy_params(LORA, tmp_path / "empty", start)
