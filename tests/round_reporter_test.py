"""Partial rollout across processes, the reporting between the halves (host only): a
generation process's round reporter (`processes/generation.start_reporter`) and the
training link's routing of round reports (`processes/training.TrainingLink`)."""

import dataclasses
import threading
import types

import pytest
from support import rollout_context

from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.pipeline.processes.generation import start_reporter
from streamrl_jax.pipeline.rollouts.partial import RemoteRounds


def closed(process, r, groups, paused=0, waiting=0, regenerated=0, dropped=0):
    return RoundClosed(process, r, tuple(groups), paused, waiting, regenerated, dropped)


class _Rollout:
    """A PartialRollout's reporting surface: round r closes when `close(r, groups)`."""

    def __init__(self):
        self.cv, self.closed, self.regenerated, self.dropped = threading.Condition(), {}, 1, 0

    def close(self, r, groups):
        with self.cv:
            self.closed[r] = groups
            self.cv.notify_all()

    def wait_round(self, r, timeout):
        with self.cv:
            if not self.cv.wait_for(lambda: r in self.closed, timeout=timeout):
                raise TimeoutError(r)
            return self.closed.pop(r)

    def in_flight(self):
        return {"paused": 2, "waiting_members": 3}


def test_the_reporter_sends_each_round_in_order_once_closed():
    rollout, sent, failed, stopping = _Rollout(), [], [], threading.Event()
    thread = start_reporter(rollout, range(2, 4), 0, sent.append, stopping, failed.append)
    rollout.close(3, [(3, 0)])  # round 3 closes first: reported after round 2
    rollout.close(2, [(1, 1), (2, 0)])
    thread.join(5)
    assert not thread.is_alive() and not failed
    assert sent == [closed(0, 2, [(1, 1), (2, 0)], 2, 3, 1, 0), closed(0, 3, [(3, 0)], 2, 3, 1, 0)]


def test_the_reporter_fails_the_run_when_a_send_fails_and_stops_when_asked():
    rollout, failed, stopping = _Rollout(), [], threading.Event()

    def send(msg):
        raise TypeError("cannot encode")

    thread = start_reporter(rollout, range(5), 0, send, stopping, failed.append)
    rollout.close(0, [])
    thread.join(5)
    assert [type(e) for e in failed] == [TypeError]  # any error, not only a lost channel
    thread = start_reporter(_Rollout(), range(5), 0, send, stopping, failed.append)
    stopping.set()
    thread.join(5)
    assert not thread.is_alive() and len(failed) == 1


def test_a_round_report_speaks_for_its_sender_only():
    # The training process takes a RoundClosed only from the process it names.
    from streamrl_jax.pipeline.processes.training import TrainingLink

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
