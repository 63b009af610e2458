"""The episodes rollout (pipeline/rollouts/episodes.py) on a scripted environment and a
simulated engine: turns, the next turn's request, limits and outcomes, metrics, an
environment that raises, held-out episodes; then the packing of an episode (its
environment tokens never trained, its recorded per-token log-probs and versions used)."""

import dataclasses

import numpy as np
import pytest
from support import agent_config, pack_small, pipeline_threads, rollout_context, tiny_config

from streamrl_jax.config import PipelineSection
from streamrl_jax.environments import EpisodeKit, EpisodeLimits, StepResult, TurnInfo
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.generation.types import (
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.pipeline import components
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.rollouts import make_rollout
from streamrl_jax.pipeline.schedules import Schedule, VersionGate
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.vowels import vowel_reward

TOKENIZER = components.describe_model(tiny_config()).tokenizer
END = TOKENIZER.token_to_id("<|im_end|>")
SAMPLING = SamplingParams(temperature=0.7)
_REWARD = RewardResult(score=1.0, correct=True, extracted_answer="42", format_ok=True)


class _Start:
    def __init__(self, state):
        self.state, self.messages = state, []


class ScriptedEnv:
    """Two tool turns (reward 0.25 each), then done (reward 1); records the messages."""

    name = "scripted"

    def __init__(self, raise_at: int = -1):
        self.messages: list[str] = []
        self.raise_at = raise_at

    def start(self, question, metadata):
        return _Start({"n": 0})

    def step(self, state, message, metadata):
        self.messages.append(message)
        n = state["n"]
        if n == self.raise_at:
            raise KeyError("scripted bug")
        if n < 2:
            obs = [{"role": "tool", "content": f"obs{n}"}]
            return StepResult(obs, 0.25, False, {"n": n + 1}, TurnInfo(tool_calls=1))
        info = TurnInfo(answered=True, correct=True, format_ok=True, answer="42")
        return StepResult([], 1.0, True, {"n": n + 1}, info)


def _kit(env, **limits):
    lim = {"max_turns": 4, "turn_tokens": 8, "episode_tokens": 200} | limits
    return EpisodeKit(env, TurnRenderer(TOKENIZER), EpisodeLimits(**lim), workers=2, tools=None)


def _rollout(env, inner="full", **limits):
    ctx = rollout_context(group_size=2)
    return make_rollout(f"episodes+{inner}", dataclasses.replace(ctx, episodes=_kit(env, **limits)))


def _first(member=0, tokens=(101, 102), reason="stop", eval_version=None, version=0):
    response = [*tokens, END] if reason == "stop" else list(tokens)
    n = len(response)
    return Sample(
        request_id=f"train/0/0/{member}",
        prompt=np.asarray([1, 2, 3], np.int32),
        response=np.asarray(response, np.int32),
        logprobs=np.full(n, -0.5, np.float32),
        sampling_logprobs=np.full(n, -0.4, np.float32),
        finish_reason=reason,
        policy_version=version,
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=1.0, finish=2.0),
        tag=RequestTag(batch=0, group=0, member=member, eval_version=eval_version),
        metadata={"entry": {"question": "q"}, "prompt_id": "p"},
        token_versions=np.full(n, version, np.int32),
        sampling=SAMPLING,
        seed=77 + member,
    )


def _engine_turn(req: GenerationRequest, new_tokens, reason="stop", version=0) -> Sample:
    """What the engine returns for a turn request: its continuation, then `new_tokens`."""
    c = req.continuation
    new = [*new_tokens, END] if reason == "stop" else list(new_tokens)
    k = len(new)
    return Sample(
        request_id=req.request_id,
        prompt=np.asarray(req.prompt, np.int32),
        response=np.concatenate([c.tokens, np.asarray(new, np.int32)]),
        logprobs=np.concatenate([c.logprobs, np.full(k, -0.3, np.float32)]),
        sampling_logprobs=np.concatenate([c.sampling_logprobs, np.full(k, -0.2, np.float32)]),
        finish_reason=reason,
        policy_version=int(c.versions[0]),
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=c.admit, finish=3.0),
        tag=req.tag,
        metadata=req.metadata,
        token_versions=np.concatenate([c.versions, np.full(k, version, np.int32)]),
        policy_mask=np.concatenate([c.policy_mask, np.ones(k, bool)]),
        sampling=req.sampling,
        seed=req.seed,
    )


def _next(rollout, sample):
    """The rollout's answer to a returned turn, once its environment step is done."""
    r = rollout.returned(sample)
    assert r.sample is None and r.now == [] and r.later is not None
    return r.later.result(timeout=10)


def test_an_episode_runs_turn_by_turn_and_is_handed_on_whole():
    env = ScriptedEnv()
    rollout = _rollout(env)
    sample = _first()
    out = _next(rollout, sample)
    (req,) = out.now
    assert out.sample is None and req.keep_kv and req.request_id == sample.request_id
    assert (req.seed, req.sampling, req.tag) == (sample.seed, sample.sampling, sample.tag)
    c = req.continuation
    env_tokens = TOKENIZER.decode(c.tokens[3:], skip_special_tokens=False)
    assert env_tokens == "\n<|im_start|>tool\nobs0<|im_end|>\n<|im_start|>assistant\n"
    np.testing.assert_array_equal(c.tokens[:3], sample.response)
    assert c.policy_mask.tolist() == [True] * 3 + [False] * (len(c.tokens) - 3)
    assert c.policy_tokens == 3 and req.max_new_tokens == 3 + 8  # the turn's own cap
    np.testing.assert_array_equal(c.logprobs[3:], 0.0)
    second = _engine_turn(req, [103])
    (req2,) = _next(rollout, second).now
    third = _engine_turn(req2, [104, 105])
    final = rollout.returned(third).later.result(timeout=10)
    whole = final.sample
    assert final.now == [] and whole is not None
    turns = [[101, 102], [103], [104, 105]]
    assert env.messages == [TOKENIZER.decode(t) for t in turns]
    ep = whole.metadata["episode"]
    assert ep["return"] == 1.5 and ep["turns"] == 3 and ep["tool_calls"] == 2
    assert ep["outcome"] == "done" and ep["correct"] and ep["answer"] == "42"
    assert ep["env_tokens"] == int((~whole.policy_mask).sum()) > 0
    assert whole.policy_mask[-1] and whole.response[-1] == END  # ends on the policy's turn
    assert whole.num_tokens == len(third.response)
    rollout.scored(Scored(whole, "t", _REWARD))  # counted where it is trained
    metrics = rollout.finish(0).metrics
    assert metrics["episode_turns"] == 3.0 and metrics["episode_tool_call_rate"] == 1.0
    assert metrics["episode_truncated"] == 0.0


@pytest.mark.parametrize(
    "limits,reason,outcome,turns",
    [({"max_turns": 2}, "stop", "turn_limit", 2), ({"episode_tokens": 12}, "stop",
      "episode_tokens", 1), ({}, "context", "context", 1)],
)  # fmt: skip
def test_a_limit_ends_the_episode_with_its_outcome(limits, reason, outcome, turns):
    rollout = _rollout(ScriptedEnv(), **limits)
    sample = _first(reason=reason)
    out = rollout.returned(sample)
    while out.later is not None or out.now:
        if out.later is not None:
            out = out.later.result(timeout=10)
            continue
        out = rollout.returned(_engine_turn(out.now[0], [103]))
    ep = out.sample.metadata["episode"]
    assert (ep["outcome"], ep["turns"]) == (outcome, turns)
    rollout.scored(Scored(out.sample, "t", _REWARD))
    assert rollout.finish(0).metrics["episode_truncated"] == 1.0


def test_a_cut_turn_still_reaches_the_environment_with_the_templates_closing():
    rollout = _rollout(ScriptedEnv())
    (req,) = _next(rollout, _first(tokens=(101, 102, 103), reason="length")).now
    text = TOKENIZER.decode(req.continuation.tokens[3:], skip_special_tokens=False)
    assert text.startswith("<|im_end|>\n<|im_start|>tool\nobs0")


def test_an_environment_that_raises_fails_naming_it_and_the_episode():
    rollout = _rollout(ScriptedEnv(raise_at=0))
    with pytest.raises(RuntimeError, match=r"environment 'scripted': episode 'train/0/0/0'"):
        rollout.returned(_first()).later.result(timeout=10)


def test_held_out_episodes_are_handed_on_whole_and_not_counted_in_training():
    rollout = _rollout(ScriptedEnv(), max_turns=1)
    out = rollout.returned(_first(eval_version=3)).later.result(timeout=10)
    assert out.sample.metadata["episode"]["outcome"] == "turn_limit"
    assert rollout.finish(0).metrics == {}


def test_an_episode_trains_its_policy_tokens_with_their_recorded_logprobs_and_versions():
    # An episode spanning two weight versions (in-flight: its second turn ran on W_1):
    # its lag is the oldest *policy* token's; its behaviour log-probs are the recorded
    # per-token ones at its policy columns; the environment's columns are not trained.
    rollout = _rollout(ScriptedEnv())
    (req,) = _next(rollout, _first(version=0)).now
    second = _engine_turn(req, [103, 104], version=1)
    assert second.oldest_version == 0 and second.newest_version == 1
    env = ~second.policy_mask
    second = dataclasses.replace(
        second, token_versions=np.where(env, 7, second.token_versions)
    )  # an environment token's version never counts toward the lag
    assert (second.oldest_version, second.newest_version) == (0, 1)
    reward = RewardResult(score=1.0, correct=True, extracted_answer="1", format_ok=True)
    other = dataclasses.replace(second, tag=dataclasses.replace(second.tag, member=1))
    wrong = dataclasses.replace(reward, score=0.0, correct=False)
    groups = [[Scored(second, "t", reward), Scored(other, "t", wrong)]]
    p = PipelineSection(mode="stream_async", staleness=1, max_lag=2, weight_update="inflight")
    stats: dict[str, list] = {k: [] for k in ("reward", "correct", "format_ok", "length")}
    stats.update(truncated=[], versions=[])
    batch = pack_small(
        groups, VersionGate(Schedule.from_config(p), strict=True), stats, seq_buckets=(64,)
    )
    row = 0
    p_len = len(second.prompt)
    cols = np.arange(p_len - 1, p_len - 1 + second.num_tokens)
    np.testing.assert_array_equal(batch.loss_mask[row, cols], second.policy_mask)
    np.testing.assert_array_equal(
        batch.behaviour_logp[row, cols][second.policy_mask], second.logprobs[second.policy_mask]
    )
    assert stats["versions"] == [0, 0] and stats["spans"] == [1.0, 1.0]


# ---------------------------------------------------------------------- whole runs
def _run_recording(cfg, workdir, **kw):
    """Runs `cfg`; returns the result and every sample handed to ingest."""
    from unittest import mock

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.pipeline.ingest import Ingest

    seen, on_sample = [], Ingest.on_sample

    def record(self, sample, *args, **kwargs):
        seen.append(sample)
        return on_sample(self, sample, *args, **kwargs)

    with mock.patch.object(Ingest, "on_sample", record):
        return run_lib.run(cfg, str(workdir), reward_fn=vowel_reward, **kw), seen


def _retry(**overrides):
    base = dict(environment__name="retry", environment__max_attempts=3, eval__num_problems=2)
    return agent_config(**(base | overrides))


def _turn_spans(mask):
    """[(start, end)] of the policy's runs of tokens."""
    edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(int), 0]))
    return list(zip(edges[::2], edges[1::2], strict=True))


def test_an_episodes_run_trains_multi_turn_episodes_and_continues_slots_in_place(tmp_path):
    # The retry environment (3 attempts; the tiny model is never right) with the tiny
    # model, whose turns are cut at 16 tokens: every episode has 3 policy turns, 2
    # environment turns between them; each next turn extends its slot's KV in place.
    cfg = _retry(pipeline__mode="stream_sync")
    result, seen = _run_recording(cfg, tmp_path)
    train = [s for s in seen if not s.tag.is_eval]
    held_out = [s for s in seen if s.tag.is_eval]
    p = cfg.pipeline
    assert len(train) == p.steps * p.prompts_per_step * p.group_size
    assert len(held_out) == 2 * 2  # two evaluations of two problems, episodes too
    for s in train + held_out:
        ep = s.metadata["episode"]
        assert ep["turns"] == 3 and ep["outcome"] == "done", ep
        spans = _turn_spans(s.policy_mask)
        assert len(spans) == 3 and all(b - a == 16 for a, b in spans)
        assert ep["env_tokens"] == int((~s.policy_mask).sum()) > 0
        np.testing.assert_array_equal(s.logprobs[~s.policy_mask], 0.0)
    rows = result.steps
    assert sum(r["kv_extended"] for r in rows) >= 2 * len(train)
    assert sum(r["kv_reprefilled"] for r in rows) == 0
    assert all(r["episode_turns"] == 3.0 for r in rows)
    assert all(e["turns"] == 3.0 for e in result.evals.values())
    assert not pipeline_threads()


@pytest.mark.extended  # ~30 s; engine_test holds a two-version episode in the default suite
def test_episodes_span_weight_versions_in_flight_within_the_bound(tmp_path):
    # stream_async with in-flight updates: an episode's later turns may run on newer
    # weights (whether one does here depends on timing; engine_test holds a two-version
    # episode); every policy token keeps its version, the lag is the oldest one's.
    cfg = _retry(
        pipeline__mode="stream_async",
        pipeline__weight_update="inflight",
        pipeline__steps=3,
        eval__num_problems=0,
    )
    result, seen = _run_recording(cfg, tmp_path)
    for s in seen:
        v = s.policy_versions()
        assert np.all(np.diff(v) >= 0) and v[0] == max(0, s.tag.batch - 1)
        assert v[-1] <= s.tag.batch
    assert all(r["lag_max"] <= 1.0 and r["dropped_stale"] == 0.0 for r in result.steps)
    assert not pipeline_threads()


@pytest.mark.extended  # ~1 min: the default suite keeps one episodes run
def test_a_kill_with_episodes_in_flight_resumes_exactly(tmp_path):
    # Deterministic stream_async with the retry environment (3 turns an episode), a
    # checkpoint every step. The trainer dies on its 3rd micro-batch while batch 1's and
    # batch 2's episodes are in flight (mid-turn, waiting for the environment or kept in
    # their slots); the resumed run regenerates them from their first turn (same seeds,
    # the restored weights, a deterministic environment) and ends with the
    # uninterrupted run's parameters bit for bit, every prompt trained once.
    from support import consumed_log, param_arrays, trainer_dies_on_call

    from streamrl_jax import pipeline as run_lib

    cfg = _retry(
        pipeline__mode="stream_async",
        pipeline__steps=4,
        pipeline__deterministic=True,
        checkpoint__every=1,
        checkpoint__keep=10,
        eval__num_problems=0,
    )
    ref_dir, workdir = tmp_path / "ref", tmp_path / "run"
    ref = run_lib.run(cfg, str(ref_dir), reward_fn=vowel_reward)
    assert any(r["grad_norm"] > 0 for r in ref.steps)  # the episodes' rewards differ
    with trainer_dies_on_call(3), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(cfg, str(workdir), reward_fn=vowel_reward)
    assert not pipeline_threads()
    result = run_lib.run(cfg, str(workdir), reward_fn=vowel_reward)
    assert result.start_batch >= 1
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(str(workdir))
    ref_steps, ref_counts = consumed_log(str(ref_dir))
    assert steps == ref_steps == list(range(4))
    assert counts == ref_counts and set(counts.values()) == {1}


def test_episodes_wrap_dynamic_sampling_which_judges_whole_episodes():
    # episodes+dynamic_sampling: the kind sees each episode whole; a group whose
    # episodes all scored the same is skipped (no reward variance), as for single turns.
    from streamrl_jax.pipeline.rollouts.dynamic_sampling import DynamicSampling

    ctx = rollout_context(group_size=2, rollout="dynamic_sampling")
    rollout = make_rollout(
        "episodes+dynamic_sampling", dataclasses.replace(ctx, episodes=_kit(ScriptedEnv()))
    )
    assert isinstance(rollout.inner, DynamicSampling)
    wrong = dataclasses.replace(_REWARD, score=0.0, correct=False)
    for group, rewards in ((0, (_REWARD, _REWARD)), (1, (_REWARD, wrong))):
        for member, reward in enumerate(rewards):
            first = _first(member=member, reason="context")  # the episode ends at once
            first = dataclasses.replace(first, tag=dataclasses.replace(first.tag, group=group))
            out = rollout.returned(first)
            assert out.sample is not None and out.sample.metadata["episode"]["turns"] == 1
            rollout.scored(Scored(out.sample, "t", reward))
    # Group 0 (equal returns) is skipped; group 1 reaches the trainer.
    assert ctx.stream.depth()["ready_groups"] == 1
