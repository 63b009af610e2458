"""Skew-aware scheduling inside the pipeline (`quickstart:tiny`): dispatch plans, LPT
engines, the online ranker saved with checkpoints, elastic activation keeping the
version contract."""

import json
import os
from unittest import mock

import pytest
from support import pipeline_threads, tiny_config

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.scheduling.live import LiveScheduler


def _decisions(workdir):
    with open(os.path.join(workdir, "scheduling.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_elastic_activation_keeps_the_version_contract(tmp_path):
    # Two instances, one reserved. The measured T_gen is inflated by 100 s so that
    # delta = T_gen - T_train >= delta' = T_gen / 2 at the first step: the rule fires
    # and later batches are dispatched over both instances.
    orig = LiveScheduler.end_of_step

    def slow_generation(self, step, t_gen, t_train):
        return orig(self, step, t_gen + 100.0, t_train)

    cfg = tiny_config(
        pipeline__mode="stream_async",
        pipeline__steps=4,
        mesh__generate_devices=2,
        mesh__instance_slots=(4, 4),
        scheduling__dispatch="skew_aware",
        scheduling__elastic_reserved=1,
        scheduling__ranker_min_samples=4,
        eval__num_problems=0,
    )
    with mock.patch.object(LiveScheduler, "end_of_step", slow_generation):
        result = run_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    assert not pipeline_threads()
    # The version contract across the activation: g(b) = max(0, b - 1).
    assert [sorted(set(v)) for v in result.trained_versions] == [[0], [0], [1], [2]]
    decisions = _decisions(str(tmp_path))
    elastic = [d for d in decisions if d["kind"] == "elastic"]
    assert elastic[0]["add"] and elastic[0]["delta"] >= elastic[0]["delta_prime"]
    assert all(not d["add"] for d in elastic[1:])  # no reserved instance left
    plans = {d["batch"]: d for d in decisions if d["kind"] == "dispatch"}
    assert plans[0]["active_instances"] == 1 and len(plans[0]["requests_per_instance"]) == 1
    assert plans[3]["active_instances"] == 2 and min(plans[3]["requests_per_instance"]) > 0
    assert [r["active_instances"] for r in result.steps] == [1.0, 2.0, 2.0, 2.0]
    # The ranker refreshed online from the run's samples.
    assert result.steps[-1]["ranker_steps"] > 0


def test_ranker_is_saved_and_restored_with_checkpoints(tmp_path):
    common = dict(
        pipeline__mode="stream_sync",
        scheduling__dispatch="skew_aware",
        scheduling__ranker_min_samples=4,
        checkpoint__every=1,
        eval__num_problems=0,
    )
    first = run_lib.run(
        tiny_config(pipeline__steps=2, **common), str(tmp_path), reward_fn=vowel_reward
    )
    ckpt = ckpt_lib.Checkpointer(os.path.join(str(tmp_path), "checkpoints"))
    saved = int(ckpt.restore(2, abstract_state=first.state, abstract_ranker=None).ranker["steps"])
    ckpt.close()
    assert saved > 0
    resumed = run_lib.run(
        tiny_config(pipeline__steps=3, **common), str(tmp_path), reward_fn=vowel_reward
    )
    assert resumed.start_batch == 2
    # The resumed ranker continues from the saved one (online steps add to it).
    assert resumed.steps[0]["ranker_steps"] >= saved


def test_oracle_dispatch_needs_forced_lengths():
    with pytest.raises(ValueError, match="oracle' needs generation.length_replay"):
        tiny_config(scheduling__dispatch="oracle")
