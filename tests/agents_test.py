"""The agents rollout (pipeline/rollouts/agents.py): training episodes played by a
scaffold through the run's OpenAI-compatible endpoint, with the official `openai`
client, trained on the tokens the endpoint recorded."""

from unittest import mock

import numpy as np
import pytest
from support import (
    agent_config,
    assert_whole_episodes,
    pipeline_threads,
    policy_run_lengths,
    run_recording,
)

from streamrl_jax import pipeline as run_lib
from streamrl_jax.endpoint import scaffolds
from streamrl_jax.rewards.vowels import vowel_reward


def _retry(**overrides):
    # One decode shape (`pipeline.deterministic`, what endpoint_test.py's engine and
    # episodes_test.py's run decode with: their programs; the compacted decode is
    # engine_test.py's). The in-flight run (extended) cannot be deterministic.
    inflight = overrides.get("pipeline__weight_update") == "inflight"
    base = dict(
        environment__name="retry",
        environment__max_attempts=3,
        pipeline__rollout="agents+full",
        pipeline__deterministic=not inflight,
        eval__num_problems=2,
    )
    return agent_config(**(base | overrides))


def test_an_agents_run_trains_the_episodes_its_scaffolds_played_through_the_endpoint(tmp_path):
    # The retry environment (3 attempts) played through the endpoint by its scaffold:
    # every trained episode is the endpoint's record (3 policy turns of 16 tokens, the
    # template's tokens around the scaffold's messages never trained), each next turn
    # extends its slot's KV in place; held-out episodes run in-process.
    cfg = _retry(pipeline__mode="stream_sync")
    played = []
    real = scaffolds.environment_scaffold

    def counting(*args, **kwargs):
        play = real(*args, **kwargs)

        def counted(task, client):
            played.append(client.default_headers["x-episode-id"])
            return play(task, client)

        return counted

    with mock.patch("streamrl_jax.pipeline.parts.environment_scaffold", counting):
        result, seen = run_recording(cfg, tmp_path)
    p = cfg.pipeline
    train = [s for s in seen if not s.tag.is_eval]
    assert len(train) == len(played) == p.steps * p.prompts_per_step * p.group_size
    assert len(set(played)) == len(played)  # an endpoint episode each
    assert_whole_episodes(seen, turns=3, turn_tokens=16)
    rows = result.steps
    assert sum(r["kv_extended"] for r in rows) >= 2 * len(train)
    assert sum(r["kv_reprefilled"] for r in rows) == 0
    assert all(r["episode_turns"] == 3.0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    assert not pipeline_threads()


def test_a_group_scaffold_under_the_episode_budget_trains_what_the_episodes_run_trains(tmp_path):
    # Two features of scaffolds' episodes against the in-process episodes run (one pair of
    # runs for both):
    # * environment.scaffold="environment_group": one scaffold plays a prompt's G
    #   episodes, their first turns one request with n=G on the group's first episode,
    #   each choice one of the run's registered episodes (its id, seed, record); the
    #   engine prefills each group's prompt once and forks it to the other members, as
    #   in-process episodes do.
    # * the retry environment (4 attempts) under an episode budget that runs out in the
    #   third turn: in-process, that turn gets what is left of
    #   environment.max_episode_tokens (5 of its 16 tokens) and the episode ends
    #   "episode_tokens" after the environment's answer; through the endpoint (the run's
    #   Limits.episode_tokens) the scaffold's turn is cut there too and its next request
    #   refused.
    # So both train the same episodes (by their run identity) token for token: prompts,
    # tokens, log-probs (float32, bitwise), masks, versions, outcomes, and the same rewards.
    from streamrl_jax.endpoint.backend import PipelineBackend
    from streamrl_jax.generation.admission import PromptSources

    runs = {}
    for rollout in ("episodes+full", "agents+full"):
        scaffold = {"environment__scaffold": "environment_group"} if "agents" in rollout else {}
        cfg = _retry(pipeline__rollout=rollout, pipeline__mode="stream_sync",
                     pipeline__steps=1, eval__num_problems=0, environment__max_attempts=4,
                     environment__max_episode_tokens=16 + 19 + 16 + 19 + 5, **scaffold)  # fmt: skip
        asked, forks = [], []
        choices, plan = PipelineBackend.choices, PromptSources.plan

        def spied_choices(self, eid, n, fresh, asked=asked, real=choices):
            asked.append(n)
            return real(self, eid, n, fresh)

        def spied_plan(self, take, forks=forks, real=plan):
            prefill, forked = real(self, take)
            forks.extend(q.request_id for _, q, _ in forked)
            return prefill, forked

        with (
            mock.patch.object(PipelineBackend, "choices", spied_choices),
            mock.patch.object(PromptSources, "plan", spied_plan),
        ):
            result, seen = run_recording(cfg, tmp_path / rollout.split("+")[0])
        runs[rollout] = result, seen, asked, forks
    p = cfg.pipeline
    groups = p.steps * p.prompts_per_step
    (r1, seen1, asked1, forks1), (r2, seen2, asked2, forks2) = runs.values()
    assert asked1 == [] and asked2 == [p.group_size] * groups
    assert len(forks1) == len(forks2) == groups * (p.group_size - 1)
    assert sorted(forks1) == sorted(forks2)  # the same members forked

    def by_identity(seen):
        return {(s.tag.batch, s.tag.group, s.tag.member): s for s in seen}

    one, grouped = by_identity(seen1), by_identity(seen2)
    assert len(one) == len(seen1) == groups * p.group_size and one.keys() == grouped.keys()
    for key, a in one.items():
        b = grouped[key]
        # the budget bit: 16 + 19 + 16 + 19 tokens, then a third turn of 5
        assert policy_run_lengths(a.policy_mask) == [16, 16, 5]
        assert a.metadata["episode"]["outcome"] == "episode_tokens"
        np.testing.assert_array_equal(a.prompt, b.prompt)
        np.testing.assert_array_equal(a.response, b.response)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.policy_mask, b.policy_mask)
        np.testing.assert_array_equal(a.versions(), b.versions())
        keys = ("outcome", "turns", "env_tokens", "cut_turns")
        assert {k: b.metadata["episode"][k] for k in keys} == {
            k: a.metadata["episode"][k] for k in keys
        }
    assert [r["reward"] for r in r1.steps] == [r["reward"] for r in r2.steps]
    assert not pipeline_threads()


def test_a_scaffold_that_raises_fails_the_run_naming_the_episode(tmp_path):
    def broken(*args, **kwargs):
        def play(task, client):
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            raise KeyError("scaffold bug")

        return play

    cfg = _retry(pipeline__mode="stream_sync", eval__num_problems=0)
    with (
        mock.patch("streamrl_jax.pipeline.parts.environment_scaffold", broken),
        pytest.raises(Exception, match=r"agent scaffold: episode train/0/\d+/\d+ .*scaffold bug"),
    ):
        run_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    assert not pipeline_threads()


@pytest.mark.parametrize(
    "rollout,extra,message",
    [
        ("agents+partial", dict(pipeline__mode="stream_async", pipeline__partial_budget_tokens=8,
                                pipeline__max_lag=3, pipeline__lag_policy="drop"),
         "run with 'full' or 'dynamic_sampling'"),
        ("episodes+agents+full", {}, "through the endpoint.. not both"),
    ],
)  # fmt: skip
def test_what_scaffolds_episodes_cannot_run_with_is_refused_by_name(rollout, extra, message):
    from streamrl_jax.errors import UserError

    with pytest.raises(UserError, match=message):
        agent_config(pipeline__rollout=rollout, **extra)


def test_scaffolds_across_processes_pass_the_start_up_check():
    # Each generation process serves its own endpoint (multicontroller_test runs it).
    from streamrl_jax import config as config_lib
    from streamrl_jax.config.rules import Processes

    cfg = _retry(pipeline__mode="stream_async")
    for total, generation in ((2, 1), (3, 2), (4, 2)):
        config_lib.check(cfg, Processes(total=total, generation=generation))


@pytest.mark.extended  # ~20 s: the default suite keeps the stream_sync run above
def test_what_trains_is_bitwise_what_the_scaffold_was_returned(tmp_path):
    # stream_async with in-flight weight updates: each scaffold asks for log-probs and
    # keeps every completion it is returned (token ids, log-probs, versions); every
    # trained episode's policy tokens, behaviour log-probs and versions are exactly
    # those, turn after turn, whatever weights each turn ran on.
    cfg = _retry(
        pipeline__mode="stream_async", pipeline__weight_update="inflight", eval__num_problems=0
    )
    got: dict[str, list] = {}
    real = scaffolds.environment_scaffold

    def spying(*args, **kwargs):
        play = real(*args, **kwargs)

        def spied(task, client):
            create, turns = client.chat.completions.create, []
            got[client.default_headers["x-episode-id"]] = turns

            def spy(**kw):
                r = create(**{**kw, "logprobs": True})
                c = r.choices[0]
                turns.append((c.model_extra["token_ids"], [e.logprob for e in c.logprobs.content],
                              c.model_extra["versions"]))  # fmt: skip
                return r

            client.chat.completions.create = spy
            return play(task, client)

        return spied

    with mock.patch("streamrl_jax.pipeline.parts.environment_scaffold", spying):
        result, seen = run_recording(cfg, tmp_path)
    returned = {tuple(i for ids, _, _ in turns for i in ids): turns for turns in got.values()}
    assert len(seen) == len(got) == len(returned)
    for s in seen:
        mask = s.policy_mask
        turns = returned[tuple(s.response[mask].tolist())]
        np.testing.assert_array_equal(
            s.logprobs[mask], np.float32([lp for _, lps, _ in turns for lp in lps])
        )
        assert s.versions()[mask].tolist() == [v for _, _, vs in turns for v in vs]
    bound = cfg.pipeline.max_lag or cfg.pipeline.staleness  # (0: the staleness)
    assert all(r["lag_max"] <= bound and r["dropped_stale"] == 0 for r in result.steps)


@pytest.mark.extended  # ~45 s (two runs); chained_calculator_test plays the agents scripted
@pytest.mark.parametrize("scaffold", ["openai_agents", "verifiers"])
def test_an_agent_framework_trains_what_the_environment_trains_in_process(tmp_path, scaffold):
    # The chained calculator's episodes played by an OpenAI Agents SDK agent or verifiers'
    # tool environment loop (unchanged third-party code: its tools, its loop) through the
    # run's endpoint with OpenAI tool calling, against the same run in-process: the same
    # episodes (prompts with the tools, every token) and the same rewards, step by step.
    from support import config_file

    base = dict(pipeline__mode="stream_sync", pipeline__deterministic=True, eval__num_problems=0,
                pipeline__steps=1, environment__max_turns=2, environment__max_episode_tokens=40,
                model__max_context=400)  # fmt: skip
    runs = {}
    for name, extra in (("in_process", dict(pipeline__rollout="episodes+full")),
                        ("agent", dict(pipeline__rollout="agents+full",
                                       environment__scaffold=scaffold))):  # fmt: skip
        cfg = config_file("configs/agent.py", "chained_tiny", **base, **extra)
        runs[name] = run_recording(cfg, tmp_path / name)

    def episodes(seen):
        return sorted((tuple(s.prompt.tolist()), tuple(s.response.tolist())) for s in seen)

    (r1, seen1), (r2, seen2) = runs["in_process"], runs["agent"]
    assert episodes(seen1) == episodes(seen2) and len(seen1) == 8
    assert [r["reward"] for r in r1.steps] == [r["reward"] for r in r2.steps]
    assert "<tools>" in _tokenizer().decode(seen2[0].prompt)


def _tokenizer():
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(environment__scaffold="openai_agents"), "an agent framework plays 'agents'"),
        (dict(environment__scaffold="openai_agents", pipeline__rollout="agents+full"),
         "environment.name='calculator'"),
        (dict(environment__scaffold="verifiers"), "an agent framework plays 'agents'"),
        (dict(environment__scaffold="verifiers", pipeline__rollout="agents+full"),
         "environment.scaffold='verifiers'.*environment.name='calculator'"),
        (dict(environment__scaffold="environment_group"), "a scaffold plays 'agents' episodes"),
    ],
)  # fmt: skip
def test_an_agent_framework_needs_agents_episodes_of_openai_functions(overrides, message):
    from streamrl_jax.errors import UserError

    with pytest.raises(UserError, match=message):
        agent_config(**overrides)
