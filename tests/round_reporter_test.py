"""Partial rollout across processes, the reporting between the halves (host only): a
generation process's round reporter (`processes/generation.start_reporter`)."""

import threading

from streamrl_jax.distributed.messages import RoundClosed
from streamrl_jax.pipeline.processes.generation import start_reporter


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
