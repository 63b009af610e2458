"""PPO critic: GAE targets, value head sharding, exact split accumulation, and regression."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import CriticSection, OptimizerSection
from streamrl_jax.model import config as model_config
from streamrl_jax.trainer import TrainerConfig, make_batch
from streamrl_jax.trainer.critic import (
    group_whiten,
    make_critic_trainer,
    whiten_advantages,
    with_gae,
)

CFG = TrainerConfig(
    optimizer=OptimizerSection(learning_rate=1e-2, max_grad_norm=0.0),
    critic=CriticSection(gamma=1.0, lam=1.0, value_clip=0.0, whiten="none"),
    seq_buckets=(16,),
    batch_buckets=(8,),
)


def _host_batch(idx, rewards):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 1 + i % 4) for i in range(8)]
    responses = [rng.integers(0, 256, 2 + i % 5) for i in range(8)]
    return make_batch(
        [prompts[i] for i in idx],
        [responses[i] for i in idx],
        behaviour_logp=[np.zeros(len(responses[i])) for i in idx],
        rewards=rewards[np.asarray(idx)],
        seq_buckets=CFG.seq_buckets,
        batch_buckets=CFG.batch_buckets,
    )


def test_gae_targets_gamma_lambda_one():
    rewards = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    host = _host_batch(range(8), rewards)
    values = np.random.default_rng(1).normal(size=host.shape).astype(np.float32)
    gae = jax.jit(with_gae, static_argnames="cfg")
    out = gae(jax.device_put(host), values, cfg=CFG)
    mask = host.loss_mask
    # gamma = lambda = 1: returns are the outcome reward, advantages R - V_t.
    ret_want = np.where(mask, rewards[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(out.returns), ret_want, atol=1e-6)
    adv_want = np.where(mask, rewards[:, None] - values, 0.0)
    np.testing.assert_allclose(np.asarray(out.advantages), adv_want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.old_values), np.where(mask, values, 0.0))
    # Per sample: the targets of a row do not depend on the other rows of its batch.
    part = _host_batch([6, 2, 5], rewards)
    part_values = np.zeros_like(values)
    part_values[:3] = values[[6, 2, 5]]
    got = gae(jax.device_put(part), part_values, cfg=CFG)
    for name in ("advantages", "returns", "old_values"):
        want = np.asarray(getattr(out, name))[[6, 2, 5]]
        np.testing.assert_allclose(np.asarray(getattr(got, name))[:3], want, atol=1e-6)
    whitened = jax.jit(whiten_advantages)(out)  # the explicit whole-batch option
    adv = np.asarray(whitened.advantages)[mask]
    np.testing.assert_allclose([adv.mean(), adv.std()], [0.0, 1.0], atol=1e-4)


def test_value_head_is_fsdp_sharded():
    mesh8 = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True, train_tp=2)).train
    critic = make_critic_trainer(model_config.tiny(), CFG, mesh8)  # shardings only, no init
    assert critic.state_shardings.params["value_head"].value.spec == P("fsdp", None)
    assert critic.state_shardings.params["backbone"]["embed"].value.spec == P("tp", "fsdp")


def test_critic_split_exact_and_regresses_returns():
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    critic = make_critic_trainer(model_config.tiny(), CFG, mesh)
    rewards = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    whole = critic.place_batch(_host_batch(range(8), rewards))
    state = critic.init_state(0)
    values0 = np.asarray(critic.forward(state.params, whole))
    assert not values0.any()  # zero-initialised head
    gae = jax.jit(with_gae, static_argnames="cfg")
    whole = gae(whole, jnp.asarray(values0), cfg=CFG)
    halves = [critic.place_batch(_host_batch(idx, rewards)) for idx in ([5, 1, 7, 3], [0, 2, 4, 6])]
    halves = [critic.fill_gae(state.params, h) for h in halves]  # per streamed micro-batch

    one = critic.scalar(1.0)
    acc_whole, _ = critic.accumulate(state, critic.init_accumulator(), whole, one)
    acc = critic.init_accumulator()
    for h in halves:
        acc, _ = critic.accumulate(state, acc, h, one)
    # float32 summation order only (see trainer_test for the tolerance rationale)
    g_split, g_whole = jax.tree.leaves(acc.grads), jax.tree.leaves(acc_whole.grads)
    scale = max(float(np.abs(g).max()) for g in g_whole)
    assert scale > 0
    for a, b in zip(g_split, g_whole, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(float(acc.normalizer_sum), float(acc_whole.normalizer_sum))

    losses = []
    for _ in range(12):
        acc = critic.init_accumulator()
        for h in halves:
            acc, _ = critic.accumulate(state, acc, h, one)
        state, acc, metrics = critic.apply(state, acc)
        losses.append(float(metrics["vf_loss"]))
    assert losses[-1] < 0.5 * losses[0], losses


def test_group_whitening_is_per_group_and_split_invariant():
    # critic.whiten="group": each group's response tokens get mean 0 and std 1; a group
    # is whole in any micro-batch, so a split keeps every row's advantages.
    rewards = np.linspace(-1.0, 1.0, 8).astype(np.float32)
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    host = _host_batch(range(8), rewards)
    host = host.replace(group_ids=np.where(host.attention_mask, groups[:, None], -1))
    values = np.random.default_rng(1).normal(size=host.shape).astype(np.float32)
    grouped = CFG.replace(critic=CriticSection(gamma=1.0, lam=1.0, whiten="group"))
    gae = jax.jit(with_gae, static_argnames="cfg")
    out = gae(jax.device_put(host), values, cfg=grouped)
    adv, mask = np.asarray(out.advantages), host.loss_mask
    for g in range(4):
        tokens = adv[groups == g][mask[groups == g]]
        np.testing.assert_allclose([tokens.mean(), tokens.std()], [0.0, 1.0], atol=1e-4)
    assert np.all(adv[~mask] == 0)
    rows = [4, 5, 0, 1]  # groups 2 and 0, in another order and padding
    part = _host_batch(rows, rewards)
    part_groups = np.array([2, 2, 0, 0, -1, -1, -1, -1], np.int32)
    part = part.replace(group_ids=np.where(part.attention_mask, part_groups[:, None], -1))
    part_values = np.zeros_like(values)
    part_values[:4] = values[rows]
    got = np.asarray(gae(jax.device_put(part), part_values, cfg=grouped).advantages)
    np.testing.assert_allclose(got[:4], adv[rows], atol=1e-5)
    # The helper alone: ids need only be unique, not dense.
    dense_ids = np.broadcast_to(groups[:, None], mask.shape)
    sparse = jax.jit(group_whiten)(values, mask, dense_ids * 7 + 3)
    np.testing.assert_allclose(
        np.asarray(sparse), np.asarray(jax.jit(group_whiten)(values, mask, dense_ids)), atol=1e-6
    )
