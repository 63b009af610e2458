"""Prompt pipeline and request building."""

import numpy as np
import pytest

from streamrl_jax import data
from streamrl_jax.data import PromptPipeline, make_requests, sample_seed
from streamrl_jax.generation.types import SamplingParams
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import TaskDataset
from streamrl_jax.scheduling import lengths


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def dataset():
    return TaskDataset("basic_arithmetic", seed=3, size=6)


def test_epochs_cover_every_prompt_once_and_reshuffle(dataset, tokenizer):
    pipe = PromptPipeline(dataset, tokenizer, max_prompt_len=512, seed=0)
    first = [p.problem.prompt_id for p in pipe.next_prompts(6)]
    second = [p.problem.prompt_id for p in pipe.next_prompts(6)]
    assert sorted(first) == sorted(second) == sorted(p.prompt_id for p in dataset)
    assert first != second  # a new order each epoch (fixed seed)
    prompt = pipe.next_prompts(1)[0]
    assert tokenizer.decode(prompt.tokens, skip_special_tokens=False).startswith("<|im_start|>")


def test_state_round_trip_resumes_the_same_stream(dataset, tokenizer):
    a = PromptPipeline(dataset, tokenizer, max_prompt_len=512, seed=4)
    a.next_prompts(4)
    state = a.get_state()
    expected = [p.problem.prompt_id for p in a.next_prompts(5)]
    b = PromptPipeline(dataset, tokenizer, max_prompt_len=512, seed=4)
    b.set_state(state)
    assert [p.problem.prompt_id for p in b.next_prompts(5)] == expected
    assert b.consumed == 9


def test_overlong_prompts_error_or_are_counted(dataset, tokenizer):
    with pytest.raises(ValueError, match="over generation.max_prompt_len=8"):
        PromptPipeline(dataset, tokenizer, max_prompt_len=8, seed=0).next_prompts(1)
    lengths = sorted(
        len(p.tokens)
        for p in PromptPipeline(dataset, tokenizer, max_prompt_len=999, seed=0).next_prompts(6)
    )
    limit = lengths[2]  # at least the 3 longest prompts are over it
    pipe = PromptPipeline(dataset, tokenizer, max_prompt_len=limit, seed=0, overlong="drop")
    kept = pipe.next_prompts(3)
    assert all(len(p.tokens) <= limit for p in kept) and pipe.dropped_overlong >= 1
    full = PromptPipeline(dataset, tokenizer, max_prompt_len=999, seed=0).next_prompts(6)
    pipe = PromptPipeline(dataset, tokenizer, max_prompt_len=limit, seed=0, overlong="truncate")
    cut = pipe.next_prompts(6)
    assert [p.problem.prompt_id for p in cut] == [p.problem.prompt_id for p in full]
    assert pipe.truncated_overlong == sum(len(p.tokens) > limit for p in full) >= 1
    for whole, short in zip(full, cut, strict=True):  # left truncation keeps the end
        assert short.tokens == whole.tokens[-limit:]


def test_no_prompt_that_fits_fails_at_start_up_with_the_count(dataset, tokenizer):
    # overlong_prompts="drop" with nothing short enough used to draw for ever.
    with pytest.raises(ValueError, match=f"none of the {len(dataset)} prompts fits .*=8"):
        PromptPipeline(dataset, tokenizer, max_prompt_len=8, seed=0, overlong="drop")


def test_requests_groups_and_seeds(dataset, tokenizer):
    prompts = PromptPipeline(dataset, tokenizer, max_prompt_len=512, seed=0).next_prompts(3)
    reqs = make_requests(
        prompts, batch=7, group_size=2, max_new_tokens=32, sampling=SamplingParams(), run_seed=1
    )
    assert [r.request_id for r in reqs[:3]] == ["train/7/0/0", "train/7/0/1", "train/7/1/0"]
    assert reqs[3].tag.group == 1 and reqs[3].tag.member == 1
    assert reqs[3].tag.prompt_id == prompts[1].problem.prompt_id
    assert reqs[0].metadata["entry"] == prompts[0].problem.metadata["entry"]
    assert len({r.seed for r in reqs}) == len(reqs)
    assert reqs[0].seed == sample_seed(1, 7, 0, 0) and all(r.forced_length is None for r in reqs)


def test_length_replay_forces_paper_shaped_lengths(dataset, tokenizer):
    prompts = PromptPipeline(dataset, tokenizer, max_prompt_len=512, seed=0).next_prompts(6)
    kwargs = dict(batch=0, group_size=50, max_new_tokens=256, sampling=SamplingParams(), run_seed=0)
    reqs = make_requests(prompts, length_replay=True, **kwargs)
    forced = np.array([r.forced_length for r in reqs])
    assert forced.min() >= 16 and forced.max() <= 256
    assert np.median(forced) < 0.3 * 256 < np.percentile(forced, 90)  # a long tail
    again = make_requests(prompts, length_replay=True, **kwargs)
    assert [r.forced_length for r in again] == list(forced)  # seeded by run and batch
    other = make_requests(prompts, length_replay=True, **{**kwargs, "batch": 1})
    assert [r.forced_length for r in other] != list(forced)


def test_replay_lengths_stay_within_the_cap_for_short_caps():
    # A cap of 16 once left the trace's window [16, 16], which continuous draws never
    # fill: the draw looped forever. Short caps now open the window below.
    for cap in (1, 2, 16, 64, 256):
        got = data.replay_lengths(0, 3, 64, cap)
        assert len(got) == 64 and min(got) >= 1 and max(got) <= cap
    assert data.replay_lengths(0, 3, 8, 64) == data.replay_lengths(0, 3, 8, 64)  # seeded
    assert min(data.replay_lengths(0, 3, 256, 64)) >= 16  # caps >= 64: at least 16 tokens
    with pytest.raises(ValueError, match="min_len 16 must be below max_len 16"):
        lengths.sample_lengths(lengths.paper_trace(16, min_len=16), 4, np.random.default_rng(0))
