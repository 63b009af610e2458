"""The Learner seam (`streamrl_jax/learner/`): targets built from the config through the
registry, and the `supervised` target's gradient (an auxiliary supervised loss on an
environment's demonstrations, mixed into RL micro-batches)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support import agent_config, policy_samples, tiny_config

from streamrl_jax import learner as learner_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import ConfigError
from streamrl_jax.learner.demonstrations import demonstrations
from streamrl_jax.pipeline import components, datasets
from streamrl_jax.trainer import make_batch

COEF, ROWS = 0.5, 2


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


def test_the_supervised_target_adds_the_demonstrations_nll_gradient():
    cfg = agent_config(algorithm__sft_coef=COEF, algorithm__sft_batch=ROWS)
    _, train_set = datasets.datasets(cfg)
    problems = [train_set[0]]  # one problem: every draw is its demonstration
    with_sft, tokenizer = _learner(cfg, problems)
    without = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, sft_coef=0.0))
    assert [t.name for t in with_sft.targets] == ["supervised"] and not learner_lib.wanted(without)
    trainer, state = with_sft.trainer, with_sft.state
    # RL samples of advantage 0: their policy-gradient term is exactly zero, so the
    # micro-batch's gradient is what the target adds (no second learner to subtract).
    zero = np.zeros(2, np.float32)
    host = make_batch(**policy_samples(n=2, advantages=zero), **trainer.cfg.layout)
    totals: dict = {}
    dev = with_sft.place(0, host, totals)
    got = with_sft.accumulate(0, dev, with_sft.init_accumulators())["policy"].grads
    # What the target adds: COEF x the gradient of the demonstration's negative
    # log-likelihood (ratio 1), for each of its ROWS copies.
    (demo,) = demonstrations(cfg, tokenizer, problems)
    sft = trainer.place_batch(
        make_batch(
            [demo.prompt] * ROWS,
            [demo.response] * ROWS,
            behaviour_logp=[np.zeros(len(demo.response), np.float32)] * ROWS,
            policy_masks=[demo.policy_mask] * ROWS,
            pad_id=tokenizer.pad_id,
            **trainer.cfg.layout,
        )
    )

    def nll(params):
        return -(trainer.logprobs(params, sft) * sft.loss_mask).sum()

    value, want = jax.jit(jax.value_and_grad(nll))(state.params)
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    assert any(float(np.abs(w).max()) > 0 for _, w in leaves)
    for g, w in leaves:
        np.testing.assert_allclose(np.asarray(g), COEF * np.asarray(w), rtol=2e-3, atol=2e-6)
    # Its row figure: the demonstrations' mean NLL per trained token under W_b.
    row = with_sft.row(totals, list)
    tokens = ROWS * int(demo.policy_mask.sum())
    np.testing.assert_allclose(row["sft_nll"], float(value) / tokens, rtol=1e-5)


def test_the_supervised_loss_needs_an_environments_demonstrations():
    with pytest.raises(ConfigError, match="algorithm.sft_coef"):
        tiny_config(algorithm__sft_coef=0.5)


def test_the_routes_target_sizes_the_trainer_and_reports_the_replayed_share(tmp_path):
    from support import hf_run_dir

    from streamrl_jax.model import routes as routes_lib

    moe = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=True, tie_word_embeddings=False)  # fmt: skip
    source = hf_run_dir(tmp_path / "moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", moe)
    made, _ = _learner(tiny_config(model__source=source, model__routing_replay=True), [])
    assert [t.name for t in made.targets] == ["routes"] and made.entries() == []
    spec = made.trainer.cfg.routing_replay
    assert spec == routes_lib.Spec(8, 2, 2)
    # sample 0 came with a record of every position, sample 1 without one
    kw = policy_samples(n=2)
    positions = [len(p) + len(r) - 1 for p, r in zip(kw["prompts"], kw["responses"], strict=True)]
    recorded = np.zeros(spec.shape(positions[0]), spec.dtype)
    host = make_batch(**kw, routes=[recorded, None], **made.trainer.cfg.layout)
    totals: dict = {}
    made.place(0, host, totals)
    share = len(kw["responses"][0]) / sum(len(r) for r in kw["responses"])
    np.testing.assert_allclose(made.row(totals, list)["routes_replayed"], share, rtol=1e-6)
    with pytest.raises(ValueError, match="a micro-batch came without routes"):
        made.place(0, host.replace(routes=None))
