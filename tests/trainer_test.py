"""Trainer step properties: streamed accumulation is exact, FSDP matches one device,
compilations are bounded by the buckets, zero advantage gives zero gradient, a NaN/Inf
step leaves the state unchanged, the hot loop runs under
`jax.transfer_guard("disallow")`, and shared-prompt / packed rows train exactly like one
sample per row (every advantage estimator, GAE with the critic, every aggregation).

Tolerances (float32). Gradients: splitting a batch into micro-batches only
changes the order of float32 sums. Measured max |diff| / max |g| (max |g| ~ 0.11):
<= 2.0e-7 for any split/order on one device, 4.0e-7 for the fsdp=4 x tp=2 mesh
against one device (sharded reductions). Asserted: 2e-6 and 4e-6 of max |g|.
Parameters after AdamW: Adam divides each gradient element by its own
magnitude, so an element whose gradient is tiny amplifies the summation
rounding; the bound is in units of the step size lr = 1e-3. Measured max |diff|
2.0e-6 (one step, splits) and 9.6e-6 (two steps, FSDP/TP); asserted 1e-2 * lr
and 5e-2 * lr. Because Adam is scale invariant, the normaliser used by `apply`
is checked separately through its reported `grad_norm` (rtol 1e-5).

Shared-prompt and packed rows against one sample per row: the same sums in another
order and the same attention with masked pairs added as exact zeros. Measured over
every estimator, aggregation and layout: max |diff| / max |g| <= 5.4e-7 (policy and
critic), loss relative difference <= 2.9e-6; asserted 2e-6 of max |g|, loss rtol 1e-5,
GAE targets atol 1e-5.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from streamrl_jax import algorithms
from streamrl_jax import config as config_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.config import AlgorithmSection, CriticSection, OptimizerSection
from streamrl_jax.model import config as model_config
from streamrl_jax.trainer import (
    TrainerConfig,
    critic_trainer_config,
    lr_schedule,
    make_batch,
    make_critic_trainer,
    make_policy_trainer,
    trainer_config,
)
from streamrl_jax.trainer.batch import abstract_batch

LR = 1e-3
N_SAMPLES = 8
CFG = TrainerConfig(
    algorithm=AlgorithmSection(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, dual_clip=0.0),
    optimizer=OptimizerSection(learning_rate=LR, max_grad_norm=0.0),
    seq_buckets=(32,),
    batch_buckets=(4, 8),
)


def _samples(n: int = N_SAMPLES, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, rng.integers(1, 8)) for _ in range(n)]
    responses = [rng.integers(0, 256, rng.integers(1, 12)) for _ in range(n)]
    behaviour = [rng.normal(-5.0, 0.3, len(r)).astype(np.float32) for r in responses]
    return dict(
        prompts=prompts,
        responses=responses,
        behaviour_logp=behaviour,
        old_logp=[b + rng.normal(0, 0.1, len(b)).astype(np.float32) for b in behaviour],
        ref_logp=[b + rng.normal(0, 0.1, len(b)).astype(np.float32) for b in behaviour],
        advantages=rng.normal(size=n).astype(np.float32),
    )


def _subset(samples: dict, idx) -> dict:
    return {
        k: [v[i] for i in idx] if isinstance(v, list) else v[np.asarray(idx)]
        for k, v in samples.items()
    }


def _host(tree):
    """Copies to host numpy (the device buffers may be donated afterwards)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _max_abs(tree) -> float:
    return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))


def _global_norm(tree) -> float:
    return float(
        np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in jax.tree.leaves(tree)))
    )


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.fixture(scope="module")
def single():
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    return make_policy_trainer(model_config.tiny(), CFG, mesh)


def _one_step(trainer, samples, splits, *, normalizer=None, steps=1):
    """Accumulates `splits` (lists of sample indices) and applies; returns host results."""
    state = trainer.init_state(0)
    grads = None
    for _ in range(steps):
        acc = trainer.init_accumulator()
        for idx in splits:
            host = make_batch(
                **_subset(samples, idx),
                seq_buckets=trainer.cfg.seq_buckets,
                batch_buckets=trainer.cfg.batch_buckets,
            )
            norm = trainer.scalar(1.0 if normalizer is None else normalizer)
            acc, _ = trainer.accumulate(state, acc, trainer.place_batch(host), norm)
        if grads is None:
            total = float(acc.normalizer_sum) if normalizer is None else 1.0
            grads = jax.tree.map(lambda g, t=total: g / t, _host(acc.grads))
        if normalizer is None:
            state, acc, metrics = trainer.apply(state, acc)
        else:
            state, acc, metrics = trainer.apply(state, acc, trainer.scalar(1.0))
    return grads, _host(state.params), jax.device_get(metrics)


@pytest.mark.parametrize("normalizer_known", [False, True])
def test_any_split_any_order_equals_whole_batch(single, normalizer_known):
    samples = _samples()
    # N unknown ahead (token_mean while streaming): accumulate with 1, then `apply`
    # divides by the summed normalizer parts. N known ahead: pass it to every micro-batch.
    n_tokens = float(sum(len(r) for r in samples["responses"]))
    normalizer = n_tokens if normalizer_known else None
    g_whole, p_whole, m_whole = _one_step(
        single, samples, [list(range(N_SAMPLES))], normalizer=normalizer
    )
    g_scale = _max_abs(g_whole)
    assert g_scale > 0
    rng = np.random.default_rng(1)
    for _ in range(3):
        perm = rng.permutation(N_SAMPLES)
        cuts = np.sort(rng.choice(np.arange(1, N_SAMPLES), size=rng.integers(1, 4), replace=False))
        splits = [list(s) for s in np.split(perm, cuts)]
        g, p, m = _one_step(single, samples, splits, normalizer=normalizer)
        assert _max_diff(g, g_whole) <= 2e-6 * g_scale, splits
        assert _max_diff(p, p_whole) <= 1e-2 * LR, splits
        np.testing.assert_allclose(m["loss"], m_whole["loss"], rtol=1e-5)
        np.testing.assert_allclose(m["num_tokens"], n_tokens)
        # apply's own normalisation: Adam is scale invariant, so check the gradient norm.
        np.testing.assert_allclose(m["grad_norm"], _global_norm(g_whole), rtol=1e-5)
    # The step moved the parameters by about lr (so the comparison above is not vacuous).
    p_init = _host(single.init_state(0).params)
    assert _max_diff(p_whole, p_init) > 0.5 * LR


@pytest.fixture(scope="module")
def single_two_steps(single):
    """Two whole-batch steps on one device: the reference of the sharded meshes' tests."""
    return _one_step(single, _samples(), [list(range(N_SAMPLES))], steps=2)


@pytest.mark.parametrize(
    "sequence_parallel",
    # -m extended (the suite's budget): the plain fsdp x tp run. The default case trains
    # on the same mesh with the residual stream also sequence-sharded over tp between
    # blocks (the same parameter and optimizer shardings, the same comparison); the plain
    # sharded forward is sharding_test's test_sharded_forward_equals_unsharded.
    [True, pytest.param(False, marks=pytest.mark.extended)],
)
def test_fsdp_tp_mesh_matches_single_device(single_two_steps, sequence_parallel):
    # With the residual stream sequence-sharded over tp between blocks
    # (`model.sequence_parallel`): the same sums in another order. Measured against one
    # device: max |diff| / max |g| 6.6e-7, params 7.7e-3 lr (the plain mesh's bounds hold).
    mesh8 = _mesh8()
    assert dict(mesh8.shape) == {"fsdp": 4, "tp": 2}
    cfg = model_config.tiny(sequence_parallel=sequence_parallel)
    sharded = make_policy_trainer(cfg, CFG, mesh8)
    state = sharded.init_state(0)
    assert state.params["embed"].value.sharding.spec == P("tp", "fsdp")
    assert state.params["layers"]["q"].value.sharding.spec == P(None, "fsdp", "tp", None)
    adam = state.opt_state[0]
    assert adam.mu["layers"]["q"].value.sharding.spec == P(None, "fsdp", "tp", None)
    shard_shape = state.params["layers"]["gate"].value.addressable_shards[0].data.shape
    assert shard_shape == (2, 64 // 4, 128 // 2)  # never materialised unsharded
    g1, p1, m1 = single_two_steps
    g8, p8, m8 = _one_step(sharded, _samples(), [list(range(N_SAMPLES))], steps=2)
    assert _max_diff(g8, g1) <= 4e-6 * _max_abs(g1)
    assert _max_diff(p8, p1) <= 5e-2 * LR
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    if sequence_parallel:  # ... and it is the step that pins it: the trainer traces with
        # the activation layout (lowered only, not compiled)
        plain = make_policy_trainer(model_config.tiny(), CFG, mesh8)
        assert _constraints(sharded) >= _constraints(plain) + 5  # a block's five, at least


def _constraints(trainer) -> int:
    """`sharding_constraint`s in the lowered `accumulate` of a 8 x 32 micro-batch."""
    state, acc = jax.eval_shape(trainer._init, 0), jax.eval_shape(trainer._init_acc)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=trainer.batch_sharding),
        abstract_batch(8, 32),
    )
    normalizer = jax.ShapeDtypeStruct((), jnp.float32)
    return (
        trainer._accumulate.lower(state, acc, batch, normalizer)
        .as_text()
        .count("sharding_constraint")
    )


def test_compilations_bounded_by_buckets(single):
    state = single.init_state(0)
    acc = single.init_accumulator()
    rng = np.random.default_rng(2)
    shapes = set()
    for n in range(1, 9):
        samples = _samples(n, seed=n)
        samples["responses"] = [r[: rng.integers(1, 12)] for r in samples["responses"]]
        samples["behaviour_logp"] = [
            b[: len(r)]
            for b, r in zip(samples["behaviour_logp"], samples["responses"], strict=True)
        ]
        samples["old_logp"] = samples["ref_logp"] = samples["behaviour_logp"]
        host = make_batch(**samples, seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
        shapes.add(host.shape)
        batch = single.place_batch(host)
        acc, _ = single.accumulate(state, acc, batch, single.scalar(1.0))
        single.logprobs(state.params, batch)
    state, acc, _ = single.apply(state, acc)
    assert len(shapes) > 1
    limit = len(CFG.seq_buckets) * len(CFG.batch_buckets)
    assert single._accumulate._cache_size() <= limit
    assert single._forward._cache_size() <= limit
    assert single._apply_acc._cache_size() == 1
    # The static half of every jitted step is one hashable spec (jit's static argument).
    assert hash(single.spec) == hash(dataclasses.replace(single.spec))


def test_programs_compile_ahead_of_time_to_the_steps_the_trainer_runs(single):
    # `Trainer.programs`: what the pod planner compiles for a pod that is not attached. Its
    # abstract arguments are the placed ones (an AOT executable refuses any other
    # sharding or shape) and its executables compute what `accumulate` / `apply` do.
    programs = single.programs(8, 32)
    assert set(programs) == {"init", "accumulate", "apply"}
    state = single.init_state(0)
    host = make_batch(**_samples(), seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
    batch, one = single.place_batch(host), single.scalar(1.0)
    placed = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)
    _, abstract_acc, abstract_batch_, _ = programs["accumulate"].args
    assert placed(programs["accumulate"].args[0]) == placed(state)
    assert placed(abstract_acc) == placed(single.init_accumulator())
    assert placed(abstract_batch_) == placed(batch)
    accumulate = programs["accumulate"].lower().compile()
    want_acc, want_m = single.accumulate(state, single.init_accumulator(), batch, one)
    got_acc, got_m = accumulate(state, single.init_accumulator(), batch, one)
    assert _max_diff(got_acc.grads, want_acc.grads) == 0.0
    assert jax.device_get(got_m) == jax.device_get(want_m)
    apply = programs["apply"].lower().compile()
    got_state, _, _ = apply(single.init_state(0), got_acc, one)
    want_state, _, _ = single.apply(single.init_state(0), want_acc, one)
    assert _max_diff(got_state.params, want_state.params) == 0.0
    init = programs["init"].lower().compile()
    seed = jax.device_put(np.int32(0), single.scalar_sharding)
    assert _max_diff(init(seed).params, state.params) == 0.0


def test_zero_advantage_gives_zero_policy_gradient(single):
    algorithm = dataclasses.replace(CFG.algorithm, kl_coef=0.0, entropy_coef=0.0)
    plain = make_policy_trainer(model_config.tiny(), CFG.replace(algorithm=algorithm), single.mesh)
    state = single.init_state(0)  # same structure and shardings as plain's state
    samples = _samples()
    samples["advantages"] = np.zeros(N_SAMPLES, np.float32)

    def grads(samples):
        host = make_batch(**samples, seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
        acc, _ = plain.accumulate(
            state, plain.init_accumulator(), plain.place_batch(host), plain.scalar(1.0)
        )
        return _host(acc.grads)

    assert _max_abs(grads(samples)) == 0.0  # exactly, through every layer and TIS
    samples["advantages"][0] = 1.0  # one non-zero advantage -> non-zero gradient
    assert _max_abs(grads(samples)) > 0.0


def test_hot_loop_under_transfer_guard(single):
    samples = _samples()
    hosts = [
        make_batch(
            **_subset(samples, idx), seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets
        )
        for idx in ([0, 1, 2], [3, 4, 5, 6, 7])
    ]
    state = single.init_state(0)
    acc = single.init_accumulator()
    one = single.scalar(1.0)
    for host in hosts:  # warm-up: compile every shape used below
        acc, _ = single.accumulate(state, acc, single.place_batch(host), one)
    state, acc, metrics = single.apply(state, acc)
    history = []
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            for host in hosts:
                batch = jax.device_put(host, single.batch_sharding)  # explicit transfer
                acc, _ = single.accumulate(state, acc, batch, one)
            previous = metrics
            state, acc, metrics = single.apply(state, acc)
            history.append(jax.device_get(previous))  # the step before: already done
    history.append(jax.device_get(metrics))
    assert int(jax.device_get(state.step)) == 4
    assert all(np.isfinite(h["loss"]) and h["num_micro_batches"] == 2 for h in history)
    assert history[0]["num_tokens"] == sum(int(h.loss_mask.sum()) for h in hosts)


def test_reference_copy_survives_donation_and_bf16_compute(single):
    samples = _samples()
    host = make_batch(**samples, seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
    batch = single.place_batch(host)
    state = single.init_state(0)
    ref = single.copy_params(state.params)
    logp_before = np.asarray(single.logprobs(state.params, batch))
    acc, _ = single.accumulate(state, single.init_accumulator(), batch, single.scalar(1.0))
    state, _, _ = single.apply(state, acc)  # donates the old state
    np.testing.assert_array_equal(np.asarray(single.logprobs(ref, batch)), logp_before)
    assert not np.array_equal(np.asarray(single.logprobs(state.params, batch)), logp_before)

    # bf16 compute, float32 master weights: the same float32 params run through a
    # model whose compute dtype is bfloat16.
    bf16 = make_policy_trainer(model_config.tiny(dtype="bfloat16"), CFG, single.mesh)
    params = single.init_state(0).params
    logp_bf16 = np.asarray(bf16.logprobs(params, batch))
    mask = host.loss_mask
    np.testing.assert_allclose(logp_bf16[mask], logp_before[mask], rtol=2e-2)
    assert not np.array_equal(logp_bf16[mask], logp_before[mask])  # really computed in bf16
    state_shape = jax.eval_shape(bf16.init_state)
    acc_shape, _ = jax.eval_shape(
        bf16.accumulate, state_shape, bf16.init_accumulator(), batch, bf16.scalar(1.0)
    )
    for tree in (state_shape.params, state_shape.opt_state, acc_shape.grads):
        assert {x.dtype for x in jax.tree.leaves(tree)} <= {
            jnp.dtype(jnp.float32),
            jnp.dtype(jnp.int32),
        }


def test_nonfinite_step_leaves_state_unchanged(single):
    samples = _samples()
    bad = _subset(samples, range(N_SAMPLES))
    bad["advantages"][0] = np.nan
    one = single.scalar(1.0)

    def accumulate(state, samples):
        host = make_batch(**samples, seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
        return single.accumulate(state, single.init_accumulator(), single.place_batch(host), one)[0]

    def snapshot(state):  # host copies: `apply` donates the state
        return _host((state.params, state.opt_state, state.step))

    state = single.init_state(0)
    state, _, _ = single.apply(state, accumulate(state, samples))  # non-zero Adam moments
    # NaN loss and gradients (path `_apply_acc`); Inf gradients from a zero
    # normalizer (path `_apply`, normalizer given).
    for bad_samples, normalizer in ((bad, None), (samples, single.scalar(0.0))):
        before = snapshot(state)
        state, acc, metrics = single.apply(state, accumulate(state, bad_samples), normalizer)
        metrics = jax.device_get(metrics)
        assert metrics["nonfinite"] == 1.0
        assert not np.isfinite(metrics["grad_norm"])
        after = snapshot(state)
        assert jax.tree.structure(after) == jax.tree.structure(before)
        for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(x, y)  # bit for bit, `step` included
        zero = single.init_accumulator()
        assert jax.tree.structure(acc) == jax.tree.structure(zero)
        assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(acc))  # zeroed
        # The next finite batch trains normally.
        before = snapshot(state)
        state, acc, metrics = single.apply(state, accumulate(state, samples))
        assert jax.device_get(metrics)["nonfinite"] == 0.0
        after = snapshot(state)
        assert _max_diff(after[0], before[0]) > 0.5 * LR
        assert int(after[2]) == int(before[2]) + 1
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after[:2]))


def test_lr_schedule_and_config_errors():
    optimizer = OptimizerSection(learning_rate=1.0, warmup_steps=4, schedule="cosine")
    cfg = TrainerConfig(optimizer=optimizer, total_steps=14)
    lr = jax.jit(lr_schedule(cfg))
    got = [float(lr(jnp.int32(s))) for s in (0, 3, 4, 9, 14, 20)]
    np.testing.assert_allclose(got, [0.25, 1.0, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1], rtol=1e-6)
    with pytest.raises(ValueError, match="algorithm.policy_loss='nope'"):
        TrainerConfig(algorithm=AlgorithmSection(policy_loss="nope"))
    with pytest.raises(ValueError, match="nonfinite"):
        TrainerConfig(nonfinite="ignore")
    assert TrainerConfig(nonfinite="stop").nonfinite == "stop"
    with pytest.raises(ValueError, match="seq_buckets"):
        TrainerConfig(seq_buckets=(64, 32))
    mesh8 = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True)).train
    with pytest.raises(ValueError, match="batch_buckets"):
        make_policy_trainer(model_config.tiny(), CFG.replace(batch_buckets=(4, 6)), mesh8)


def test_trainer_config_holds_the_users_sections():
    cd = config_lib.defaults()
    cd.model.max_context = 300
    cd.pipeline.update(steps=5, mini_batches=2, micro_batch_groups=3, group_size=4)
    cd.algorithm.update(dual_clip=0.0, tis_cap=0.0, clip_eps=0.1, clip_eps_high=0.3)
    cd.optimizer.update(max_grad_norm=0.0, learning_rate=2e-6)
    cd.critic.learning_rate = 5e-5
    cd.trainer.update(shared_prompt=False, pack=False)  # one sample per row
    cfg = config_lib.from_config_dict(cd)
    tc = trainer_config(cfg, fsdp=4)
    assert tc.algorithm is cfg.algorithm and tc.optimizer is cfg.optimizer
    assert tc.critic is cfg.critic and tc.trainer is cfg.trainer and tc.total_steps == 10
    assert tc.seq_buckets == (64, 128, 256, 300)
    assert tc.batch_buckets == (8, 12) and all(b % 4 == 0 for b in tc.batch_buckets)
    # The layout reaches make_batch (through pipeline/micro_batches.py) in one place.
    assert tc.layout == {
        "seq_buckets": tc.seq_buckets,
        "batch_buckets": tc.batch_buckets,
        "shared_prompt": False,
        "pack": False,
        "loss_chunk": tc.logprob_chunk,
        "routing_replay": None,
    }
    # Shared-prompt rows (the default): rows up to the longest group,
    # max_prompt_len - 1 + group_size * (max_new_tokens + 1) = 127 + 4 * 129 = 643, in
    # steps of 1.5x and 2x; from 1 row (a multiple of fsdp) up to one sample per row.
    cd.trainer.update(shared_prompt=True, pack=True)
    shared = trainer_config(config_lib.from_config_dict(cd), fsdp=4)
    assert shared.layout["shared_prompt"] and shared.layout["pack"]
    assert shared.seq_buckets == (64, 96, 128, 192, 256, 384, 512, 643)
    assert shared.batch_buckets == (4, 8, 12)
    cd.pipeline.group_size = 16  # the longest group (2191) is over the auto cap
    assert trainer_config(config_lib.from_config_dict(cd), fsdp=4).seq_buckets[-1] == 1024
    cd.trainer.row_tokens = 400
    assert trainer_config(config_lib.from_config_dict(cd), fsdp=4).seq_buckets[-1] == 400
    cd.trainer.update(shared_prompt=False, row_tokens=0)  # packing samples: max_context
    assert trainer_config(config_lib.from_config_dict(cd), fsdp=1).seq_buckets[-1] == 300
    # 0 = off, and clip_eps_high only for dapo: read in one place.
    assert (tc.dual_clip_c, tc.tis_cap, tc.max_grad_norm) == (None, None, None)
    assert tc.policy_options == {"clip_eps_low": 0.1, "clip_eps_high": 0.1, "dual_clip_c": None}
    dapo = tc.replace(algorithm=dataclasses.replace(cfg.algorithm, policy_loss="dapo"))
    assert dapo.policy_options["clip_eps_high"] == 0.3
    assert make_policy_trainer(model_config.tiny(), tc, _mesh8()).cfg is tc
    critic = critic_trainer_config(cfg, fsdp=4)
    assert critic.optimizer == dataclasses.replace(cfg.optimizer, learning_rate=5e-5)
    assert critic.replace(optimizer=cfg.optimizer) == tc
    # A bad field is reported under the user's name, however the config was built.
    with pytest.raises(ValueError, match="algorithm.aggregation='mean'; expected one of"):
        TrainerConfig(algorithm=AlgorithmSection(aggregation="mean"))
    with pytest.raises(ValueError, match="optimizer.warmup_steps .20. must be below"):
        TrainerConfig(optimizer=OptimizerSection(schedule="cosine", warmup_steps=20), total_steps=8)


def _mesh8():  # fsdp 4 x tp 2
    return mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True, train_tp=2)).train


LAYOUTS = {"shared": (True, False), "shared+packed": (True, True), "packed": (False, True)}


def _groups(num_groups: int = 3, size: int = 4, seed: int = 4) -> dict:
    """GRPO groups: `size` samples of one prompt each, responses of 2..11 tokens (so
    `_by_sequence` can tell them apart) and one empty response."""
    rng = np.random.default_rng(seed)
    n = num_groups * size
    prompts = [p for p in (rng.integers(0, 256, rng.integers(1, 8)) for _ in range(num_groups))]
    samples = _samples(n, seed)
    samples["prompts"] = [prompts[i // size] for i in range(n)]
    samples["responses"][1] = samples["responses"][1][:0]
    for k in ("behaviour_logp", "old_logp", "ref_logp"):
        samples[k] = [x[: len(r)] for x, r in zip(samples[k], samples["responses"], strict=True)]
    samples["group_ids"] = np.repeat(np.arange(num_groups), size).astype(np.int32)
    samples["rewards"] = rng.integers(0, 2, n).astype(np.float32)
    return samples


def _by_sequence(batch, x) -> dict:
    """{response tokens: x at that response's loss columns} of a host batch."""
    out = {}
    for row in range(batch.shape[0]):
        for k in set(batch.segment_ids[row][batch.loss_mask[row]]):
            cols = np.flatnonzero((batch.segment_ids[row] == k) & batch.loss_mask[row])
            out[tuple(batch.tokens[row, cols + 1])] = np.asarray(x)[row, cols]
    return out


def _rows(batch) -> int:
    """The rows of a host batch that hold a unit."""
    return int(batch.attention_mask.any(axis=1).sum())


def _assert_same_gradients(acc, m, want_acc, want_m):
    scale = _max_abs(want_acc.grads)
    assert scale > 0
    assert _max_diff(acc.grads, want_acc.grads) <= 2e-6 * scale
    np.testing.assert_allclose(m["loss"], want_m["loss"], rtol=1e-5)
    np.testing.assert_allclose(acc.normalizer_sum, want_acc.normalizer_sum, rtol=1e-6)


@pytest.mark.parametrize(
    "aggregation",
    # token_mean by default (the suite's budget); the sequence-mean ones with -m extended
    [a if a == "token_mean" else pytest.param(a, marks=pytest.mark.extended)
     for a in algorithms.AGGREGATIONS],
)  # fmt: skip
def test_shared_prompt_and_packing_equal_per_sample_training(aggregation):
    """For every advantage estimator (outcome ones from the group's rewards; GAE from a
    critic on each layout) and this aggregation: the policy's loss and gradients, the
    critic's, and the GAE targets of shared-prompt / packed rows equal one sample per row."""
    algorithm = dataclasses.replace(CFG.algorithm, aggregation=aggregation)
    critic_section = CriticSection(gamma=0.9, lam=0.8, value_clip=0.2, whiten="group")
    # Two batch shapes, so each program (the policy's and the critic's accumulate, the GAE
    # fill) compiles twice: one sample per row (the reference) and the packed samples in
    # [16, 32], every column projected; the shared-prompt layouts in [16, 256], only their
    # loss columns (fewer than 128 a row) projected, in one 128-wide chunk.
    cfg = CFG.replace(
        algorithm=algorithm,
        critic=critic_section,
        seq_buckets=(32, 256),
        batch_buckets=(16,),
    )
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    policy = make_policy_trainer(model_config.tiny(), cfg, mesh)
    critic = make_critic_trainer(model_config.tiny(), cfg, mesh)
    state = policy.init_state(0)
    rng = np.random.default_rng(0)  # a random value head too, so the values matter
    params = jax.device_get(critic.init_state(0).params)
    noisy = jax.tree.map(lambda x: x + np.float32(0.05) * rng.standard_normal(x.shape), params)
    cstate = critic.state_from_params(jax.device_put(noisy, critic.state_shardings.params))
    samples = _groups()
    one = policy.scalar(1.0)

    def run(trainer, st, batch):
        acc, m = trainer.accumulate(st, trainer.init_accumulator(), batch, one)
        return jax.device_get(acc), jax.device_get(m), jax.device_get(batch)

    layouts = {"plain": (False, False), **LAYOUTS}
    for estimator in (*algorithms.ADVANTAGES, *algorithms.CRITIC_ADVANTAGES):
        if estimator == "gae":
            adv = None  # the critic fills them on the device
        else:
            ones = jax.device_put(np.ones((len(samples["rewards"]), 1), np.float32))
            fn = jax.jit(algorithms.ADVANTAGES[estimator])
            adv = fn(jax.device_put(samples["rewards"]), ones, jax.device_put(samples["group_ids"]))
            adv = np.asarray(jax.device_get(adv))[:, 0]
        results = {}
        for name, (shared, pack) in layouts.items():
            host = make_batch(
                **(samples | {"advantages": adv}),
                seq_buckets=cfg.seq_buckets,
                batch_buckets=cfg.batch_buckets,
                shared_prompt=shared,
                pack=pack,
                loss_chunk=128,
            )
            assert host.shape == ((16, 256) if shared else (16, 32)), name
            if estimator == "gae":  # the policy and the critic on one filled batch
                batch = critic.fill_gae(cstate.params, policy.place_batch(host))
                policy_out = run(policy, state, batch)
                critic_out = run(critic, cstate, batch)
                results[name] = (policy_out, critic_out, host)
            else:
                results[name] = (run(policy, state, policy.place_batch(host)), None, host)
        (want_acc, want_m, want_b), want_critic, want_host = results.pop("plain")
        assert want_host.loss_columns.shape == want_host.tokens.shape  # every column
        for name, ((acc, m, b), critic_out, host) in results.items():
            # Shared prompts train fewer tokens (and project only their loss columns);
            # either layout fills fewer rows.
            if LAYOUTS[name][0]:
                assert host.attention_mask.sum() < want_host.attention_mask.sum(), name
                assert host.loss_columns.size < host.tokens.size, name  # response-only
            assert _rows(host) < _rows(want_host) == 12, name
            _assert_same_gradients(acc, m, want_acc, want_m)
            if critic_out is not None:
                _assert_same_gradients(*critic_out[:2], *want_critic[:2])
                for field in ("advantages", "returns", "old_values"):
                    got = _by_sequence(host, getattr(b, field))
                    want = _by_sequence(want_host, getattr(want_b, field))
                    assert got.keys() == want.keys()
                    for key, value in want.items():
                        np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=field)


def test_a_packed_micro_batch_trains_its_groups_and_nothing_else(single):
    """Streaming stays exact: the gradient of a micro-batch that packs groups A and B into
    shared rows is the sum of A's and B's gradients alone (token sums, N = 1)."""
    samples = _groups(num_groups=4, size=2)
    state = single.init_state(0)
    one = single.scalar(1.0)
    kw = dict(seq_buckets=(32, 64), batch_buckets=(4, 8), shared_prompt=True, pack=True)

    def grads(idx):
        host = make_batch(**_subset(samples, idx), **kw)
        acc, _ = single.accumulate(state, single.init_accumulator(), single.place_batch(host), one)
        return _host(acc.grads), host

    together, host = grads(range(8))
    assert host.attention_mask.any(axis=1).sum() < 4  # several groups share a row
    parts = [grads(idx)[0] for idx in ([0, 1, 4, 5], [2, 3, 6, 7])]
    summed = jax.tree.map(np.add, *parts)
    assert _max_diff(together, summed) <= 2e-6 * _max_abs(together)


def test_environment_tokens_are_never_trained(single):
    """Episodes: the tokens an environment appended (policy mask False) get loss mask 0.
    A one-turn episode (mask all True) is today's single-turn sample, bitwise; whatever
    the masked tokens' log-probs and advantages are, the gradient is the same; with every
    token masked it is exactly zero."""
    state, one = single.init_state(0), single.scalar(1.0)
    kw = dict(seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
    samples = _samples(seed=3)
    rng = np.random.default_rng(4)
    samples["advantages"] = [
        rng.normal(size=len(r)).astype(np.float32) for r in samples["responses"]
    ]

    def grads(fields, masks):
        host = make_batch(**fields, policy_masks=masks, **kw)
        acc, _ = single.accumulate(state, single.init_accumulator(), single.place_batch(host), one)
        return _host(acc.grads), host

    plain, plain_host = grads(samples, None)
    one_turn, one_turn_host = grads(samples, [np.ones(len(r), bool) for r in samples["responses"]])
    jax.tree.map(np.testing.assert_array_equal, plain_host, one_turn_host)
    assert _max_diff(plain, one_turn) == 0.0

    masks = []
    for r in samples["responses"]:  # the middle third of each response: environment tokens
        m = np.ones(len(r), bool)
        m[len(r) // 3 : 2 * len(r) // 3] = False
        masks.append(m)
    masked, host = grads(samples, masks)
    assert host.loss_mask.sum() == sum(int(m.sum()) for m in masks)
    garbage = {k: v for k, v in samples.items()}
    for name in ("behaviour_logp", "old_logp", "ref_logp", "advantages"):
        garbage[name] = [
            np.where(m, x, rng.normal(-3.0, 5.0, len(x))).astype(np.float32)
            for x, m in zip(samples[name], masks, strict=True)
        ]
    assert _max_diff(masked, grads(garbage, masks)[0]) == 0.0
    assert _max_diff(masked, plain) > 0.0  # the masked tokens were trained before
    none = [np.zeros(len(r), bool) for r in samples["responses"]]
    assert _max_abs(grads(samples, none)[0]) == 0.0


MOE = model_config.tiny(num_experts=4, experts_per_token=2, moe_intermediate_size=32)


# -m extended (the suite's budget): tests/routing_replay_test.py's row-layout test gives
# the same claim by default, its routes replayed; this one lets the trainer route.
@pytest.mark.extended
def test_a_moe_trains_shared_prompt_and_packed_rows_as_one_sample_per_row():
    """Mixture of experts: routing is per token, so shared-prompt and packed rows give the
    per-sample loss and gradients (the router's and the experts' included)."""
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    cfg = CFG.replace(seq_buckets=(32, 64, 128), batch_buckets=(1, 2, 4, 8, 16))
    policy = make_policy_trainer(MOE, cfg, mesh)
    state = policy.init_state(0)
    samples = _groups()
    ones = jax.device_put(np.ones((len(samples["rewards"]), 1), np.float32))
    adv = algorithms.ADVANTAGES["grpo"](
        jax.device_put(samples["rewards"]), ones, jax.device_put(samples["group_ids"])
    )
    adv = np.asarray(jax.device_get(adv))[:, 0]
    out = {}
    for name, (shared, pack) in {"plain": (False, False), **LAYOUTS}.items():
        host = make_batch(
            **(samples | {"advantages": adv}), seq_buckets=cfg.seq_buckets,
            batch_buckets=cfg.batch_buckets, shared_prompt=shared, pack=pack,
            loss_chunk=128 if name == "plain" else 8,
        )  # fmt: skip
        acc, m = policy.accumulate(
            state, policy.init_accumulator(), policy.place_batch(host), policy.scalar(1.0)
        )
        out[name] = jax.device_get(acc), jax.device_get(m)
    want_acc, want_m = out.pop("plain")
    assert _max_abs(want_acc.grads["layers"]["experts_gate"]) > 0
    assert _max_abs(want_acc.grads["layers"]["router"]) > 0
    for acc, m in out.values():
        _assert_same_gradients(acc, m, want_acc, want_m)


@pytest.mark.extended  # the suite's budget (ragged_dot is dense on XLA:CPU)
def test_a_moe_on_an_expert_parallel_mesh_matches_one_device(single):
    mesh8 = _mesh8()
    sharded = make_policy_trainer(MOE, CFG, mesh8)
    one = make_policy_trainer(MOE, CFG, single.mesh)
    state = sharded.init_state(0)
    # the experts split over fsdp (expert parallelism), their width over tp
    assert state.params["layers"]["experts_gate"].value.sharding.spec == P(None, "fsdp", None, "tp")
    samples = _samples()
    whole = [list(range(N_SAMPLES))]
    g1, p1, m1 = _one_step(one, samples, whole, steps=2)
    g8, p8, m8 = _one_step(sharded, samples, whole, steps=2)
    assert _max_diff(g8, g1) <= 4e-6 * _max_abs(g1)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)


def test_the_routers_load_balancing_loss_is_added_with_its_coefficient(single):
    from streamrl_jax.errors import UserError
    from streamrl_jax.model import layers

    # balanced: every expert gets N k / X assignments and mean probability 1/X -> k
    n, k, x = 12.0, 2, 4
    stats = jnp.stack([jnp.full((x,), n * k / x), jnp.full((x,), n / x)])
    np.testing.assert_allclose(layers.router_aux_loss(stats, jnp.float32(n)), k, rtol=1e-6)
    coef = 0.5
    with_aux = CFG.replace(algorithm=dataclasses.replace(CFG.algorithm, router_aux_coef=coef))
    plain, aux = (make_policy_trainer(MOE, c, single.mesh) for c in (CFG, with_aux))
    state = plain.init_state(0)
    host = make_batch(**_samples(), seq_buckets=CFG.seq_buckets, batch_buckets=CFG.batch_buckets)
    out = {}
    for name, tr in (("plain", plain), ("aux", aux)):
        acc, m = tr.accumulate(state, tr.init_accumulator(), tr.place_batch(host), tr.scalar(1.0))
        out[name] = jax.device_get(acc), jax.device_get(m)
    (acc0, m0), (acc1, m1) = out["plain"], out["aux"]
    assert "router_aux" in m1 and float(m1["router_aux"]) >= k * 0.99  # >= k: balance is its floor
    np.testing.assert_allclose(m1["loss"], m0["loss"] + coef * m1["router_aux"], rtol=1e-5)
    assert _max_diff(acc1.grads["layers"]["router"], acc0.grads["layers"]["router"]) > 0
    with pytest.raises(UserError, match="router_aux_coef=0.5: the model has no experts"):
        make_policy_trainer(model_config.tiny(), with_aux, single.mesh)
