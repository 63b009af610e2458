"""Several learners on one generation service (docs/learners.md, pipeline/learners.py).

Two LoRA learners of the tiny model share one service: a GRPO learner in stream_sync
and a second one with its own learning rate, seed, prompts (another train seed), group
size and version contract (stream_async, staleness 1). Each must train exactly its own
draws under its own contract; a kill and resume of both is exact; the first learner to
fail ends the other, naming it; and the router refuses a sample whose adapter is not
its request's.
"""

import os
import signal
import threading
import time
import types

import jax
import numpy as np
import pytest
from flax import nnx
from support import (
    consumed_log,
    drawn_prompt_ids,
    param_arrays,
    pipeline_threads,
    tiny_config,
    trainer_dies_on_call,
)

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax import config as config_lib
from streamrl_jax.generation.service import InstanceError
from streamrl_jax.generation.types import Sample, Timings
from streamrl_jax.pipeline import learners as learners_lib
from streamrl_jax.pipeline.resume import CONSUMED, read_consumed
from streamrl_jax.rewards.vowels import vowel_reward

STEPS = 3


def _cfg(steps: int = STEPS, fast_alpha: float | None = None, **top):
    base = dict(
        pipeline__steps=steps,
        pipeline__deterministic=True,
        pipeline__mode="stream_sync",
        checkpoint__every=1,
        checkpoint__keep=10,
        eval__num_problems=0,
    )
    cd = config_lib.to_config_dict(tiny_config(**(base | top)))
    cd.trainer.lora.rank = 4
    fast = dict(
        name="fast",
        seed=7,
        optimizer=dict(learning_rate=3e-3),
        data=dict(train_seed=11),
        pipeline=dict(mode="stream_async", staleness=1, group_size=2, steps=steps),
    )
    # The runs' learners share the adapters' scale (alpha / rank), so that the second
    # one's forward and gradient programs are the first one's (compiled once); an engine
    # slot with its own alpha is adapters_test.py's, a learner naming one the round trip's.
    if fast_alpha is not None:
        fast["lora"] = dict(alpha=fast_alpha)
    cd.learners = (dict(name="grpo"), fast)
    return config_lib.from_config_dict(cd)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("learners"))
    cfg = _cfg()
    return cfg, learners_lib.run(cfg, workdir, reward_fn=vowel_reward), workdir


def test_each_learner_trains_its_own_draws_under_its_own_contract(reference):
    cfg, results, workdir = reference
    assert sorted(results) == ["fast", "grpo"]
    assert not pipeline_threads()
    for learner in cfg.learners:
        lc = config_lib.learner_config(cfg, learner)
        r, p = results[learner.name], lc.pipeline
        assert len(r.steps) == STEPS and r.samples == STEPS * p.prompts_per_step * p.group_size
        # Its own prompts (the other's train seed draws others), each step's draw once:
        # a sample routed to the wrong learner would put a foreign prompt here.
        steps, counts = consumed_log(os.path.join(workdir, learner.name))
        assert steps == list(range(STEPS))
        drawn = [i for ids in drawn_prompt_ids(lc, STEPS) for i in ids]
        assert sorted(counts.elements()) == sorted(drawn)
        with open(os.path.join(workdir, learner.name, "samples.jsonl")) as f:
            assert sum(1 for _ in f) == r.samples
    # Each learner's version contract: stream_sync trains step b on W_b, stream_async
    # (staleness 1) on W_(b-1).
    assert [sorted(set(v)) for v in results["grpo"].trained_versions] == [[0], [1], [2]]
    assert [sorted(set(v)) for v in results["fast"].trained_versions] == [[0], [0], [1]]
    # Their adapters moved apart (other learning rates and samples); the base they
    # share stayed frozen in both.
    base = lambda r: r.state.params.filter(nnx.Not(nnx.LoRAParam))  # noqa: E731
    lora = lambda r: r.state.params.filter(nnx.LoRAParam)  # noqa: E731
    grpo, fast = results["grpo"], results["fast"]
    for x, y in zip(jax.tree.leaves(base(grpo)), jax.tree.leaves(base(fast)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(lora(grpo)), jax.tree.leaves(lora(fast)), strict=True)
    )


# -m extended (the suite's budget): the default suite's bitwise resume of both learners is
# `test_the_first_learner_to_fail_ends_the_other_and_both_resume` (its resumed run ends at
# the reference's parameters); this one resumes from a kill's checkpoint instead.
@pytest.mark.extended
def test_a_kill_and_resume_of_two_learners_is_exact(reference, tmp_path):
    # Each learner's checkpoint 2 of the reference run, alone in a new workdir (as a run
    # killed after step 2 leaves it): the resume trains step 2 and ends bitwise at the
    # reference. (A resume from a failed run: the test below.)
    cfg, results, ref_dir = reference
    for name in results:
        src = ckpt_lib.Checkpointer(os.path.join(ref_dir, name, "checkpoints"))
        assert 2 in src.all_steps()
        os.makedirs(tmp_path / name / "checkpoints")
        os.symlink(src.step_directory(2), tmp_path / name / "checkpoints" / "2")
        src.close()
    resumed = learners_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    for name, r in resumed.items():
        assert r.start_batch == 2 and len(r.steps) == 1
        for got, want in zip(param_arrays(r), param_arrays(results[name]), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)
        steps, _ = consumed_log(str(tmp_path / name))
        assert steps == [2]


def test_the_first_learner_to_fail_ends_the_other_and_both_resume(reference, tmp_path):
    # The 4th micro-batch accumulation in the process (one of the learners' 2nd or 3rd
    # step) raises: that learner's run ends naming its trainer, the other is told and
    # ends at a step boundary, no thread is left; the workdir then resumes exactly.
    cfg, results, _ = reference
    with trainer_dies_on_call(4), pytest.raises(RuntimeError, match="trainer died"):
        learners_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    assert not pipeline_threads()
    trained = {  # a learner that failed in its first step has no log yet
        n: consumed_log(str(tmp_path / n))[0] if (tmp_path / n / CONSUMED).exists() else []
        for n in results
    }
    assert all(len(steps) < STEPS for steps in trained.values()), trained
    resumed = learners_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    for name, r in resumed.items():
        for got, want in zip(param_arrays(r), param_arrays(results[name]), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)


class _FakeService:
    """What the router reads: `get` hands out the queued samples, then times out."""

    def __init__(self, samples):
        self.samples, self.closed = list(samples), False

    def get(self, timeout):
        if self.samples:
            return self.samples.pop(0)
        if self.closed:
            from streamrl_jax.generation.service import StreamClosed

            raise StreamClosed("closed")
        raise TimeoutError

    def close(self, timeout):
        self.closed = True


def _sample(request_id, adapter):
    z = np.zeros(1, np.int32)
    return Sample(
        request_id=request_id,
        prompt=z,
        response=z,
        logprobs=z.astype(np.float32),
        sampling_logprobs=z.astype(np.float32),
        finish_reason="stop",
        policy_version=0,
        last_policy_version=0,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
        adapter=adapter,
    )


def test_the_router_hands_each_learner_its_own_samples_and_refuses_a_stray():
    service = _FakeService([_sample((1, "b0"), 1), _sample((0, "a0"), 0)])
    shared = learners_lib.SharedService(service, ["a", "b"], learners_lib.Meters(), poll_s=0.01)
    a, b = shared.view(0), shared.view(1)
    assert b.get(timeout=5).request_id == "b0"
    assert a.get(timeout=5).request_id == "a0"
    service.samples.append(_sample((0, "x"), 1))
    # A sample keyed by learner 0's slot that came back with adapter 1: every learner is
    # told, naming it.
    for view in (a, b):
        with pytest.raises(InstanceError, match=r"came back with adapter 1"):
            view.get(timeout=5)
    shared.close(5)


def test_a_learner_that_fails_before_the_shared_service_began_stops_the_others_starting():
    # Across processes (pipeline/processes/learners.py) the generation process's shared
    # service begins with the first learner's W_0. A learner that fails before that
    # (its trainer lost before W_0) still ends the others: a driver that then starts is
    # refused naming it; once the service runs, a failure stops the others' samples.
    from streamrl_jax.pipeline.processes import learners as across

    made, adapters = [], []
    service = _FakeService([])
    service.update_adapter = lambda slot, params, version, alpha: adapters.append(slot)

    def make_service(params, version, **kwargs):
        made.append(version)
        return service

    cfg = _cfg()
    parts = types.SimpleNamespace(service=make_service)
    shared = across._Service(parts, cfg)
    shared.fail(1, RuntimeError("its trainer was lost"), "learner grpo")
    with pytest.raises(RuntimeError, match="learner grpo failed: RuntimeError.'its trainer"):
        shared.view(1)([], 0, lambda report: None)
    view = shared.view(0)([], 0, lambda report: None)  # the first to start begins it
    assert made == [0] and adapters == [0]
    shared.fail(0, RuntimeError("boom"), "learner fast")
    with pytest.raises(RuntimeError, match="boom"):
        view.get(timeout=5)
    shared.close()


@pytest.mark.parametrize(
    "learners, match",
    [
        ((dict(name="a"),), "name two or more"),
        ((dict(name="a"), dict(name="a")), "two learners named 'a'"),
        ((dict(name="a"), dict(name="b", model=dict(max_context=64))), "model cannot differ"),
        ((dict(name="a"), dict(name="b", lora=dict(rank=0))), r"learners\[1\] \(b\): lora.rank"),
        ((dict(name="a"), dict(name="b", lora=dict(rank=8))), "adapter slots are one table"),
        ((dict(name="a"), dict(name="b", lora=dict(alpha=-1.0))), "alpha=-1.0 must be > 0"),
        ((dict(name="a"), dict(name="b", pipeline=dict(precompile=True))), "pipeline.precompile"),
        ((dict(name="a"), dict(name="b", pipeline=dict(mode="colocated"))), "colocated"),
        ((dict(name="a"), dict(name="b", optimizer=dict(lr=1.0))), "learners.1..optimizer.lr"),
        ((dict(name="a"), dict(name="b/c")), "needs a name of letters"),
    ],
)
def test_bad_learner_settings_are_one_line_errors(learners, match):
    cd = config_lib.to_config_dict(tiny_config())
    cd.trainer.lora.rank = 4
    cd.learners = learners
    with pytest.raises(config_lib.ConfigError, match=match) as e:
        config_lib.from_config_dict(cd)
    assert "\n" not in str(e.value)


def test_learners_across_processes_take_a_block_of_training_processes_each():
    # (the run itself: multicontroller_features_test.py)
    config_lib.check(_cfg(), config_lib.Processes(total=3, generation=1))
    with pytest.raises(config_lib.ConfigError, match="use a multiple of 2 training processes"):
        config_lib.check(_cfg(), config_lib.Processes(total=2, generation=1))


def test_a_learner_is_the_top_level_with_its_own_sections_and_round_trips():
    cfg = _cfg(fast_alpha=8.0)
    grpo, fast = (config_lib.learner_config(cfg, x) for x in cfg.learners)
    # What a learner did not name is the top level's; what it named is its own.
    assert grpo.optimizer == cfg.optimizer and grpo.pipeline == cfg.pipeline
    assert fast.optimizer.learning_rate == 3e-3 and fast.seed == 7
    assert fast.optimizer.b2 == cfg.optimizer.b2 and fast.pipeline.group_size == 2
    assert fast.trainer.lora.rank == cfg.trainer.lora.rank and not fast.learners
    assert fast.trainer.lora.alpha == 8.0 and grpo.trainer.lora == cfg.trainer.lora
    assert config_lib.from_config_dict(config_lib.to_config_dict(cfg)) == cfg


def test_sigterm_stops_every_learner_at_a_checkpointed_boundary(tmp_path):
    cfg = _cfg(steps=8)
    logs = [os.path.join(str(tmp_path), x.name, CONSUMED) for x in cfg.learners]

    def terminate_once_both_trained():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if all(os.path.exists(p) and len(read_consumed(p)) >= 1 for p in logs):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=terminate_once_both_trained, daemon=True)
    killer.start()
    results = learners_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    killer.join(5)
    assert not pipeline_threads()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler uninstalled
    for r in results.values():
        assert r.stopped and 1 <= len(r.steps) < 8 and r.checkpoints[-1] == len(r.steps)
