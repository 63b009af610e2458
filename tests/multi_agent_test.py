"""Multi-agent episodes (pipeline/rollouts/multi_agent.py, environments/solve_verify.py):
seats and their conversations on a simulated engine, one sample per role with its own
tokens trained, per-role group baselines by hand, held-out episodes, the config's
refusals, and runs in one process."""

import numpy as np
import pytest
from support import config_file, engine_turn, pack_small, rollout_context, tiny_config

from streamrl_jax import config as config_lib
from streamrl_jax.config import ConfigError, PipelineSection, Processes
from streamrl_jax.data import sample_seed
from streamrl_jax.environments import EpisodeKit, EpisodeLimits, Services, solve_verify
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.generation.types import (
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
)
from streamrl_jax.pipeline import components
from streamrl_jax.pipeline.micro_batches import Scored, by_role, group_advantages
from streamrl_jax.pipeline.rollouts import Kits, make_rollout
from streamrl_jax.pipeline.schedules import Schedule, VersionGate
from streamrl_jax.rewards.base import RewardResult

TOKENIZER = components.describe_model(tiny_config()).tokenizer
END = TOKENIZER.token_to_id("<|im_end|>")


def _score(text, metadata):
    right = "<answer>4</answer>" in text
    return RewardResult(
        score=float(right), correct=right, extracted_answer="4" if right else None,
        format_ok="<answer>" in text,
    )  # fmt: skip


def _reward(score: float) -> RewardResult:
    return RewardResult(score=score, correct=False, extracted_answer=None, format_ok=False)


def _rollout(group_size=4, **limits):
    env = solve_verify.SolveVerify(Services(tools=None, score=_score))
    lim = {"max_turns": 4, "turn_tokens": 16, "episode_tokens": 400, "prompt_tokens": 256}
    kit = EpisodeKit(env, TurnRenderer(TOKENIZER), EpisodeLimits(**lim | limits), 2, None)
    ctx = rollout_context(group_size=group_size)
    return make_rollout("multi_agent+full", ctx, Kits(episodes=kit))


def _requests(group_size=4, eval_version=None):
    prompt = TOKENIZER.encode_chat(solve_verify.chat_messages("What is 2 + 2?", "s"))
    tag = lambda m: RequestTag(batch=0, group=0, member=m, prompt_id="p", eval_version=eval_version)  # noqa: E731
    return [
        GenerationRequest(
            request_id=f"train/0/0/{m}" if eval_version is None else f"eval/{eval_version}/0",
            prompt=prompt,
            max_new_tokens=16,
            sampling=SamplingParams(temperature=0.7),
            seed=sample_seed(0, 0, 0, m),
            tag=tag(m),
            metadata={"entry": {"question": "What is 2 + 2?", "answer": "4"}, "prompt_id": "p"},
            keep_kv=True,
        )
        for m in range(group_size if eval_version is None else 1)
    ]


def _turn(req: GenerationRequest, text: str) -> Sample:
    """What an engine returns for `req`: `text`'s tokens after its continuation."""
    return engine_turn(req, TOKENIZER.encode(text), END)


def _pack(groups):
    p = PipelineSection(mode="stream_async", staleness=1, max_lag=2)
    stats = {k: [] for k in ("reward", "correct", "format_ok", "length", "truncated", "versions")}
    gate = VersionGate(Schedule.from_config(p), strict=True)
    return pack_small(groups, gate, stats, seq_buckets=(256,))


def _answer(rollout, sample):
    r = rollout.returned(sample)
    assert r.sample is None and r.now == [] and r.later is not None
    return r.later.result(timeout=10)


def _play(rollout, first: GenerationRequest, solver1: str, verifier: str, solver2: str = ""):
    """One episode from its seat-0 request: the solver's answer, the verifier's reply,
    the solver's revision (when rejected); the rollout's last `Returned`."""
    out = _answer(rollout, _turn(first, solver1))
    (ask,) = out.now
    out = _answer(rollout, _turn(ask, verifier))
    if out.sample is None:
        (revise,) = out.now
        out = _answer(rollout, _turn(revise, solver2))
    return out


def test_each_role_plays_in_its_own_conversation_and_is_handed_on_as_its_own_sample():
    rollout = _rollout()
    requests = _requests()
    opened = rollout.open(0, requests)
    assert [q.request_id for q in opened] == ["train/0/0/0", "train/0/0/2"]  # seat 0s
    first = _answer(rollout, _turn(opened[0], "<answer>5</answer>"))
    (ask,) = first.now  # the verifier's conversation starts: its member's tag and seed
    assert ask.request_id == "train/0/0/0/verifier" and ask.continuation is None
    assert (ask.tag.member, ask.seed) == (1, sample_seed(0, 0, 0, 1)) and ask.keep_kv
    shown = TOKENIZER.decode(ask.prompt)
    assert "Proposed answer: <answer>5</answer>" in shown and solve_verify.VERIFIER in shown
    assert solve_verify.decision("Nope. no, yes") == "no" and solve_verify.decision("ok") is None
    rejected = _answer(rollout, _turn(ask, "No, it is <answer>4</answer>"))
    (revise,) = rejected.now  # the solver's own conversation goes on, the critique appended
    assert revise.request_id == "train/0/0/0" and revise.continuation is not None
    env_tokens = TOKENIZER.decode(revise.continuation.tokens[~revise.continuation.policy_mask])
    assert "A checker says your answer is wrong: No, it is <answer>4</answer>" in env_tokens
    end = _answer(rollout, _turn(revise, "<answer>4</answer>"))
    solver, (verifier,) = end.sample, end.also
    assert (solver.metadata["role"], verifier.metadata["role"]) == ("solver", "verifier")
    # the ground truth rewards each: the solver's final answer, the verifier's rejection
    assert solver.metadata["episode"]["return"] == 1.0 and solver.metadata["episode"]["correct"]
    assert verifier.metadata["episode"]["return"] == 1.0
    assert solver.metadata["episode"]["turns"] == 2 and verifier.metadata["episode"]["turns"] == 1
    graph = solver.metadata["turn_graph"]
    assert [t["role"] for t in graph] == ["solver", "verifier", "solver"]
    assert graph == verifier.metadata["turn_graph"] and [t["turn"] for t in graph] == [0, 1, 2]

    # each trains its own sampled tokens only: the other's words are environment tokens
    def mine(s):
        return TOKENIZER.decode(s.response[s.policy_mask], skip_special_tokens=False)

    assert mine(solver) == "<answer>5</answer><|im_end|><answer>4</answer><|im_end|>"
    assert mine(verifier) == "No, it is <answer>4</answer><|im_end|>"
    scored = [Scored(s, "", _reward(1.0)) for s in (solver, verifier)]
    batch = _pack([scored])
    assert int(batch.loss_mask.sum()) == sum(int(s.policy_mask.sum()) for s in (solver, verifier))


def test_a_verifier_that_accepts_ends_the_episode_and_a_wrong_acceptance_earns_nothing():
    rollout = _rollout()
    opened = rollout.open(0, _requests())
    end = _play(rollout, opened[1], "<answer>5</answer>", "Yes, it is.")  # a wrong answer accepted
    solver, (verifier,) = end.sample, end.also
    assert solver.metadata["episode"]["return"] == 0.0
    assert verifier.metadata["episode"]["return"] == 0.0  # it should have rejected
    assert [t["role"] for t in solver.metadata["turn_graph"]] == ["solver", "verifier"]
    # a No to a wrong answer earns only with the right answer (else rejecting everything
    # would pay wherever most answers are wrong)
    other = _rollout()
    end = _play(other, other.open(0, _requests())[0], "<answer>5</answer>", "No, wrong.", "x")
    assert end.also[0].metadata["episode"]["return"] == 0.0
    end = _play(rollout, opened[0], "<answer>4</answer>", "I am not sure")  # no decision
    assert end.also[0].metadata["episode"]["return"] == 0.0
    assert end.sample.metadata["episode"]["return"] == 1.0  # the first answer stands


def test_roles_are_compared_with_the_same_role_of_the_groups_other_episodes():
    # Four seats, two episodes: solver returns (1, 0), verifier returns (0, 1). Each role
    # has its own baseline (group_advantages over that role's samples alone).
    rollout = _rollout()
    opened = rollout.open(0, _requests())
    a = _play(rollout, opened[0], "<answer>4</answer>", "No.", "<answer>4</answer>")
    b = _play(
        rollout, opened[1], "<answer>5</answer>", "No: <answer>4</answer>", "<answer>5</answer>"
    )
    samples = [a.sample, *a.also, b.sample, *b.also]
    group = [Scored(s, "", _reward(s.metadata["episode"]["return"])) for s in samples]
    assert [[x.sample.metadata["role"] for x in g] for g in by_role(group)] == [
        ["solver", "solver"], ["verifier", "verifier"]]  # fmt: skip
    rewards = np.asarray([x.reward.score for x in group], np.float32)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    batch = _pack([group])
    got = [float(batch.advantages[i][batch.loss_mask[i] > 0][0]) for i in range(4)]
    solver = group_advantages("grpo", rewards[[0, 2]], np.asarray([0, 0]), 1)
    verifier = group_advantages("grpo", rewards[[1, 3]], np.asarray([0, 0]), 1)
    np.testing.assert_allclose(got, [solver[0], verifier[0], solver[1], verifier[1]], rtol=1e-6)
    assert got[0] > 0 > got[2] and got[1] < 0 < got[3]


def test_a_held_out_episode_hands_on_its_evaluated_role_and_releases_the_others():
    rollout = _rollout()
    (q,) = _requests(eval_version=3)
    end = _play(rollout, q, "<answer>5</answer>", "No.", "<answer>4</answer>")
    assert end.sample.metadata["role"] == "solver" and end.also == ()
    assert end.sample.metadata["episode"]["correct"]
    assert end.released == ("eval/3/0/verifier",)


def test_a_later_seats_request_that_reached_the_engine_is_dropped_and_released():
    # (a lost generation process's group made again submits every member)
    rollout = _rollout()
    raw = _requests()[1]
    out = rollout.returned(_turn(raw, "anything"))
    assert (out.sample, out.now, out.later, out.release) == (None, [], None, "train/0/0/1")


def test_a_role_that_never_acted_is_handed_on_masked():
    rollout = _rollout(prompt_tokens=8)  # the verifier's first prompt cannot fit
    opened = rollout.open(0, _requests())
    end = _answer(rollout, _turn(opened[0], "<answer>4</answer>"))
    solver, (verifier,) = end.sample, end.also
    assert solver.metadata["episode"]["outcome"] == "context"
    assert verifier.metadata["episode"]["masked"] == "role verifier never acted"
    from streamrl_jax.environments import EpisodeReward

    assert EpisodeReward(_score)("", verifier.metadata).masked == "role verifier never acted"
    assert not verifier.policy_mask.any()


def _multi(**overrides):
    return config_file("configs/multi_agent.py", "tiny", **overrides)


def test_multi_agent_settings_that_do_not_combine_are_refused():
    config_lib.check(_multi(), Processes.one())
    config_lib.check(_multi(), Processes(total=2, generation=1))
    with pytest.raises(ConfigError, match="multi-agent environment .* runs under 'multi_agent'"):
        config_lib.check(_multi(pipeline__rollout="episodes+full"), Processes.one())
    with pytest.raises(ConfigError, match="'multi_agent' needs one"):
        config_lib.check(_multi(environment__name="calculator"), Processes.one())
    with pytest.raises(ConfigError, match="multi-agent episodes run with 'full'"):
        config_lib.check(_multi(pipeline__rollout="multi_agent+dynamic_sampling"),
                         Processes.one())  # fmt: skip
    with pytest.raises(ConfigError, match="group_size=3: a multiple of 'solve_verify'"):
        config_lib.check(_multi(pipeline__group_size=3), Processes.one())
    with pytest.raises(ConfigError, match="no single conversation to demonstrate"):
        config_lib.check(_multi(warmup__steps=1), Processes.one())
    assert config_lib.MULTI_AGENT_ENVIRONMENTS["solve_verify"] == solve_verify.SolveVerify.roles
