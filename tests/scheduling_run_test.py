"""Skew-aware scheduling inside the pipeline (`quickstart:tiny`): dispatch plans, LPT
engines, the online ranker saved with checkpoints, elastic activation keeping the
version contract."""

import json
import os
from unittest import mock

import jax
import pytest
from support import pipeline_threads, tiny_config

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.scheduling.live import LiveScheduler


def _decisions(workdir):
    with open(os.path.join(workdir, "scheduling.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _elastic_cfg(steps: int):
    # Two instances of 4 slots (8 requests a batch fill both), one reserved; checkpoints
    # every step (the ranker test resumes one).
    return tiny_config(
        pipeline__mode="stream_async",
        pipeline__steps=steps,
        mesh__generate_devices=2,
        mesh__instance_slots=(4, 4),
        scheduling__dispatch="skew_aware",
        scheduling__elastic_reserved=1,
        scheduling__ranker_min_samples=4,
        checkpoint__every=1,
        checkpoint__keep=10,
        eval__num_problems=0,
    )


def _devices():
    """The instances on devices 0 and 2, the trainer on device 1: where every other
    quickstart:tiny run has its trainer, so that the trainer's compiled programs are
    theirs (a compiled program is per device)."""
    d = jax.devices()
    return [d[0], d[2], d[1], *d[3:]]


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    # The measured T_gen is inflated by 100 s so that delta = T_gen - T_train >= delta'
    # = T_gen / 2 at the first step: the rule fires and later batches are dispatched
    # over both instances.
    orig = LiveScheduler.end_of_step

    def slow_generation(self, step, t_gen, t_train):
        return orig(self, step, t_gen + 100.0, t_train)

    workdir = str(tmp_path_factory.mktemp("elastic"))
    with mock.patch.object(LiveScheduler, "end_of_step", slow_generation):
        result = run_lib.run(_elastic_cfg(steps=4), workdir, _devices(), vowel_reward)
    return result, workdir


def test_elastic_activation_keeps_the_version_contract(elastic):
    result, workdir = elastic
    assert not pipeline_threads()
    # The version contract across the activation: g(b) = max(0, b - 1).
    assert [sorted(set(v)) for v in result.trained_versions] == [[0], [0], [1], [2]]
    decisions = _decisions(workdir)
    elastic = [d for d in decisions if d["kind"] == "elastic"]
    assert elastic[0]["add"] and elastic[0]["delta"] >= elastic[0]["delta_prime"]
    assert all(not d["add"] for d in elastic[1:])  # no reserved instance left
    plans = {d["batch"]: d for d in decisions if d["kind"] == "dispatch"}
    assert plans[0]["active_instances"] == 1 and len(plans[0]["requests_per_instance"]) == 1
    assert plans[3]["active_instances"] == 2 and min(plans[3]["requests_per_instance"]) > 0
    assert [r["active_instances"] for r in result.steps] == [1.0, 2.0, 2.0, 2.0]
    # The ranker refreshed online from the run's samples.
    assert result.steps[-1]["ranker_steps"] > 0


def test_ranker_is_saved_and_restored_with_checkpoints(elastic, tmp_path):
    # The elastic run's checkpoint 4, alone in a new workdir, resumed for a 5th step.
    first, workdir = elastic
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
    saved = int(ckpt.restore(4, abstract_state=first.state, abstract_ranker=None).ranker["steps"])
    os.makedirs(tmp_path / "checkpoints")
    os.symlink(ckpt.step_directory(4), tmp_path / "checkpoints" / "4")
    ckpt.close()
    assert saved > 0
    resumed = run_lib.run(_elastic_cfg(steps=5), str(tmp_path), _devices(), vowel_reward)
    assert resumed.start_batch == 4
    # The resumed ranker continues from the saved one (online steps add to it).
    assert resumed.steps[0]["ranker_steps"] >= saved


def test_oracle_dispatch_needs_forced_lengths():
    with pytest.raises(ValueError, match="oracle' needs generation.length_replay"):
        tiny_config(scheduling__dispatch="oracle")
