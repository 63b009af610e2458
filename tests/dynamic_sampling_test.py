"""DAPO dynamic sampling on `quickstart:tiny`: uniform groups are skipped, counted and
replaced, every mode keeps the version contract, and resume stays exact.

The reward gives every sample of a third of the prompts (by a hash of the prompt id)
the same score (a group without variance) and the vowel fraction to the rest.
"""

import os
import zlib
from unittest import mock

import numpy as np
import pytest
from support import (
    consumed_log,
    param_arrays,
    pipeline_threads,
    tiny_config,
    trainer_dies_on_call,
)

from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.config import ConfigError
from streamrl_jax.metrics import read_jsonl
from streamrl_jax.pipeline import micro_batches
from streamrl_jax.pipeline.resume import CONSUMED, read_consumed
from streamrl_jax.rewards.vowels import vowel_reward


def uniform(prompt_id: str) -> bool:
    return zlib.crc32(prompt_id.encode()) % 3 == 0


def some_uniform_reward(text, metadata):
    if uniform(metadata["prompt_id"]):
        r = vowel_reward("", metadata)
        return r.__class__(score=0.5, correct=False, extracted_answer=None, format_ok=True)
    return vowel_reward(text, metadata)


def _cfg(**overrides):
    base = dict(
        pipeline__steps=3,
        pipeline__dynamic_sampling=True,
        eval__num_problems=0,
    )
    return tiny_config(**(base | overrides))


def _trained_groups():
    """Patches pack_groups to record (batch, prompt id, rewards) of every trained group."""
    seen, real = [], micro_batches.pack_groups

    def pack(step, groups, **kwargs):
        for g in groups:
            tag = g[0].sample.tag
            seen.append((tag.batch, tag.prompt_id, [s.reward.score for s in g]))
        return real(step, groups, **kwargs)

    return seen, mock.patch.object(micro_batches, "pack_groups", pack)


# The batch modes take 1-2 min each on a loaded 2-core machine: extended (`-m extended`).
_SLOW = {"colocated", "disaggregated_batch"}


@pytest.mark.parametrize(
    "mode",
    [pytest.param(m, marks=pytest.mark.extended) if m in _SLOW else m for m in config_lib.MODES],
)
def test_uniform_groups_are_skipped_counted_and_replaced(mode, tmp_path):
    cfg = _cfg(pipeline__mode=mode)
    p = cfg.pipeline
    seen, patch = _trained_groups()
    with patch:
        result = run_lib.run(cfg, str(tmp_path), reward_fn=some_uniform_reward)
    assert not pipeline_threads()
    rows = [r for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "reward" in r]
    consumed = [r["prompt_ids"] for r in read_consumed(os.path.join(tmp_path, CONSUMED))]
    assert len(rows) == len(consumed) == p.steps
    skipped_total = 0
    for b, (row, ids) in enumerate(zip(rows, consumed, strict=True)):
        trained = [pid for batch, pid, _ in seen if batch == b]
        # The batch stays full: prompts_per_step informative groups (the draws suffice).
        assert row["dynamic_short"] == 0.0
        assert len(trained) == p.prompts_per_step
        assert row["samples"] == p.prompts_per_step * p.group_size
        # Every consumed prompt was either trained or skipped, once; the skipped ones
        # are replaced by as many draws.
        assert len(ids) == len(set(ids)) == p.prompts_per_step + row["dynamic_draws"]
        assert row["groups_skipped"] == row["dynamic_draws"] == len(ids) - len(trained)
        assert set(trained) <= set(ids)
        # The rigged prompts are all skipped (others only if their rewards tie).
        assert {pid for pid in ids if uniform(pid)} <= set(ids) - set(trained)
        skipped_total += row["groups_skipped"]
    # Skipped groups never reach the trainer; every trained one has reward variance.
    assert all(not uniform(pid) and np.ptp(r) > 0 for _, pid, r in seen)
    assert skipped_total > 0  # the rig bit
    # DESIGN.md §2: every trained sample was generated with W_g(b), refills included.
    s = p.staleness if mode == "stream_async" else 0
    for b, versions in enumerate(result.trained_versions):
        assert set(versions) == {max(0, b - s)}, (b, versions)


def test_draws_run_out_the_step_trains_what_it_has(tmp_path):
    cfg = _cfg(pipeline__mode="stream_sync", pipeline__dynamic_sampling_max_draws=0)
    seen, patch = _trained_groups()
    with patch:
        result = run_lib.run(cfg, str(tmp_path), reward_fn=some_uniform_reward)
    n = cfg.pipeline.prompts_per_step
    for b, row in enumerate(result.steps):
        trained = sum(1 for batch, *_ in seen if batch == b)
        assert row["groups_skipped"] == n - trained and row["dynamic_draws"] == 0
        assert row["dynamic_short"] == float(trained < n)
        assert row["samples"] == trained * cfg.pipeline.group_size
    assert any(row["dynamic_short"] for row in result.steps)


def test_refused_combinations_are_named():
    for overrides, field in [
        ({"group_size": 1, "min_groups": 1}, "group_size"),
        ({"mini_batches": 2}, "mini_batches"),
        ({"mode": "stream_async", "weight_update": "inflight"}, "weight_update"),
    ]:
        cd = config_lib.defaults().to_dict()
        cd["pipeline"] |= {"dynamic_sampling": True} | overrides
        with pytest.raises(ConfigError, match=f"dynamic_sampling needs pipeline.{field}"):
            config_lib.from_config_dict(cd)


def test_resume_is_exact_and_consumes_each_prompt_once(tmp_path):
    # The resume_test pattern, stream_async deterministic, a checkpoint every step: one
    # uninterrupted reference, one run whose trainer dies in batch 2 and is resumed.
    cfg = _cfg(
        pipeline__mode="stream_async",
        pipeline__steps=4,
        pipeline__deterministic=True,
        checkpoint__every=1,
        checkpoint__keep=10,
    )
    ref_dir, workdir = str(tmp_path / "reference"), str(tmp_path / "resumed")
    ref = run_lib.run(cfg, ref_dir, reward_fn=some_uniform_reward)
    # Micro-batches of 2 groups: calls 1-2 are batch 0, 3-4 batch 1, 5 is batch 2's first.
    with trainer_dies_on_call(5), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(cfg, workdir, reward_fn=some_uniform_reward)
    assert not pipeline_threads()
    result = run_lib.run(cfg, workdir, reward_fn=some_uniform_reward)
    assert result.start_batch == 2
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(workdir)
    ref_steps, ref_counts = consumed_log(ref_dir)
    assert steps == ref_steps == list(range(4))
    assert counts == ref_counts and set(counts.values()) == {1}
    skipped = sum(r["groups_skipped"] for r in ref.steps)
    assert sum(counts.values()) == 4 * cfg.pipeline.prompts_per_step + skipped > 16
    assert [r["groups_skipped"] for r in result.steps] == [
        r["groups_skipped"] for r in ref.steps[2:]
    ]
