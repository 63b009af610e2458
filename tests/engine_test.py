"""Tests of the generation engine on a tiny random model (one CPU device)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import CFG, ENGINE, SAMPLED, assert_same, by_id, make_engine, requests

from streamrl_jax import mesh as mesh_lib
from streamrl_jax.generation import engine_config
from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.types import (
    Continuation,
    GenerationRequest,
    RequestTag,
    SamplingParams,
)


def test_greedy_matches_full_forward_reference(model):
    graphdef, params, _ = model
    s = ENGINE.max_total_length

    @jax.jit
    def full_logp(params, tokens_1xS, mask_1xS):
        m = nnx.merge(graphdef, params)
        return jax.nn.log_softmax(m.logits(m.hidden_states(tokens_1xS, mask_1xS)), axis=-1)

    reqs = requests(4, sampling=SamplingParams.greedy())
    got = by_id(make_engine(model).run(reqs))
    for r in reqs:
        seq = list(r.prompt)
        want_tokens, want_logp = [], []
        for _ in range(r.max_new_tokens):
            tokens = np.zeros((1, s), np.int32)
            tokens[0, : len(seq)] = seq
            mask = (np.arange(s) < len(seq))[None]
            logp = jax.device_get(full_logp(params, jnp.asarray(tokens), jnp.asarray(mask)))
            row = logp[0, len(seq) - 1]
            want_tokens.append(int(np.argmax(row)))
            want_logp.append(row[want_tokens[-1]])
            seq.append(want_tokens[-1])
        sample = got[r.request_id]
        np.testing.assert_array_equal(sample.response, want_tokens)
        np.testing.assert_allclose(sample.logprobs, want_logp, atol=1e-4)
        np.testing.assert_array_equal(sample.sampling_logprobs, 0.0)
        assert sample.finish_reason == "length"
        np.testing.assert_array_equal(sample.prompt, r.prompt)


def test_samples_independent_of_slot_batch_and_admission_time(model):
    reqs = requests(9)
    all_at_once = by_id(make_engine(model).run(reqs))
    alone = make_engine(model)  # each request alone in the batch, one after another
    one_at_a_time = by_id([s for r in reqs for s in alone.run([r])])
    assert_same(all_at_once, one_at_a_time)

    engine = make_engine(model)  # late arrivals land in slots freed mid-run
    engine.submit(reqs[:3])
    mid_run = engine.step() + engine.step()
    assert engine.num_running > 0
    mid_run += engine.run(reqs[3:][::-1])
    assert_same(all_at_once, by_id(mid_run))

    lpt = make_engine(model, admission="lpt")
    prioritised = [dataclasses.replace(r, priority=float(-i)) for i, r in enumerate(reqs)]
    assert_same(all_at_once, by_id(lpt.run(prioritised[::-1])))


def test_sampling_params_change_samples_and_seed_is_reproducible(model):
    reqs = requests(4)
    base = by_id(make_engine(model).run(reqs))
    reseeded = by_id(make_engine(model).run([dataclasses.replace(r, seed=7) for r in reqs]))
    assert any(not np.array_equal(base[i].response, reseeded[i].response) for i in base), (
        "a different seed should change some sample"
    )
    for s in base.values():
        assert np.all(s.sampling_logprobs <= 0) and np.all(s.logprobs <= 0)


def test_forced_lengths_are_exact_and_ignore_stop_ids(model):
    greedy = SamplingParams.greedy()
    probe = make_engine(model).run(requests(1, sampling=greedy, max_new_tokens=1))[0]
    stop = int(probe.response[0])  # the very first greedy token would stop the sample
    lengths = [1, 3, 17, 32]
    reqs = [
        dataclasses.replace(
            requests(1, sampling=SamplingParams.greedy(stop_ids=[stop]))[0],
            request_id=n,
            forced_length=n,
        )
        for n in lengths
    ]
    got = by_id(make_engine(model).run(reqs))
    for n in lengths:
        assert got[n].num_tokens == n and got[n].finish_reason == "forced"
    assert got[1].response[0] == stop


def test_stop_ids_end_the_sample_and_are_reported(model):
    greedy = requests(3, sampling=SamplingParams.greedy(), max_new_tokens=20)
    free = by_id(make_engine(model).run(greedy))
    stopped_reqs, expect = [], {}
    for r in greedy:
        tokens = free[r.request_id].response
        stop = int(tokens[5])
        first = int(np.argmax(tokens == stop))
        expect[r.request_id] = tokens[: first + 1]
        stopped_reqs.append(
            dataclasses.replace(r, sampling=SamplingParams.greedy(stop_ids=[stop, 255]))
        )
    got = by_id(make_engine(model).run(stopped_reqs))
    for rid, want in expect.items():
        np.testing.assert_array_equal(got[rid].response, want)
        assert got[rid].finish_reason == "stop"
    # Engine-wide default stop ids apply to requests that set none.
    r = greedy[0]
    default_stop = int(free[r.request_id].response[0])
    (sample,) = make_engine(model, stop_ids=(default_stop,)).run([r])
    assert sample.finish_reason == "stop" and sample.num_tokens == 1


def test_context_end(model):
    (r,) = requests(1, sampling=SamplingParams.greedy())
    r = dataclasses.replace(r, prompt=list(range(16)), max_new_tokens=1000)
    (sample,) = make_engine(model).run([r])
    assert sample.finish_reason == "context"
    assert len(sample.prompt) + sample.num_tokens == ENGINE.max_total_length


def test_update_weights_changes_outputs_without_recompiling(model):
    _, _, params2 = model
    reqs = requests(4, sampling=SamplingParams.greedy())
    engine = make_engine(model)
    before = by_id(engine.run(reqs))
    compiled = engine.compile_count()
    engine.update_weights(params2, version=3)
    after = by_id(engine.run(reqs))
    assert engine.compile_count() == compiled
    assert all(s.policy_version == 0 for s in before.values())
    assert all(s.policy_version == 3 == s.last_policy_version for s in after.values())
    assert any(not np.array_equal(before[i].response, after[i].response) for i in before)
    reference = by_id(make_engine((model[0], params2, None)).run(reqs))
    assert_same(after, reference)
    wrong = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params2)
    with pytest.raises(ValueError, match="update_weights"):
        engine.update_weights(wrong, version=4)


def _chunk_hlo(engine: Engine) -> str:
    idx = jnp.arange(engine.cfg.num_slots, dtype=jnp.int32)
    seq = engine.cfg.max_total_length
    lowered = engine._chunk.lower(engine._params, engine._state, idx, seq=seq)
    return lowered.compile().as_text()


def test_cpu_dots_picks_the_decode_matmul_library_and_keeps_the_samples(model):
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's matmul libraries")
    reqs = requests(6, sampling=SamplingParams.greedy())
    # Every slot decodes over the whole cache: the one chunk shape `_chunk_hlo` compiles
    # (the compacted decode's buckets are `test_decode_attention_forms_and_key_layouts...`'s)
    full = dict(decode_buckets=False)
    eigen = make_engine(model, cpu_dots="eigen", **full)
    ynn = make_engine(model, cpu_dots="ynnpack", **full)
    assert make_engine(model)._chunk is ynn._chunk  # "auto": the tiny model is narrow

    # The decode chunk's matmuls leave YNNPACK with "eigen" (its reductions may stay):
    # YNNPACK runs a dot inside a computation that a `__ynn_fusion` calls, XLA's emitter
    # as an op of its own.
    def dots(hlo):
        ynn = set(re.findall(r"calls=%?([\w.-]+).*__ynn_fusion", hlo))
        fused = total = 0
        for block in re.split(r"\n(?=\S)", hlo):  # computations start in column 0
            name = re.match(r"(?:ENTRY )?%?([\w.-]+)", block)
            n = sum(" dot(" in ln for ln in block.splitlines())
            total += n
            fused += n if name and name.group(1) in ynn else 0
        return fused, total

    fused, total = dots(_chunk_hlo(ynn))
    assert fused == total > 0
    # With "eigen" only YNNPACK's reduction fusions may take a dot in: the attention
    # output's sum over positions (`decode_attention="elementwise"`) with the `o`
    # projection it feeds, at most one per layer; every other matmul is XLA's own.
    fused, total = dots(_chunk_hlo(eigen))
    assert fused <= CFG.num_layers < total
    # Another library rounds differently: the same greedy tokens, log-probs within 1e-5.
    assert_same(by_id(eigen.run(reqs)), by_id(ynn.run(reqs)))
    # "auto" is Eigen from EIGEN_MIN_WIDTH on; int8 engines and other backends keep theirs.
    wide = engine_config.EIGEN_MIN_WIDTH
    assert ENGINE.decode_compiler_options("cpu", wide) == eigen.cfg.decode_compiler_options(
        "cpu", 64
    )
    assert ENGINE.decode_compiler_options("cpu", wide - 1) == ()
    assert ENGINE.decode_compiler_options("gpu", wide) == ()
    int8 = dataclasses.replace(ENGINE, cpu_dots="eigen", weight_dtype="int8")
    assert int8.decode_compiler_options("cpu", wide) == ()
    with pytest.raises(ValueError, match="EngineConfig.cpu_dots must be one of"):
        dataclasses.replace(ENGINE, cpu_dots="mkl")


# The off-CPU defaults (dot attention over keys [B, K, S, D], gate and up [2, E, M]) on a
# tensor-parallel instance of 2 (where such instances run; `_tp2_engine`, whose programs
# `test_gate_up_layouts_keep_the_samples` and `test_tensor_parallel_instance_matches_...`
# share) against the CPU defaults (elementwise over [B, K, D, S], [E, 2, M], one device)
# run by default; each change alone on one device (the dot form over either key layout,
# the elementwise form over [B, K, S, D]: no platform's default) is a further case of the
# same property, run with -m extended (each compiles every program of one more engine cold).
@pytest.mark.parametrize(
    "attention, layout, tp",
    [
        ("dot", "head_dim_minor", 2),
        pytest.param("dot", "head_dim_minor", 1, marks=pytest.mark.extended),
        pytest.param("dot", "positions_minor", 1, marks=pytest.mark.extended),
        pytest.param("elementwise", "head_dim_minor", 1, marks=pytest.mark.extended),
    ],
)
def test_decode_attention_forms_and_key_layouts_keep_the_samples(model, attention, layout, tp):
    """Elementwise attention (CPU's default) and the dot form, keys [B, K, D, S]
    (`key_layout="positions_minor"`, CPU's default) and [B, K, S, D] (`"head_dim_minor"`,
    "auto" off CPU) draw the same greedy and sampled tokens, log-probs within 1e-5, through
    every path of the cache: prefill, a shared prompt's fork, the decode chunk (the CPU
    defaults' in its compacted buckets, the other's over every slot: one decode shape to
    compile cold, as compacted and full decodes draw the same, `compact_test.py`), an
    episode's extension. "auto" is elementwise and positions-minor on CPU only. By
    default all the off-CPU forms at once, on a TP 2 instance (`tp`; the others on one
    device)."""
    rng = np.random.default_rng(3)
    base = make_engine(model)  # the CPU defaults
    forms = dict(decode_attention=attention, key_layout=layout)
    if tp == 2:
        other = _tp2_engine(model, **forms)
    else:
        other = make_engine(model, **forms, decode_buckets=False)
    assert base._chunk is not other._chunk
    assert other.decode_attention == attention
    assert base.decode_attention == ENGINE.attention(jax.default_backend()) == "elementwise"
    k = CFG.num_kv_heads, CFG.head_dim
    s = ENGINE.max_total_length
    assert base._state.cache.k[0].shape == (ENGINE.num_slots, *k, s)
    if layout == "head_dim_minor":
        assert other._state.cache.k[0].shape == (ENGINE.num_slots, *k[:1], s, k[1])
    greedy = requests(6, sampling=SamplingParams.greedy())
    assert_same(by_id(base.run(greedy)), by_id(other.run(greedy)))
    reqs = grouped_requests(4)
    assert_same(by_id(base.run(reqs)), by_id(other.run(reqs)))
    episodes = requests(3, seed=6, max_new_tokens=6, keep_kv=True)
    first = by_id(base.run(episodes))
    assert_same(first, by_id(other.run(episodes)))
    env = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (2, 5, 1)]
    turns = [
        GenerationRequest.next_turn(first[r.request_id], env[i], 4) for i, r in enumerate(episodes)
    ]
    assert_same(by_id(base.run(turns)), by_id(other.run(turns)))
    assert other.metrics()["extended"] == base.metrics()["extended"] == 3
    assert other.metrics()["forked"] > 0
    assert ENGINE.attention("cpu") == "elementwise"
    assert ENGINE.attention("gpu") == ENGINE.attention("tpu") == "dot"
    assert ENGINE.keys_positions_minor("cpu")
    assert not ENGINE.keys_positions_minor("tpu") and not ENGINE.keys_positions_minor("gpu")
    with pytest.raises(ValueError, match="EngineConfig.decode_attention must be one of"):
        dataclasses.replace(ENGINE, decode_attention="flash")
    with pytest.raises(ValueError, match="EngineConfig.key_layout must be one of"):
        dataclasses.replace(ENGINE, key_layout="sd")


def test_gate_up_layouts_keep_the_samples(model):
    """Gate and up as [2, E, M] (`gate_up_layout="parts_major"`, "auto" off CPU, where
    XLA:TPU would re-lay out [E, 2, M] every decode chunk) draw what [E, 2, M] draws: on
    one device and tensor-parallel over two (the mlp axis sharded; the TP 2 engine has
    the other off-CPU forms too, `OFF_CPU`, sharing the attention test's programs); with
    int8 weights in `test_int8_gate_up_layouts_keep_the_samples`."""
    reqs = grouped_requests(4)
    em = make_engine(model, gate_up_layout="embed_major")
    assert em._params["layers"][0]["gate_up"].shape[1] == 2
    want = by_id(em.run(reqs))
    pm = _tp2_engine(model, gate_up_layout="parts_major")
    w = pm._params["layers"][0]["gate_up"]
    assert w.shape == (2, CFG.hidden_size, CFG.intermediate_size)
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    assert_same(want, by_id(pm.run(reqs)))
    assert not ENGINE.gate_up_parts_major("cpu")
    assert ENGINE.gate_up_parts_major("tpu") and ENGINE.gate_up_parts_major("gpu")
    with pytest.raises(ValueError, match="EngineConfig.gate_up_layout must be one of"):
        dataclasses.replace(ENGINE, gate_up_layout="fused")


# Two more engines' programs compiled cold (int8 in each layout): an extra case of the
# layout test above, whose float32 forms run by default.
@pytest.mark.extended
def test_int8_gate_up_layouts_keep_the_samples(model):
    """With int8 weights, gate and up as [2, E, M] draw what [E, 2, M] draws."""
    reqs = grouped_requests(4)
    int8 = [
        make_engine(model, weight_dtype="int8", gate_up_layout=x)
        for x in engine_config.GATE_UP_LAYOUTS[1:]
    ]
    assert int8[1]._params["layers"][0]["gate_up"].scale.shape == (2, CFG.intermediate_size)
    assert_same(*(by_id(e.run(reqs)) for e in int8))


def test_hot_loop_runs_under_transfer_guard(model):
    engine = make_engine(model)
    engine.run(requests(2))  # warm-up: compiles outside the guard
    reqs = requests(6, seed=1)
    with jax.transfer_guard("disallow"):
        samples = engine.run(reqs)
    assert len(samples) == len(reqs)


def test_on_chunk_reports_every_round_trip(model):
    seen = []
    engine = make_engine(model, on_chunk=seen.append)
    samples = engine.run(requests(6, seed=2))
    assert seen and all(r.instance == "0" and r.t1 >= r.t0 for r in seen)
    assert sum(r.tokens for r in seen) == sum(len(s.response) for s in samples)
    assert max(r.running for r in seen) <= ENGINE.num_slots
    assert sum(r.prefilled for r in seen) == 6  # every request prefilled once
    assert all(0 <= r.steps <= ENGINE.chunk_steps for r in seen)
    # The longest sample's decode steps all ran in some chunk (its first token
    # comes from prefill).
    assert sum(r.steps for r in seen) >= max(len(s.response) for s in samples) - 1


def test_partial_tokens_are_reported_once_in_order_as_the_sample_holds_them(model):
    # Requests 0-2 ask for partial results (`on_tokens`), 3-5 do not: every token of an
    # asking request is reported once, in order, with its log-prob and version, each
    # report one round trip's; an episode's next turn reports from its history on.
    seen: dict[int, list] = {}
    reqs = requests(6, seed=4, max_new_tokens=20)
    reqs = [
        dataclasses.replace(r, on_tokens=seen.setdefault(r.request_id, []).append, keep_kv=True)
        if r.request_id < 3
        else r
        for r in reqs
    ]
    engine = make_engine(model)
    samples = by_id(engine.run(reqs))
    assert sorted(seen) == [0, 1, 2]
    chunks = 0
    for rid, deltas in seen.items():
        s = samples[rid]
        sizes = [len(d.tokens) for d in deltas]
        assert [d.start for d in deltas] == np.cumsum([0, *sizes])[:-1].tolist()
        assert all(0 < len(d.tokens) <= ENGINE.chunk_steps + 1 for d in deltas)
        np.testing.assert_array_equal(np.concatenate([d.tokens for d in deltas]), s.response)
        np.testing.assert_array_equal(np.concatenate([d.logprobs for d in deltas]), s.logprobs)
        np.testing.assert_array_equal(np.concatenate([d.versions for d in deltas]), s.versions())
        chunks += len(deltas)
    assert chunks > 3  # (some sample took more than one round trip)
    turn = GenerationRequest.next_turn(samples[0], [1, 2, 3], 5)
    after: list = []
    engine.run([dataclasses.replace(turn, on_tokens=after.append)])
    assert after[0].start == turn.history and all(d.request_id == 0 for d in after)


def test_tag_and_metadata_are_echoed(model):
    reqs = [
        dataclasses.replace(r, tag=RequestTag(batch=2, group=i, member=1), metadata={"i": i})
        for i, r in enumerate(requests(3))
    ]
    for s in make_engine(model).run(reqs):
        assert s.tag == RequestTag(batch=2, group=s.request_id, member=1)
        assert s.metadata == {"i": s.request_id}


def test_static_batching_waits_for_the_whole_batch(model):
    reqs = requests(8)
    engine = make_engine(model, refill=False)
    samples = engine.run(reqs)
    first, second = samples[:4], samples[4:]
    assert min(s.timings.admit for s in second) >= max(s.timings.finish for s in first)
    # Equal statics share the jitted functions: the continuous engine compiles nothing new.
    continuous = make_engine(model)
    assert continuous.compile_count() == engine.compile_count() > 0
    compiled = engine.compile_count()
    assert_same(by_id(samples), by_id(continuous.run(reqs)))
    assert continuous.compile_count() == compiled


def test_lpt_admits_longest_predicted_first(model):
    reqs = [dataclasses.replace(r, priority=float(i % 5)) for i, r in enumerate(requests(8))]
    samples = make_engine(model, admission="lpt", refill=False).run(reqs)
    # priorities [0, 1, 2, 3, 4, 0, 1, 2]: the top four, ties in submission order.
    assert {s.request_id for s in samples[:4]} == {4, 3, 2, 7}


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[1] * 17), "max_prompt_length"),
        (dict(prompt=[CFG.vocab_size]), "prompt has ids"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(forced_length=40), "forced_length"),
        (dict(sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (dict(sampling=SamplingParams(top_k=-2)), "top_k"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(stop_ids=(1, 2, 3, 4, 5))), "stop_ids"),
        (dict(sampling=SamplingParams(stop_ids=(-1,))), "stop_ids"),
        (dict(sampling=SamplingParams(stop_texts=("",))), "stop_texts"),
        (dict(sampling=SamplingParams(stop_texts=("x" * 257,))), "stop_texts"),
        (dict(sampling=SamplingParams(stop_texts=("a",) * 17)), "stop_texts"),
        # an engine without a detokenizer cannot read text
        (dict(sampling=SamplingParams(stop_texts=("a",))), "needs an engine built with a"),
    ],
)
def test_bad_requests_name_the_field(model, change, field):
    engine = make_engine(model)
    (r,) = requests(1)
    r = dataclasses.replace(r, **{"prompt": list(range(10)), **change})
    with pytest.raises(ValueError, match=field):
        engine.submit([r])
    assert engine.queue_length == 0


# Where tensor-parallel instances run (off CPU), "auto" picks these; the tests that build
# a TP 2 engine share its programs by default (one engine's compiles cold).
OFF_CPU = dict(decode_attention="dot", key_layout="head_dim_minor", gate_up_layout="parts_major")


def _tp2_engine(model, **overrides) -> Engine:
    """An engine on a generation instance of tensor parallelism 2 (2 generation, 1
    training device), configured as `ENGINE` with the off-CPU forms (`OFF_CPU`) and
    `overrides`, every slot decoding over the whole cache (one decode shape to compile:
    the buckets are the one-device tests')."""
    meshes = mesh_lib.make_meshes(
        mesh_lib.MeshConfig(generate_devices=2, train_devices=1, instance_tp=2)
    )
    (tp2,) = mesh_lib.instance_meshes(meshes.generate)
    cfg = dataclasses.replace(ENGINE, decode_buckets=False, **{**OFF_CPU, **overrides})
    return Engine(model[0], model[1], CFG, cfg, tp2)


# Parts-major gate and up (the layout "auto" picks off CPU, where tensor-parallel
# instances run) by default, sharing its programs with `test_gate_up_layouts_keep_the_samples`;
# the CPU's embed-major layout on two devices is a further case (-m extended).
@pytest.mark.parametrize(
    "gate_up", ["parts_major", pytest.param("embed_major", marks=pytest.mark.extended)]
)
def test_tensor_parallel_instance_matches_single_device(model, gate_up):
    if jax.device_count() < 3:
        pytest.skip("needs 3 devices (2 generation, 1 training)")
    engine = _tp2_engine(model, gate_up_layout=gate_up)
    assert engine._state.cache.k[0].sharding.spec[1] == "tp"  # KV heads split over the instance
    reqs = requests(4)
    got = by_id(engine.run(reqs))
    want = by_id(make_engine(model).run(reqs))
    for rid, s in want.items():
        np.testing.assert_array_equal(got[rid].response, s.response)
        np.testing.assert_allclose(got[rid].logprobs, s.logprobs, atol=1e-4)


def _full_forward_logprobs(graphdef, params, samples) -> list[np.ndarray]:
    """log p(response token t | prompt, earlier tokens) under `params`, one full forward
    of all `samples` at once: each padded with zeros to the cache length (the model is
    causal: a position never sees the padding after it), one jitted shape."""
    s = ENGINE.max_total_length
    seqs = [np.concatenate([x.prompt, x.response]) for x in samples]
    tokens = np.zeros((len(seqs), s), np.int32)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq

    @jax.jit
    def logprobs(params, tokens):
        model = nnx.merge(graphdef, params)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        return model.token_logprobs(inputs, targets, jnp.ones_like(inputs, jnp.float32))[0]

    logp = np.asarray(jax.device_get(logprobs(params, jnp.asarray(tokens))))
    return [
        logp[row, len(x.prompt) - 1 : len(seq) - 1]
        for row, (x, seq) in enumerate(zip(samples, seqs, strict=True))
    ]


def test_a_sample_spanning_two_versions_records_each_tokens_version_and_logprob(model):
    # In-flight update: new weights land at the next chunk boundary while samples run;
    # each token records the version that sampled it and the log-prob it was sampled
    # with. Tokens after the swap attend to a KV cache written partly by the old weights
    # (the slot is kept), so their behaviour log-prob is neither W_0's nor W_1's full
    # forward: only the recorded per-token value is the sampler's, which is why the
    # trainer's ratio divides by it.
    graphdef, params0, params1 = model
    reqs = requests(4, forced_length=20, max_new_tokens=20)

    def spanning_run():
        engine = make_engine(model)
        engine.submit(reqs)
        done = engine.step()  # prefill (1 token) + one chunk (4 tokens) under W_0
        engine.update_weights(params1, version=1)
        while engine.has_work():
            done += engine.step()
        return by_id(done)

    done, again = spanning_run(), spanning_run()
    only0 = by_id(make_engine(model).run(reqs))
    first = ENGINE.chunk_steps + 1
    assert len(done) == 4
    samples = list(done.values())
    under = dict(zip(done, _full_forward_logprobs(graphdef, params0, samples), strict=True))
    for i, s in done.items():
        np.testing.assert_array_equal(s.versions(), [0] * first + [1] * (20 - first))
        assert (s.policy_version, s.last_policy_version) == (0, 1)
        assert (s.oldest_version, s.newest_version) == (0, 1)
        # Before the swap: W_0's tokens and log-probs (its full forward, and a W_0-only run).
        under0 = under[i]
        np.testing.assert_allclose(s.logprobs[:first], under0[:first], atol=2e-4)
        np.testing.assert_array_equal(s.response[:first], only0[i].response[:first])
        # After it: the new weights sampled (W_0's log-probs no longer describe them) ...
        assert np.abs(s.logprobs[first:] - under0[first:]).max() > 1e-2
        # ... and the recorded log-probs are a function of the swap point only.
        np.testing.assert_array_equal(s.response, again[i].response)
        np.testing.assert_array_equal(s.logprobs, again[i].logprobs)


def test_a_paused_sample_continued_draws_what_the_uninterrupted_one_does(model):
    # Partial rollout: `segment_tokens` pauses a request; a request carrying the paused
    # sample's `Continuation` re-prefills prompt + response so far and samples on with
    # the same per-token keys. Under the same weights the result is the uninterrupted
    # sample (tokens; log-probs up to prefill-vs-decode float order).
    reqs = requests(6, seed=3)
    whole = by_id(make_engine(model).run(reqs))
    engine = make_engine(model)
    first = by_id(engine.run([dataclasses.replace(r, segment_tokens=5) for r in reqs]))
    paused = [s for s in first.values() if s.finish_reason == "paused"]
    assert paused and all(s.num_tokens == 5 for s in paused)
    for i, s in first.items():
        if s.finish_reason != "paused":  # finished within the segment: the same sample
            np.testing.assert_array_equal(s.response, whole[i].response)
    again = [
        dataclasses.replace(reqs[s.request_id], continuation=Continuation.of(s)) for s in paused
    ]
    compiled = engine.compile_count()
    for s in engine.run(again):
        ref = whole[s.request_id]
        assert s.finish_reason == ref.finish_reason != "paused"
        np.testing.assert_array_equal(s.response, ref.response)
        np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=2e-4)
        np.testing.assert_array_equal(s.versions(), np.zeros(s.num_tokens))
    assert engine.compile_count() > compiled  # prompt + response needs longer buckets
    bad = dataclasses.replace(reqs[0], continuation=Continuation.of(whole[0]))
    with pytest.raises(ValueError, match="leaves nothing to generate"):
        engine.validate(bad)


def grouped_requests(seed: int, lpt: bool = False) -> list[GenerationRequest]:
    """GRPO-style groups (one prompt, G seeds; G = 3, 1, 4, 2, 3) of prompt lengths in
    three buckets, members submitted interleaved rather than group by group."""
    rng = np.random.default_rng(seed)
    out = []
    for g, (size, n) in enumerate(zip((3, 1, 4, 2, 3), (3, 7, 12, 16, 5), strict=True)):
        prompt = rng.integers(0, CFG.vocab_size, size=n).tolist()
        for m in range(size):
            out.append(
                GenerationRequest(
                    request_id=f"{g}/{m}",
                    prompt=prompt,
                    max_new_tokens=int(rng.integers(1, 25)),
                    sampling=SAMPLED,
                    seed=1000 * seed + 10 * g + m,
                    priority=float(rng.integers(0, 3)) if lpt else 0.0,
                )
            )
    return [out[i] for i in rng.permutation(len(out))]


def assert_bitwise(a, b):
    """Bitwise on CPU. On an H200 a forked sample's first log-prob differed from the
    unshared prefill's in the last bit (a GEMM's kernel, and so its rounding, can depend
    on the row count): off CPU tokens and versions stay exact, log-probs within 1e-6."""
    exact = jax.default_backend() == "cpu"
    assert a.keys() == b.keys()
    for rid in a:
        for field in ("response", "logprobs", "sampling_logprobs", "token_versions"):
            x, y, msg = getattr(a[rid], field), getattr(b[rid], field), f"{rid} {field}"
            if exact or "logprobs" not in field:
                np.testing.assert_array_equal(x, y, err_msg=msg)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=msg)
        assert a[rid].finish_reason == b[rid].finish_reason


@pytest.mark.parametrize("admission", ["fifo", "lpt"])
def test_shared_prompt_prefill_is_bitwise_the_unshared_one(model, admission):
    # The members of a group prefill their prompt once (the rest fork its KV and logits,
    # within one admission and across later steps: 4 slots for groups of up to 4 admitted
    # interleaved); a continuation of a group's prompt is never shared.
    reqs = grouped_requests(7, lpt=admission == "lpt")
    paused = make_engine(model).run([dataclasses.replace(reqs[0], segment_tokens=2)])[0]
    cont = dataclasses.replace(
        reqs[0], request_id="continued", max_new_tokens=24, continuation=Continuation.of(paused)
    )
    reqs.insert(3, cont)
    kw = dict(min_bucket=8, admission=admission)  # prompt buckets 8 and 16
    prefilled = []
    off = make_engine(model, share_prefill=False, **kw)
    on = make_engine(model, on_chunk=lambda r: prefilled.append(r.prefilled), **kw)
    before = on.compile_count()
    assert_bitwise(by_id(off.run(reqs)), by_id(on.run(reqs)))
    m_on, m_off = on.metrics(), off.metrics()
    assert m_off["forked"] == 0 and m_off["prefill_rows"] == len(reqs)
    assert m_on["forked"] > 0 and m_on["prefill_rows"] + m_on["forked"] == len(reqs)
    assert m_on["prefill_rows"] >= 6  # 5 prompts and the continuation, at least once each
    assert sum(prefilled) == m_on["prefill_rows"]  # the observer counts prefills, not forks
    # Bounded compilation: one prefill per bucket (2 prompt buckets + the continuation's),
    # one fork, one chunk; new groups of the same buckets compile nothing.
    assert on.compile_count() - before <= 5
    compiled = on.compile_count()
    again = grouped_requests(8, lpt=admission == "lpt")
    assert_bitwise(by_id(off.run(again)), by_id(on.run(again)))
    assert on.compile_count() == compiled


def test_shared_prefill_never_forks_across_a_weight_update(model):
    _, _, params2 = model
    reqs = grouped_requests(9)
    out = []
    for share in (False, True):
        engine = make_engine(model, share_prefill=share, min_bucket=8)
        engine.submit(reqs)
        got = engine.step()  # the first members are admitted under version 0
        engine.update_weights(params2, version=1)
        out.append(by_id(got + engine.run()))
    assert_bitwise(*out)
    assert any(s.policy_version == 1 for s in out[1].values())


def test_an_episode_turn_extends_the_kept_kv_as_a_re_prefill_would(model):
    # Multi-turn episodes: a `keep_kv` request's slot stays reserved once it ends; its
    # next turn (the response plus environment tokens, policy mask False) is appended
    # to that KV in place. It must draw what re-prefilling the whole history draws:
    # the same tokens, log-probs within 1e-4 (prefill vs extend float order).
    reqs = requests(4, seed=5, max_new_tokens=6, keep_kv=True)
    rng = np.random.default_rng(1)
    env = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (3, 9, 1, 5)]
    kept = make_engine(model)
    fresh = make_engine(model)  # no slot kept: every continuation re-prefills
    samples = by_id(kept.run(reqs))
    assert kept.num_held == 4 and kept.num_running == 0
    assert all(kept.holding(r.request_id) for r in reqs)
    turns = [
        GenerationRequest.next_turn(samples[r.request_id], env[i], 5) for i, r in enumerate(reqs)
    ]
    extended = by_id(kept.run(turns))
    reprefilled = by_id(fresh.run([dataclasses.replace(t, keep_kv=False) for t in turns]))
    m, f = kept.metrics(), fresh.metrics()
    assert (m["extended"], m["reprefilled"], f["extended"]) == (4, 0, 0)
    assert m["extended_tokens"] == sum(len(e) + 1 for e in env)  # + each last policy token
    for rid, s in extended.items():
        ref = reprefilled[rid]
        np.testing.assert_array_equal(s.response, ref.response)
        np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=1e-4)
        first, k = samples[rid].num_tokens, len(env[rid])
        np.testing.assert_array_equal(s.response[:first], samples[rid].response)
        policy = np.ones(s.num_tokens, bool)
        policy[first : first + k] = False
        want_mask = policy
        np.testing.assert_array_equal(s.policy_mask, want_mask)
        np.testing.assert_array_equal(s.logprobs[first : first + k], 0.0)
        assert s.num_tokens - first - k <= 5  # the turn's own budget
    # A continuation that does not extend what the slot holds re-prefills (counted).
    kept.release(1)
    assert not kept.holding(1) and kept.num_held == 3
    tampered = GenerationRequest.next_turn(extended[0], [1, 2], 3)
    tampered.continuation.tokens[0] = (tampered.continuation.tokens[0] + 1) % CFG.vocab_size
    kept.run([tampered])
    assert kept.metrics()["reprefilled"] == 1


def test_kept_slots_are_reserved_and_overdue_ones_given_up(model):
    engine = make_engine(model, kv_hold_s=0.0)
    held = requests(4, seed=2, max_new_tokens=3, keep_kv=True)
    engine.run(held)
    assert engine.num_held == 4
    # Four new requests need slots: every kept slot is overdue (kv_hold_s=0) and given up.
    engine.run(requests(4, seed=3, max_new_tokens=2))
    assert engine.num_held == 0 and engine.metrics()["kept_given_up"] == 4
    # One request needs one slot: the least recently kept is given up, the others stay.
    engine.run(held[:2])
    engine.run(held[2:])
    engine.run(requests(1, seed=5, max_new_tokens=2))
    assert engine.metrics()["kept_given_up"] == 5 and engine.num_held == 3
    assert [engine.holding(r.request_id) for r in held].count(False) == 1
    assert all(engine.holding(r.request_id) for r in held[2:])
    patient = make_engine(model)  # kv_hold_s=120: two kept, the others wait for two slots
    patient.run(held[:2])
    patient.submit(requests(3, seed=4, max_new_tokens=20, sampling=SamplingParams.greedy()))
    patient.step()
    assert patient.num_running == 2 and patient.queue_length == 1 and patient.num_held == 2


def test_an_episode_whose_next_turn_runs_on_new_weights_keeps_each_tokens_version(model):
    # In-flight updates: the weights change while an episode waits for its environment.
    # Its next turn is sampled by W_1 (version 1; the kept KV of its first turn stays
    # W_0's, as a running sample's does at an in-flight update); its first turn keeps
    # W_0's tokens and log-probs, version 0.
    _, _, params1 = model
    engine = make_engine(model)
    (req,) = requests(1, seed=9, max_new_tokens=5, keep_kv=True)
    (first,) = engine.run([req])
    engine.update_weights(params1, 1)
    turn = GenerationRequest.next_turn(first, [3, 4, 5], 6)
    (second,) = engine.run([turn])
    k = first.num_tokens
    np.testing.assert_array_equal(second.response[:k], first.response)
    np.testing.assert_array_equal(second.logprobs[:k], first.logprobs)
    v = second.versions()
    assert v[:k].tolist() == [0] * k and v[k + 3 :].tolist() == [1] * (second.num_tokens - k - 3)
    assert (second.oldest_version, second.newest_version) == (0, 1)
    assert engine.metrics()["extended"] == 1


def test_the_metrics_timeline_keeps_the_newest_chunks_and_counts_them_all(model):
    # A serving engine runs for days: its timeline is bounded, `chunks` counts them all.
    from unittest import mock

    from streamrl_jax.generation import engine as engine_mod

    with mock.patch.object(engine_mod, "TIMELINE_CHUNKS", 3):
        engine = make_engine(model)
    engine.run(requests(4))
    m = engine.metrics()
    assert m["chunks"] > 3 and len(m["timeline"]) == 3
    assert m["timeline"][-1][0] >= m["timeline"][0][0]


def _digits(ids) -> str:
    """A detokenizer whose tokens read as several characters each ("17,4,")."""
    return "".join(f"{int(i)}," for i in ids)


def test_a_stop_text_ends_the_response_with_the_token_that_completes_it(model):
    # A stop string spanning parts of three tokens: the response ends with the first
    # token whose text holds it, the tokens its chunk sampled past it are discarded, and
    # the device stops the slot (no slot decodes once the host has nothing running).
    greedy = requests(3, sampling=SamplingParams.greedy(), max_new_tokens=20)
    free = by_id(make_engine(model).run(greedy))
    stopped, expect = [], {}
    for r in greedy:
        tokens = free[r.request_id].response.tolist()
        stop = _digits(tokens[5:8])[1:-1]  # "7,120,16": ends and starts inside tokens
        j = next(j for j in range(len(tokens)) if stop in _digits(tokens[: j + 1]))
        expect[r.request_id] = tokens[: j + 1]
        stopped.append(dataclasses.replace(r, sampling=SamplingParams(
            temperature=0.0, stop_texts=(stop, "never"))))  # fmt: skip
    engine = make_engine(model, detokenize=_digits)
    got = by_id(engine.run(stopped))
    for rid, want in expect.items():
        s = got[rid]
        np.testing.assert_array_equal(s.response, want)
        np.testing.assert_allclose(s.logprobs, free[rid].logprobs[: len(want)], atol=1e-5)
        assert s.finish_reason == "stop" and len(s.versions()) == len(s.sampling_logprobs)
    m = engine.metrics()
    assert m["stopped_on_text"] == 3 and m["discarded_tokens"] > 0
    assert not np.asarray(jax.device_get(engine._state.active)).any()
    # The engine goes on serving as a fresh one would; a forced length ignores stop texts.
    again = requests(4, seed=7)
    assert_same(by_id(engine.run(again)), by_id(make_engine(model).run(again)))
    forced = dataclasses.replace(stopped[0], forced_length=12)
    (s,) = engine.run([forced])
    assert s.finish_reason == "forced" and s.num_tokens == 12


def test_an_episode_turn_after_a_stop_text_extends_the_kept_kv_as_a_re_prefill_would(model):
    # A cut slot's KV holds the discarded tokens past its response; the slot is kept with
    # the record of what its response means (prompt + response but its last token), and
    # the next turn, appended there in place, overwrites them: it draws what re-prefilling
    # the whole history draws (tokens equal, log-probs within 1e-4).
    reqs = requests(4, seed=5, max_new_tokens=20, keep_kv=True)
    free = by_id(make_engine(model).run([dataclasses.replace(r, keep_kv=False) for r in reqs]))
    cut = []
    for r in reqs:
        stop = _digits(free[r.request_id].response[5:7])[:-1]
        cut.append(
            dataclasses.replace(r, sampling=dataclasses.replace(SAMPLED, stop_texts=(stop,)))
        )
    kept = make_engine(model, detokenize=_digits)
    first = by_id(kept.run(cut))
    assert all(s.finish_reason == "stop" and s.num_tokens < 20 for s in first.values())
    assert kept.metrics()["discarded_tokens"] > 0 and kept.num_held == 4
    rng = np.random.default_rng(2)
    env = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (2, 7, 1, 4)]
    turns = [
        GenerationRequest.next_turn(first[r.request_id], env[i], 6, sampling=SAMPLED)
        for i, r in enumerate(reqs)
    ]
    extended = by_id(kept.run(turns))
    fresh = make_engine(model, detokenize=_digits)
    reprefilled = by_id(fresh.run([dataclasses.replace(t, keep_kv=False) for t in turns]))
    assert (kept.metrics()["extended"], kept.metrics()["reprefilled"]) == (4, 0)
    for rid, s in extended.items():
        ref = reprefilled[rid]
        np.testing.assert_array_equal(s.response, ref.response)
        np.testing.assert_allclose(s.logprobs, ref.logprobs, atol=1e-4)
        n = first[rid].num_tokens
        np.testing.assert_array_equal(s.response[:n], first[rid].response)


def test_top_logprobs_come_with_every_token_and_compile_to_nothing_when_off(model):
    graphdef, params, _ = model
    reqs = [*requests(3, seed=3), *requests(2, seed=4, sampling=SamplingParams.greedy())]
    reqs = [dataclasses.replace(r, request_id=i) for i, r in enumerate(reqs)]
    plain = make_engine(model)
    engine = make_engine(model, top_logprobs=5)
    got, want = by_id(engine.run(reqs)), by_id(plain.run(reqs))
    assert_same(got, want)  # the samples are unchanged
    assert want[0].top_ids is None and want[0].top_logprobs is None

    @jax.jit
    def full_logp(params, tokens_1xS, mask_1xS):
        m = nnx.merge(graphdef, params)
        return jax.nn.log_softmax(m.logits(m.hidden_states(tokens_1xS, mask_1xS)), axis=-1)

    for s in got.values():
        assert s.top_ids.shape == s.top_logprobs.shape == (s.num_tokens, 5)
        assert np.all(np.diff(s.top_logprobs, axis=1) <= 0)  # most likely first
        hit = s.top_ids == s.response[:, None]
        among = hit.any(axis=1)
        np.testing.assert_array_equal(s.top_logprobs[hit], s.logprobs[among])
        assert np.all(s.top_logprobs[~among, -1] >= s.logprobs[~among])
        # the full forward's distribution at every response position
        seq = np.r_[s.prompt, s.response[:-1]]
        tokens = np.zeros((1, ENGINE.max_total_length), np.int32)
        tokens[0, : len(seq)] = seq
        mask = np.arange(ENGINE.max_total_length)[None] < len(seq)
        logp = np.asarray(full_logp(params, jnp.asarray(tokens), jnp.asarray(mask)))
        ref = logp[0, len(s.prompt) - 1 : len(seq)]
        np.testing.assert_allclose(
            s.top_logprobs, np.take_along_axis(ref, s.top_ids, axis=1), atol=1e-4
        )
        assert np.all(s.top_logprobs[:, -1] >= np.sort(ref, axis=1)[:, -5] - 1e-4)
    # A continuation's tokens were not sampled here: no alternatives (-1, -inf).
    (first,) = engine.run([dataclasses.replace(reqs[0], keep_kv=True, max_new_tokens=3)])
    (second,) = engine.run([GenerationRequest.next_turn(first, [1, 2], 3)])
    k = first.num_tokens + 2
    assert np.all(second.top_ids[:k] == -1) and np.all(second.top_logprobs[:k] == -np.inf)
    assert np.all(second.top_ids[k:] >= 0)
    # Off (0), prefill and decode compute no top-k at all.
    for e, on in ((plain, False), (engine, True)):
        idx = jax.device_put(np.arange(ENGINE.num_slots, dtype=np.int32), e._repl)
        adm = jax.device_put(e._admission([], 16), e._repl)
        chunk = e._chunk.lower(e._params, e._state, idx, seq=ENGINE.max_total_length)
        prefill = e._prefill_keep.lower(e._params, e._state, e._store, adm)
        assert ("chlo.top_k" in chunk.as_text()) == on
        assert ("chlo.top_k" in prefill.as_text()) == on
