"""The episodes rollout (pipeline/rollouts/episodes.py) on a scripted environment and a
simulated engine: turns, the next turn's request, limits and outcomes, metrics, an
environment that raises, held-out episodes; then the packing of an episode (its
environment tokens never trained, its recorded per-token log-probs and versions used)."""

import dataclasses

import numpy as np
import pytest
from support import (
    agent_config,
    assert_whole_episodes,
    engine_turn,
    pack_small,
    pipeline_threads,
    policy_run_lengths,
    rollout_context,
    run_recording,
    tiny_config,
)

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
from streamrl_jax.pipeline.rollouts import Kits, make_rollout
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
        self.ended: list[dict] = []  # states of episodes ended by a limit
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

    def end(self, state):
        self.ended.append(state)


def _kit(env, **limits):
    lim = {"max_turns": 4, "turn_tokens": 8, "episode_tokens": 200} | limits
    return EpisodeKit(env, TurnRenderer(TOKENIZER), EpisodeLimits(**lim), workers=2, tools=None)


def _rollout(env, inner="full", **limits):
    ctx = rollout_context(group_size=2)
    return make_rollout(f"episodes+{inner}", ctx, Kits(episodes=_kit(env, **limits)))


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
    return engine_turn(req, new_tokens, END, reason, version)


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
    # ... and tells the environment (`end`: an OpenEnv session is released)
    env = ScriptedEnv()
    rollout = _rollout(env, **limits)
    sample = _first(reason=reason)
    out = rollout.returned(sample)
    while out.later is not None or out.now:
        if out.later is not None:
            out = out.later.result(timeout=10)
            continue
        out = rollout.returned(_engine_turn(out.now[0], [103]))
    ep = out.sample.metadata["episode"]
    assert (ep["outcome"], ep["turns"]) == (outcome, turns)
    assert env.ended == [{"n": turns - (reason == "context")}]
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


# ------------------------------------------------------- partial rollout of episodes
def _partial(env, **pipeline):
    """episodes+partial: rounds of 4 policy tokens per episode, groups of 2."""
    p = dict(mode="stream_async", partial_budget_tokens=4, max_lag=2) | pipeline
    ctx = rollout_context(group_size=2, rollout="partial", **p)
    return make_rollout("episodes+partial", ctx, Kits(episodes=_kit(env)))


def _first_turns(rollout, max_new_tokens=8):
    """Round 0 opened with one group's two first turns."""
    requests = [
        GenerationRequest(
            request_id=f"train/0/0/{m}",
            prompt=[1, 2, 3],
            max_new_tokens=max_new_tokens,
            sampling=SAMPLING,
            seed=77 + m,
            tag=RequestTag(batch=0, group=0, member=m, prompt_id="p"),
            metadata={"entry": {"question": "q"}, "prompt_id": "p"},
            keep_kv=True,
        )
        for m in range(2)
    ]
    return rollout.open(0, requests)


def _settled(rollout, sample):
    """The rollout's answer to a returned sample, its environment step awaited."""
    out = rollout.returned(sample)
    return out.later.result(timeout=10) if out.later is not None else out


def _by_member(requests):
    return sorted(requests, key=lambda q: q.tag.member)


def test_an_episodes_turns_share_its_round_budget_and_the_rest_is_carried():
    # Budget 4 policy tokens an episode a round. Member 0's first turn (2 tokens) leaves
    # 2: its next turn joins round 0 with a segment of 2; that one leaves none, so the
    # turn after is carried into round 1 (its kept slot given up: it re-prefills there,
    # under that round's weights). Member 1's first turn pauses mid-way at 4 tokens and
    # goes on in round 1. Round 0 closes once both are carried, completing nothing.
    rollout = _partial(ScriptedEnv())
    a, b = _first_turns(rollout)
    assert (a.segment_tokens, a.tag.round, a.keep_kv) == (4, 0, True)
    out = _settled(rollout, _engine_turn(a, [101]))
    (a2,) = out.now
    assert out.release is None and (a2.segment_tokens, a2.tag.round, a2.keep_kv) == (2, 0, True)
    out = _settled(rollout, _engine_turn(a2, [102]))
    assert out.now == [] and out.sample is None and out.release == a.request_id
    out = _settled(rollout, _engine_turn(b, [201, 202, 203, 204], reason="paused"))
    assert out.now == [] and out.sample is None and out.release is None
    assert rollout.inner.wait_round(0, timeout=1) == []
    a3, b2 = _by_member(rollout.open(1, []))
    assert (a3.segment_tokens, a3.tag.round, b2.segment_tokens, b2.tag.round) == (4, 1, 4, 1)
    c = a3.continuation  # member 0's turns so far and the environment's answer
    assert c.policy_tokens == 4 and not c.policy_mask[-1] and a3.max_new_tokens == 4 + 8
    assert a3.keep_kv and b2.keep_kv and b2.max_new_tokens == 8  # b's first turn goes on
    np.testing.assert_array_equal(b2.continuation.tokens, [201, 202, 203, 204])
    whole_a = _settled(rollout, _engine_turn(a3, [103])).sample
    assert whole_a.metadata["episode"]["turns"] == 3
    assert whole_a.metadata["episode"]["outcome"] == "done"
    (b3,) = _settled(rollout, _engine_turn(b2, [205])).now  # b's first turn ends
    assert (b3.tag.round, b3.segment_tokens) == (1, 2)  # 4 - (6 - 4) left in round 1
    out = _settled(rollout, _engine_turn(b3, [206]))
    assert out.release == b.request_id and out.now == []  # carried into round 2
    assert rollout.inner.wait_round(1, timeout=1) == []
    (b4,) = rollout.open(2, [])
    whole_b = _settled(rollout, _engine_turn(b4, [207])).sample
    ep = whole_b.metadata["episode"]
    assert (ep["turns"], ep["return"], ep["tool_calls"], ep["outcome"]) == (3, 1.5, 2, "done")
    assert rollout.inner.wait_round(2, timeout=1) == [(0, 0)]  # the group completes
    for whole in (whole_a, whole_b):
        rollout.scored(Scored(whole, "t", _REWARD))
    metrics = rollout.finish(2).metrics  # counted by the rounds they ended in (1 and 2)
    assert metrics["episode_turns"] == 3.0 and metrics["episode_tool_calls"] == 2.0


def _to_round_two(rollout):
    """Member 0 finishes in round 1; member 1 is carried into round 2 mid-way through
    its second turn. Returns (member 0 whole, member 1's round-1 segment)."""
    a, b = _first_turns(rollout)
    (a2,) = _settled(rollout, _engine_turn(a, [101])).now
    _settled(rollout, _engine_turn(b, [201, 202, 203, 204], reason="paused"))
    _settled(rollout, _engine_turn(a2, [102]))  # carried between turns
    a3, b2 = _by_member(rollout.open(1, []))
    whole_a = _settled(rollout, _engine_turn(a3, [103])).sample
    (b3,) = _settled(rollout, _engine_turn(b2, [205])).now
    _settled(rollout, _engine_turn(b3, [206, 207], reason="paused"))
    assert rollout.inner.wait_round(1, timeout=1) == []
    return whole_a, b3


def _finish_member_one(rollout):
    (b4,) = rollout.open(2, [])
    (b5,) = _settled(rollout, _engine_turn(b4, [208])).now  # the environment's 2nd answer
    return b4, _settled(rollout, _engine_turn(b5, [209])).sample


def test_episodes_in_flight_round_trip_through_a_checkpoint():
    # The checkpoint at 2 holds member 0 whole (its group incomplete) and member 1
    # carried mid-turn with its environment's state and counters as of then. A fresh
    # rollout restored from its JSON continues member 1 in round 2, the new environment
    # answers from the restored state, and the episode ends as the uninterrupted one.
    import json

    env = ScriptedEnv()
    rollout = _partial(env)
    whole_a, b3 = _to_round_two(rollout)
    state = json.loads(json.dumps(rollout.state(2)))
    assert [x["request_id"] for x in state["finished"]] == [whole_a.request_id]
    ((rid, record),) = state["episodes"]
    assert rid == b3.request_id and record["turns"] == 1 and record["state"] == {"n": 1}
    b4, ref = _finish_member_one(rollout)

    fresh, env2 = None, ScriptedEnv()
    fresh = _partial(env2)
    (again,) = fresh.restore(2, state)
    np.testing.assert_array_equal(again.response, whole_a.response)
    np.testing.assert_array_equal(again.policy_mask, whole_a.policy_mask)
    assert again.metadata["episode"] == whole_a.metadata["episode"]
    b4_again, whole_b = _finish_member_one(fresh)
    assert (b4_again.max_new_tokens, b4_again.keep_kv) == (b4.max_new_tokens, True)
    assert b4_again.metadata == b4.metadata  # the task's (an environment scores with it)
    assert b4_again.continuation.policy_mask.tolist() == b4.continuation.policy_mask.tolist()
    assert env2.messages == env.messages[-2:]  # the restored state's turns only
    for field in ("response", "logprobs", "policy_mask", "token_versions"):
        np.testing.assert_array_equal(getattr(whole_b, field), getattr(ref, field))
    assert whole_b.metadata["episode"] == ref.metadata["episode"]
    assert ref.metadata["episode"]["turns"] == 3 and ref.metadata["episode"]["return"] == 1.5
    assert fresh.inner.wait_round(2, timeout=1) == [(0, 0)]


def test_an_episode_past_the_lag_bound_is_handed_on_to_be_dropped_with_its_outcome():
    # max_lag 2: member 1 (version 0) pauses in rounds 0 and 1, ends its turn in round 2
    # with the round's budget spent: round 3 would train it at lag 3, so it is handed on
    # as its turn ended (finish reason "paused": pack_groups drops its group, counted),
    # its outcome "lag", and its group completes in round 2.
    from streamrl_jax.distributed import wire

    rollout = _partial(ScriptedEnv())
    a, b = _first_turns(rollout, max_new_tokens=16)
    assert _settled(rollout, _engine_turn(a, [101, 102], reason="context")).sample is not None
    _settled(rollout, _engine_turn(b, [201, 202, 203, 204], reason="paused"))
    (b2,) = rollout.open(1, [])
    _settled(rollout, _engine_turn(b2, [205, 206, 207, 208], reason="paused"))
    (b3,) = rollout.open(2, [])
    out = _settled(rollout, _engine_turn(b3, [209, 210, 211]))
    dropped = out.sample
    assert out.release == b.request_id and dropped.finish_reason == "paused"
    ep = dropped.metadata["episode"]
    assert (ep["outcome"], ep["turns"], ep["return"]) == ("lag", 1, 0.25)
    assert dropped.response[-1] == END and ep["env_tokens"] == 0  # as the turn ended
    assert rollout.inner.wait_round(2, timeout=1) == [(0, 0)] and rollout.inner.dropped == 1
    back = wire.decode(wire.encode(dropped), source="generation-0")
    assert back.metadata["episode"] == ep


class _SetState(ScriptedEnv):
    def start(self, question, metadata):
        return _Start({"n": 0, "seen": {1, 2}})


def test_an_environment_state_that_is_not_json_fails_naming_it_when_carried():
    rollout = _partial(_SetState())
    _, b = _first_turns(rollout)
    with pytest.raises(ValueError, match=r"environment 'scripted': episode 'train/0/0/1'"):
        rollout.returned(_engine_turn(b, [201, 202, 203, 204], reason="paused"))


def test_episodes_with_partial_rollout_drop_past_the_lag_bound_never_regenerate():
    from streamrl_jax.errors import UserError

    partial = dict(
        pipeline__rollout="episodes+partial",
        pipeline__mode="stream_async",
        pipeline__partial_budget_tokens=16,
        pipeline__max_lag=3,
    )
    agent_config(**partial, pipeline__lag_policy="drop")  # valid
    with pytest.raises(UserError, match="needs pipeline.lag_policy='drop'"):
        agent_config(**partial, pipeline__lag_policy="regenerate")


# ---------------------------------------------------------------------- whole runs
def _retry(**overrides):
    base = dict(environment__name="retry", environment__max_attempts=3, eval__num_problems=2)
    return agent_config(**(base | overrides))


def test_an_episodes_run_trains_multi_turn_episodes_and_continues_slots_in_place(tmp_path):
    # The retry environment (3 attempts; the tiny model is never right) with the tiny
    # model, whose turns are cut at 16 tokens: every episode has 3 policy turns, 2
    # environment turns between them; each next turn extends its slot's KV in place.
    # One decode shape (`pipeline.deterministic`): the engine's programs are those of
    # endpoint_test.py's and agents_test.py's (the compacted decode is engine_test.py's).
    cfg = _retry(pipeline__mode="stream_sync", pipeline__deterministic=True)
    result, seen = run_recording(cfg, tmp_path)
    train = [s for s in seen if not s.tag.is_eval]
    held_out = [s for s in seen if s.tag.is_eval]
    p = cfg.pipeline
    assert len(train) == p.steps * p.prompts_per_step * p.group_size
    assert len(held_out) == 2 * 2  # two evaluations of two problems, episodes too
    assert_whole_episodes(train + held_out, turns=3, turn_tokens=16)
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
    result, seen = run_recording(cfg, tmp_path)
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
    cfg = _retry(
        pipeline__mode="stream_async",
        pipeline__steps=4,
        pipeline__deterministic=True,
        checkpoint__every=1,
        checkpoint__keep=10,
        eval__num_problems=0,
    )
    ref = _killed_and_resumed_equals_uninterrupted(cfg, tmp_path, dies_on=3, resumed_at=1)
    assert any(r["grad_norm"] > 0 for r in ref.steps)  # the episodes' rewards differ


def _killed_and_resumed_equals_uninterrupted(cfg, tmp_path, dies_on, resumed_at):
    """Runs `cfg` through; runs it again with the trainer dying on its `dies_on`-th
    micro-batch, then resumed: the same parameters bit for bit, every prompt trained
    once. Returns the uninterrupted run's result."""
    from support import consumed_log, param_arrays, trainer_dies_on_call

    from streamrl_jax import pipeline as run_lib

    ref_dir, workdir = tmp_path / "ref", tmp_path / "run"
    ref = run_lib.run(cfg, str(ref_dir), reward_fn=vowel_reward)
    with trainer_dies_on_call(dies_on), pytest.raises(RuntimeError, match="trainer died"):
        run_lib.run(cfg, str(workdir), reward_fn=vowel_reward)
    assert not pipeline_threads()
    result = run_lib.run(cfg, str(workdir), reward_fn=vowel_reward)
    assert result.start_batch >= resumed_at
    for a, b in zip(param_arrays(result), param_arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    steps, counts = consumed_log(str(workdir))
    ref_steps, ref_counts = consumed_log(str(ref_dir))
    assert steps == ref_steps == list(range(cfg.pipeline.steps))
    assert counts == ref_counts and set(counts.values()) == {1}
    return ref


def _partial_run(budget, max_lag, steps, **overrides):
    """The retry environment (3 turns of 16 tokens an episode) in rounds of `budget`."""
    return _retry(
        pipeline__mode="stream_async",
        pipeline__rollout="episodes+partial",
        pipeline__partial_budget_tokens=budget,
        pipeline__max_lag=max_lag,
        pipeline__steps=steps,
        eval__num_problems=0,
        **overrides,
    )


def test_episodes_in_rounds_pause_mid_turn_extend_within_a_round_and_train_once(tmp_path):
    # Rounds of 12 policy tokens, turns of 16: an episode's first turn pauses at 12 and
    # ends in the next round, whose budget its second turn continues in place (KV
    # extended) until it pauses too; the episode ends in its 4th round (lag 4 = max_lag),
    # so steps 0-2 train nothing and step 3 trains batch 0's episodes whole.
    # Deterministic (one decode shape, micro-batches of consecutive groups): the trainer's
    # and the engine's programs are those of the run above.
    cfg = _partial_run(12, 4, 4, pipeline__deterministic=True)
    result, seen = run_recording(cfg, tmp_path)
    from support import consumed_log

    for s in seen:
        ep = s.metadata["episode"]
        assert s.finish_reason != "paused" and (ep["turns"], ep["outcome"]) == (3, "done")
        assert policy_run_lengths(s.policy_mask) == [16, 16, 16]
        v = s.policy_versions()
        assert np.all(np.diff(v) >= 0) and v[-1] - v[0] >= 1  # the rounds' weights
    rows = result.steps
    assert [r["optimizer_steps"] > 0 for r in rows] == [False] * 3 + [True]
    assert sum(r["kv_extended"] for r in rows) > 0 and sum(r["kv_reprefilled"] for r in rows) > 0
    assert max(r["carried_paused"] for r in rows) > 0 and sum(r["dropped_lag"] for r in rows) == 0
    assert max(r["lag_max"] for r in rows if r["optimizer_steps"]) <= 4.0
    steps, counts = consumed_log(str(tmp_path))
    assert set(counts.values()) == {1} and len(counts) == cfg.pipeline.prompts_per_step
    assert not pipeline_threads()


@pytest.mark.extended  # ~1 min
def test_a_kill_with_episodes_carried_between_rounds_resumes_exactly(tmp_path):
    # Rounds of 16 tokens, turns of 16: every turn ends with its round's budget spent, so
    # each next turn is carried into the next round (its kept slot given up; it
    # re-prefills there) with its environment's state. Deterministic, a checkpoint each
    # step; the trainer dies on its 2nd micro-batch with episodes carried: the resumed
    # run takes them (tokens, log-probs, versions, environment state, counters) from the
    # checkpoint and ends with the uninterrupted run's parameters bit for bit, every
    # prompt trained once.

    cfg = _partial_run(
        16, 3, 5, pipeline__deterministic=True, checkpoint__every=1, checkpoint__keep=10
    )
    ref = _killed_and_resumed_equals_uninterrupted(cfg, tmp_path, dies_on=2, resumed_at=2)
    assert sum(r["optimizer_steps"] for r in ref.steps) >= 2
    assert sum(r["kv_reprefilled"] for r in ref.steps) > 0


def test_episodes_wrap_dynamic_sampling_which_judges_whole_episodes():
    # episodes+dynamic_sampling: the kind sees each episode whole; a group whose
    # episodes all scored the same is skipped (no reward variance), as for single turns.
    from streamrl_jax.pipeline.rollouts.dynamic_sampling import DynamicSampling

    ctx = rollout_context(group_size=2, rollout="dynamic_sampling")
    rollout = make_rollout("episodes+dynamic_sampling", ctx, Kits(episodes=_kit(ScriptedEnv())))
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
