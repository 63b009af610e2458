"""Tests for pipeline/round_reports.py: the trainer's view of the generation processes'
partial-rollout rounds (host only, no devices)."""

import threading
import types

import pytest

from streamrl_jax.config import PipelineSection
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.pipeline.round_reports import RoundReports, start_reporter
from streamrl_jax.stream.sample_stream import StreamError

P = PipelineSection(
    mode="stream_async", partial_budget_tokens=6, max_lag=3, prompts_per_step=4, group_size=2
)


def closed(process, r, groups, paused=0, waiting=0, regenerated=0, dropped=0):
    return RoundClosed(process, r, tuple(groups), paused, waiting, regenerated, dropped)


def test_a_round_closes_once_every_process_reported_it():
    reports = RoundReports(P, (0, 1))
    reports.closed(closed(0, 0, [(0, 0)], paused=3, waiting=1))
    with pytest.raises(TimeoutError, match=r"round 0 not reported .* processes \[1\]"):
        reports.wait_round(0, timeout=0.05)
    reports.closed(closed(1, 0, [(0, 3), (0, 1)], paused=2, regenerated=1, dropped=2))
    assert reports.wait_round(0, timeout=1) == [(0, 0), (0, 1), (0, 3)]
    # Counts: the sum of each process's last report.
    assert reports.in_flight() == {"paused": 5, "waiting_members": 1}
    assert (reports.regenerated, reports.dropped) == (1, 2)
    # A round with no complete group closes with none (its step trains nothing).
    reports.closed(closed(0, 1, []))
    reports.closed(closed(1, 1, []))
    assert reports.wait_round(1, timeout=1) == []


def test_a_waiting_trainer_wakes_on_the_last_report_and_on_failure():
    reports = RoundReports(P, (0,))
    reports.start(2)  # a run that starts at batch 2: round 2 is the first reported
    got = []
    waiter = threading.Thread(target=lambda: got.append(reports.wait_round(2, timeout=10)))
    waiter.start()
    reports.closed(closed(0, 2, [(1, 2), (2, 0)]))
    waiter.join(timeout=10)
    assert got == [[(1, 2), (2, 0)]]
    reports.fail(RuntimeError("generation process 0 failed"))
    with pytest.raises(StreamError, match="generation process 0 failed"):
        reports.wait_round(3, timeout=10)


@pytest.mark.parametrize(
    "report, message",
    [
        (closed(2, 0, []), "round report from generation-2, which is not generating"),
        (closed(0, 1, []), "generation-0 reported round 1; expected round 0"),
        (closed(0, 0, [(1, 0)]), r"group \(1, 0\) complete in round 0: round 0 holds batches 0..0"),
        (closed(0, 0, [(0, 4)]), r"group \(0, 4\) .* groups 0..3"),
        (closed(0, 0, [(-1, 0)]), r"group \(-1, 0\)"),
    ],
)
def test_a_report_that_cannot_be_right_is_refused_naming_the_process(report, message):
    reports = RoundReports(P, (0, 1))
    with pytest.raises(TransportError, match=message):
        reports.closed(report)


def test_a_report_repeated_is_refused():
    reports = RoundReports(P, (0,))
    reports.closed(closed(0, 0, []))
    with pytest.raises(TransportError, match="reported round 0; expected round 1"):
        reports.closed(closed(0, 0, []))


def test_checkpoints_are_refused_by_name():
    reports = RoundReports(P, (0,))
    with pytest.raises(RuntimeError, match="checkpoint 3: a partial-rollout run across"):
        reports.snapshot(3)
    with pytest.raises(ValueError, match="resume from checkpoint 3: .* paused samples"):
        reports.restore(3, {})


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
    from streamrl_jax.pipeline.training_process import TrainingLink

    link = types.SimpleNamespace(
        _wait=lambda *args: None,
        _attached=threading.Event(),
        _hooks=(None,) * 4,
        rollout=RoundReports(P, (0, 1)),
    )
    with pytest.raises(TransportError, match="generation-1 sent a round report for generation-0"):
        TrainingLink._on_message(link, closed(0, 0, [(0, 1)]), "generation-1")
    TrainingLink._on_message(link, closed(0, 0, [(0, 1)]), "generation-0")
    TrainingLink._on_message(link, closed(1, 0, [(0, 2)]), "generation-1")
    assert link.rollout.wait_round(0, timeout=1) == [(0, 1), (0, 2)]
