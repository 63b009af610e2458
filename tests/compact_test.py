"""Decode shapes that follow the active batch (`generation/compact.py`) on the tiny model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support import assert_same, by_id, make_engine, requests

from streamrl_jax.generation import compact
from streamrl_jax.generation.types import Continuation, SamplingParams

# A config of its own (chunk_steps=3): its jitted chunk is not shared with other files'
# tests, so its executable count is this file's. Shapes: batch (1, 2) x length (24, 48),
# and (4, 48) when every slot runs. Every engine here has these statics: each compiles
# only shapes of this set, which the first test compiles as it goes.
BUCKETED = dict(chunk_steps=3, min_decode_length=24)


def test_decode_shapes_cover_the_running_slots_with_free_padding():
    shapes = compact.DecodeShapes(num_slots=6, max_length=100, chunk_steps=4, min_length=16)
    assert shapes.batch_buckets == (1, 2, 4, 6)
    assert shapes.length_buckets == (16, 32, 64, 100)
    assert len(shapes.all()) == 13  # 3 batch buckets x 4 lengths + the full shape
    rows, seq = shapes.pick([5], [10])
    np.testing.assert_array_equal(rows, [5])
    assert seq == 16  # 10 filled + 4 steps
    rows, seq = shapes.pick([4, 1, 3], [30, 12, 5])
    np.testing.assert_array_equal(rows, [0, 1, 3, 4])  # padded with the lowest free slot
    assert seq == 64  # 30 + 4 > 32
    rows, seq = shapes.pick([0, 1, 2, 3, 5], [97, 1, 1, 1, 1])
    np.testing.assert_array_equal(rows, np.arange(6))
    assert seq == 100  # capped at the cache length
    assert compact.doubling(64, 72) == (72,)  # 64 saves too little to compile
    assert compact.doubling(1, 5) == (1, 2, 5)
    full = compact.DecodeShapes(num_slots=6, max_length=100, chunk_steps=4, enabled=False)
    assert full.all() == [(6, 100)]
    rows, seq = full.pick([2], [3])
    np.testing.assert_array_equal(rows, np.arange(6))
    assert seq == 100
    with pytest.raises(ValueError, match="no running slot"):
        shapes.pick([], [])


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, top_k=50, top_p=0.95)])
def test_compacted_decode_gives_the_full_decodes_samples(model, sampling):  # noqa: F811
    """Same tokens, finish reasons and log-probs (atol/rtol 1e-5) as decoding every slot
    over the whole cache, with admissions mid-run (rows move between buckets), a
    paused-and-continued request and the static baseline."""
    reqs = requests(11, sampling=sampling, seed=5)
    full = by_id(make_engine(model, decode_buckets=False, **BUCKETED).run(reqs))
    engine = make_engine(model, **BUCKETED)
    engine.submit(reqs[:2])
    got = engine.step() + engine.step()  # two running of four slots: batch bucket 2
    got += engine.run(reqs[2:])
    assert_same(full, by_id(got))
    assert_same(full, by_id(make_engine(model, refill=False, **BUCKETED).run(reqs)))


def test_decode_compiles_at_most_one_executable_per_bucket_pair(model):  # noqa: F811
    """Many chunks over varying active counts and lengths compile at most
    len(batch buckets) x len(length buckets) decode executables; nothing per step."""
    engine = make_engine(model, **BUCKETED)
    shapes = engine.cfg.decode_shapes()
    steps = []
    engine._on_chunk = lambda r: steps.append(r.steps)
    reqs = requests(16, sampling=SamplingParams.greedy(), seed=6)
    engine.run(reqs)
    used = engine._chunk._cache_size()
    assert 2 < used <= len(shapes.all()) == 5  # several shapes, all within the bound
    prefills = sum(f._cache_size() for f in (engine._prefill, engine._prefill_keep, engine._fork))
    assert engine.compile_count() == prefills + used
    assert len(steps) > len(shapes.all())  # more chunks than shapes
    engine.compile_decode_shapes()
    compiled = engine.compile_count()
    assert engine._chunk._cache_size() == len(shapes.all())
    engine.run(requests(16, seed=7))
    assert engine.compile_count() == compiled


# Without a shared prefill (its own prefill executables compiled cold) is a further case,
# -m extended: the default case keeps the capability (everything a run meets compiled).
@pytest.mark.parametrize("share_prefill", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_compile_shapes_compiles_everything_a_run_meets_and_changes_no_sample(
    model,  # noqa: F811
    share_prefill,
):
    """`pipeline.precompile`'s engine part: after `compile_shapes(continuations=True)` a
    run with admissions mid-run, shared prompts and paused-and-continued requests compiles
    nothing more, and gives bitwise the samples of an engine that compiled as it went (the
    padding rows the compile runs on write nothing)."""
    kw = dict(BUCKETED, share_prefill=share_prefill)
    reqs = requests(9, seed=8)
    reqs += [dataclasses.replace(r, request_id=100 + i) for i, r in enumerate(reqs[:3])]
    paused = [dataclasses.replace(r, segment_tokens=4) for r in reqs[:4]]

    def run(engine):
        first = engine.run(paused)
        again = [
            dataclasses.replace(reqs[s.request_id], continuation=Continuation.of(s))
            for s in first
            if s.finish_reason == "paused"
        ]
        assert again
        return by_id(engine.run(reqs[4:]) + engine.run(again))

    cold = run(make_engine(model, **kw))
    engine = make_engine(model, **kw)
    engine.compile_shapes(continuations=True)
    compiled = engine.compile_count()  # executables of these statics, shared with `cold`'s
    # (and the earlier tests', all of whose shapes are among those compiled here)
    prefill = len(engine.cfg.prefill_buckets(continuations=True))
    assert prefill > len(engine.cfg.buckets())  # re-prefill buckets past the prompt
    assert engine._chunk._cache_size() == len(engine.cfg.decode_shapes().all())
    assert (engine._prefill_keep if share_prefill else engine._prefill)._cache_size() == prefill
    warm = run(engine)
    assert engine.compile_count() == compiled
    assert cold.keys() == warm.keys()
    for rid, s in cold.items():
        np.testing.assert_array_equal(s.response, warm[rid].response, err_msg=f"request {rid}")
        np.testing.assert_array_equal(s.logprobs, warm[rid].logprobs, err_msg=f"request {rid}")
        assert s.finish_reason == warm[rid].finish_reason
