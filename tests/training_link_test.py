"""The training link (pipeline/processes/training.py), host only: what it checks of the
groups the trainer takes, and where a round report goes."""

import dataclasses
import threading
import types

import pytest
from support import rollout_context, scored_sample

from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.generation.types import RequestTag
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.processes.training import TrainingLink
from streamrl_jax.pipeline.rollouts.partial import RemoteRounds


def closed(process, r, groups, paused=0, waiting=0, regenerated=0, dropped=0):
    return RoundClosed(process, r, tuple(groups), paused, waiting, regenerated, dropped)


def _of(batch, group, prompt_id):
    s = scored_sample(group, 0, 0.0)
    tag = RequestTag(batch=batch, group=group, member=0, prompt_id=prompt_id)
    return [Scored(dataclasses.replace(s.sample, tag=tag), s.text, s.reward)]


def test_verify_checks_each_group_against_its_own_batch():
    # Several processes: the trainer's own draw of each batch. Partial rollout trains
    # groups of earlier batches at a step, so each is checked against its batch's draw.
    link = types.SimpleNamespace(_drawn={2: ["a", "b"], 3: ["c", "d"]}, _start=0)
    TrainingLink.verify(link, [_of(3, 1, "d"), _of(2, 0, "a"), _of(2, 1, "b")])
    with pytest.raises(RuntimeError, match=r"batch 2 group 1: generated for prompt d, .* drew b"):
        TrainingLink.verify(link, [_of(2, 1, "d")])
    with pytest.raises(RuntimeError, match="batch 0 group 0: .* drew a batch it no longer keeps"):
        TrainingLink.verify(link, [_of(0, 0, "a")])
    # A run resumed at batch 3: the carried groups of earlier batches (the generation
    # processes' checkpointed work) were never drawn here; its own draws are checked.
    resumed = types.SimpleNamespace(_drawn={3: ["c", "d"]}, _start=3)
    TrainingLink.verify(resumed, [_of(2, 1, "x"), _of(3, 0, "c")])
    with pytest.raises(RuntimeError, match=r"batch 3 group 1: generated for prompt x"):
        TrainingLink.verify(resumed, [_of(3, 1, "x")])


def test_a_round_report_speaks_for_its_sender_only():
    # The training process takes a RoundClosed only from the process it names.
    ctx = rollout_context(
        mode="stream_async", rollout="partial", partial_budget_tokens=6, max_lag=3,
        prompts_per_step=4, group_size=2,
    )  # fmt: skip
    rounds = RemoteRounds(dataclasses.replace(ctx, where="trainer", generation_processes=(0, 1)))
    link = types.SimpleNamespace(
        _wait=lambda *args: None,
        _attached=threading.Event(),
        _run=types.SimpleNamespace(rollout=rounds),
    )
    with pytest.raises(TransportError, match="generation-1 sent a round report for generation-0"):
        TrainingLink._on_message(link, closed(0, 0, [(0, 1)]), "generation-1")
    TrainingLink._on_message(link, closed(0, 0, [(0, 1)]), "generation-0")
    TrainingLink._on_message(link, closed(1, 0, [(0, 2)]), "generation-1")
    assert rounds.wait_round(0) == [(0, 1), (0, 2)]
