"""`pipeline.precompile` (pipeline/precompile.py): everything a length-replay run meets is
compiled before its first step, and compiling it changes nothing the run computes."""

import dataclasses
import itertools
import types

import numpy as np
import pytest
from support import tiny_config

from streamrl_jax import pipeline as run_lib
from streamrl_jax.pipeline import precompile
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import Ownership, TrainingGroup
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.trainer.batch import make_batch
from streamrl_jax.trainer.config import trainer_config


def _replay(**overrides):
    """quickstart:tiny with forced response lengths (so the trainer's shapes are known in
    advance): 4 prompts x 2 samples, micro-batches of 1-2 groups, responses of 4-16 tokens,
    3 steps unless overridden."""
    return tiny_config(
        **dict(
            generation__length_replay=True,
            pipeline__steps=3,
            eval__num_problems=0,
            log__final_params=True,
        )
        | overrides
    )


def _after_first(result):
    return [r["compile_s"] for r in result.steps[1:]]


def test_precompiled_run_compiles_nothing_after_its_first_step_and_trains_the_same(tmp_path):
    # Deterministic: the same groups in every micro-batch, so the final parameters must be
    # bitwise those of the run that compiled as it went.
    runs = {}
    for on in (True, False):
        cfg = _replay(pipeline__deterministic=True, pipeline__precompile=on, pipeline__steps=2)
        workdir = tmp_path / str(on)
        runs[on] = run_lib.run(cfg, str(workdir), reward_fn=vowel_reward)
        runs[on].params = np.load(workdir / run_lib.FINAL_PARAMS)
    assert _after_first(runs[True]) == [0.0]
    assert runs[True].steps[0]["precompile_s"] > 0 and "precompile_s" not in runs[False].steps[0]
    assert runs[True].trained_versions == runs[False].trained_versions
    for name in runs[False].params.files:
        np.testing.assert_array_equal(runs[True].params[name], runs[False].params[name], name)


# -m extended (the suite's budget): the default suite keeps precompile end to end (the
# test above: nothing compiles after the first step, and the run trains the same) and the
# streaming plan as units (`test_sizes_follow_the_taker`: every size the taker can take;
# `test_two_training_processes_plan_every_agreed_shape`: every subset's shape planned).
@pytest.mark.extended
def test_streaming_run_meets_only_planned_shapes(tmp_path):
    # Not deterministic: a micro-batch is whichever 1 or 2 groups of the batch are ready
    # (min_groups=1), so the plan is every such subset; stream_sync's steps meet new
    # micro-batches as they stream, and none compiles.
    cfg = _replay(pipeline__mode="stream_sync", pipeline__precompile=True)
    result = run_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    assert _after_first(result) == [0.0, 0.0]
    assert sum(r["micro_batches"] for r in result.steps) >= 6


def test_sizes_follow_the_taker():
    cfg = _replay(pipeline__prompts_per_step=5, pipeline__micro_batch_groups=2)
    p = cfg.pipeline
    streaming = Schedule.from_config(p)
    assert precompile._sizes(p, streaming, 5) == {1, 2}  # min_groups=1 up to 2
    batch = Schedule.from_config(dataclasses.replace(p, mode="disaggregated_batch"))
    assert precompile._sizes(p, batch, 5) == {1, 2}  # 2, 2, then the last 1
    p4 = dataclasses.replace(p, prompts_per_step=4, mode="disaggregated_batch")
    assert precompile._sizes(p4, Schedule.from_config(p4), 4) == {2}


def test_too_many_candidate_micro_batches_is_an_error_naming_the_fields():
    cfg = _replay(pipeline__prompts_per_step=64, pipeline__micro_batch_groups=8)
    groups = {0: [(10, (4, 4))] * 64}
    layout = dict(
        seq_buckets=(64, 144), batch_buckets=(1, 2, 4, 8, 16), shared_prompt=True, pack=True
    )
    with pytest.raises(ValueError, match="pipeline.precompile: over .* micro_batch_groups=8"):
        precompile.micro_batch_shapes(
            cfg, layout | {"loss_chunk": 64}, Schedule.from_config(cfg.pipeline), groups, [0]
        )


def test_two_training_processes_plan_every_agreed_shape():
    # Each of 2 training processes owns 4 of the 8 groups and feeds whichever 2 of them are
    # ready to each micro-batch (2 rows each); the processes then agree on one padded
    # shape (`TrainingGroup.agree`, run here with the max taken over both processes'
    # values). Every shape they can agree on must be in the plan.
    cfg = _replay(
        pipeline__prompts_per_step=8, pipeline__micro_batch_groups=4, pipeline__min_groups=4
    )
    layout = trainer_config(cfg, fsdp=2).layout
    rng = np.random.default_rng(1)
    groups = {0: [(int(rng.integers(10, 60)), tuple(rng.integers(4, 17, 2))) for _ in range(8)]}
    plan = precompile.micro_batch_shapes(
        cfg, layout, Schedule.from_config(cfg.pipeline), groups, [0], count=2
    )
    own = Ownership(2, 8, 4)
    mine = [own.local_groups(0, 0, t) + own.local_groups(0, 1, t) for t in range(2)]

    def local(chosen):
        prompts, responses, ids = [], [], []
        for i in chosen:
            plen, resp = groups[0][i]
            prompts += [np.full(plen, i, np.int32)] * len(resp)
            responses += [np.ones(r, np.int32) for r in resp]
            ids += [i] * len(resp)
        behaviour = [np.zeros(len(r)) for r in responses]
        return make_batch(prompts, responses, behaviour_logp=behaviour, group_ids=ids, **layout)

    def rows_seq_width(batch):
        rows = int(batch.attention_mask.any(axis=1).sum())
        return [rows, batch.tokens.shape[1], batch.loss_columns.shape[1]]

    agreed = set()
    for s0, s1 in itertools.product(*(itertools.combinations(m, 2) for m in mine)):
        both = [rows_seq_width(local(s0)), rows_seq_width(local(s1))]
        most = [max(v) for v in zip(*both, strict=True)]
        fake = types.SimpleNamespace(count=2, max=lambda _, most=most: most)
        padded = TrainingGroup.agree(fake, local(s0), 0, layout["batch_buckets"])
        agreed.add((padded.tokens.shape[0], padded.tokens.shape[1], padded.loss_columns.shape[1]))
    assert len(agreed) >= 2  # the case is not degenerate
    assert agreed <= set(plan), (agreed, plan)
