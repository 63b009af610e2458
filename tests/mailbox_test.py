"""Tests of the one mailbox and the one failure latch (host only, no devices).

No durations are asserted: a waiter that must block is checked with a short
timeout that has to expire, and one that must wake is given a long timeout
and joined.
"""

import threading

import pytest

from streamrl_jax.mailbox import (
    FailureLatch,
    Mailbox,
    MailboxClosed,
    MailboxFailed,
    MailboxTimeout,
)

LONG = 30.0  # a wait that must end by an event, never by this timeout
SHORT = 0.02  # a wait that must time out


def _in_thread(fn):
    """Runs `fn` on a thread; returns (thread, box) where box gets its result or error."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _join(t: threading.Thread) -> None:
    t.join(LONG)
    assert not t.is_alive(), "the waiter was not woken"


# ---------------------------------------------------------------------- FIFO, capacity
def test_fifo_order_and_counts():
    box = Mailbox("m")
    for i in range(3):
        box.put(i, timeout=SHORT)
    assert len(box) == 3 and box.snapshot() == [0, 1, 2]
    assert [box.get(timeout=SHORT) for _ in range(3)] == [0, 1, 2]
    m = box.metrics
    assert (m.items_in, m.items_out, m.max_depth) == (3, 3, 3)


def test_capacity_is_in_units_and_put_blocks_while_full():
    box = Mailbox("groups", capacity=4)
    box.put("ab", timeout=SHORT, size=2)
    box.put("cd", timeout=SHORT, size=2)
    assert box.size == 4 and len(box) == 2
    with pytest.raises(MailboxTimeout, match=r"groups: timed out .* room for 1 unit.*4/4"):
        box.put("e", timeout=SHORT)
    assert not box.offer("e", timeout=SHORT)
    with pytest.raises(ValueError, match="never fit"):
        box.put("too big", timeout=SHORT, size=5)


def test_back_pressure_released_by_the_consumer():
    box = Mailbox("m", capacity=1)
    box.put("a", timeout=SHORT)
    t, out = _in_thread(lambda: box.put("b", timeout=LONG))
    t.join(SHORT)
    assert t.is_alive()  # blocked on back-pressure
    assert box.get(timeout=SHORT) == "a"
    _join(t)
    assert "error" not in out
    assert box.get(timeout=SHORT) == "b"
    assert box.metrics.producer_wait_s > 0


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="m: capacity must be >= 1"):
        Mailbox("m", capacity=0)
    with pytest.raises(ValueError, match="min_items"):
        Mailbox("m").get_many(min_items=0, timeout=SHORT)
    with pytest.raises(ValueError, match="min_items <= max_items"):
        Mailbox("m").get_many(min_items=3, max_items=2, timeout=SHORT)


# ---------------------------------------------------------------------- timeouts
def test_timeouts_name_the_mailbox_and_what_was_awaited():
    box = Mailbox("sample queue")
    with pytest.raises(MailboxTimeout, match="sample queue: timed out after .* an item"):
        box.get(timeout=SHORT)
    with pytest.raises(TimeoutError, match="sample queue: .* the next batch"):
        box.get(timeout=SHORT, what="the next batch")
    state = {"n": 0}
    with pytest.raises(TimeoutError, match=r"version 3 \(latest 0\)"):
        box.wait_until(
            lambda: state["n"] >= 3, timeout=SHORT, what=lambda: f"version 3 (latest {state['n']})"
        )
    assert box.metrics.consumer_wait_s > 0


def test_owner_exception_classes_are_raised():
    class Failed(RuntimeError):
        pass

    class Closed(RuntimeError):
        pass

    class Slow(TimeoutError):
        pass

    box = Mailbox("m", failed=Failed, closed=Closed, timeout_error=Slow)
    with pytest.raises(Slow):
        box.get(timeout=SHORT)
    box.close()
    with pytest.raises(Closed):
        box.get(timeout=SHORT)
    box.fail(ValueError("x"), "producer")
    with pytest.raises(Failed, match="m: producer failed: ValueError"):
        box.get(timeout=SHORT)


# ---------------------------------------------------------------------- get_many
def test_get_many_waits_for_min_and_takes_at_most_max():
    box = Mailbox("m")
    for i in range(5):
        box.put(i, timeout=SHORT)
    assert box.get_many(min_items=2, max_items=3, timeout=SHORT) == [0, 1, 2]
    with pytest.raises(MailboxTimeout, match="3 item"):
        box.get_many(min_items=3, timeout=SHORT)
    assert len(box) == 2  # a timed-out take takes nothing
    assert box.get_many(min_items=1, timeout=SHORT) == [3, 4]


def test_get_many_wakes_when_enough_arrive():
    box = Mailbox("m")
    t, out = _in_thread(lambda: box.get_many(min_items=2, timeout=LONG))
    box.put("a", timeout=SHORT)
    t.join(SHORT)
    assert t.is_alive()  # one of two
    box.put("b", timeout=SHORT)
    _join(t)
    assert out["result"] == ["a", "b"]


# ---------------------------------------------------------------------- close
def test_close_drains_then_raises_closed():
    box = Mailbox("m", capacity=8)
    box.put("a", timeout=SHORT)
    box.put("b", timeout=SHORT)
    box.close("all producers finished")
    with pytest.raises(MailboxClosed, match=r"put after close \(all producers finished\)"):
        box.put("c", timeout=SHORT)
    assert not box.offer("c", timeout=SHORT)
    assert box.get_many(min_items=5, timeout=SHORT) == ["a", "b"]  # fewer than min: the rest
    with pytest.raises(MailboxClosed, match="m: all producers finished"):
        box.get(timeout=SHORT)
    with pytest.raises(MailboxClosed, match="while waiting for v1"):
        box.wait_until(lambda: False, timeout=SHORT, what="v1")
    assert box.closed


def test_close_wakes_a_blocked_consumer_and_producer():
    empty = Mailbox("empty")
    consumer, got = _in_thread(lambda: empty.get(timeout=LONG))
    full = Mailbox("full", capacity=1)
    full.put("y", timeout=SHORT)
    producer, put = _in_thread(lambda: full.put("z", timeout=LONG))
    empty.close()
    full.close()
    _join(consumer)
    _join(producer)
    assert isinstance(got["error"], MailboxClosed)
    assert isinstance(put["error"], MailboxClosed)
    assert full.get(timeout=SHORT) == "y"  # what was queued stays takeable


# ---------------------------------------------------------------------- failure
def test_failure_is_raised_before_queued_items_and_chained():
    box = Mailbox("m")
    box.put("queued", timeout=SHORT)
    cause = ValueError("boom")
    assert box.fail(cause, "generation instance 2")
    assert not box.fail(KeyError("later"), "instance 3")  # the first failure wins
    for call in (
        lambda: box.get(timeout=SHORT),
        lambda: box.get_many(min_items=1, timeout=SHORT),
        lambda: box.put("more", timeout=SHORT),
        lambda: box.wait_until(lambda: True, timeout=SHORT, what="anything"),
        box.ensure_open,
    ):
        with pytest.raises(MailboxFailed, match="generation instance 2 failed: ValueError") as e:
            call()
        assert e.value.__cause__ is cause
    assert box.error is cause
    assert box.remove(lambda item: True) == ["queued"]  # still there for a checkpoint


def test_failure_wakes_every_waiter():
    box = Mailbox("m", capacity=1)
    box.put("full", timeout=SHORT)
    waiters = [
        _in_thread(lambda: box.put("blocked", timeout=LONG)),
        _in_thread(lambda: box.get_many(min_items=2, timeout=LONG)),
        _in_thread(lambda: box.wait_until(lambda: False, timeout=LONG, what="never")),
    ]
    cause = RuntimeError("device on fire")
    box.fail(cause, "instance 0")
    for t, out in waiters:
        _join(t)
        assert isinstance(out["error"], MailboxFailed) and out["error"].__cause__ is cause


def test_failed_none_raises_the_original_exception():
    class PeerLost(RuntimeError):
        pass

    box = Mailbox("server", failed=None)
    box.put("queued", timeout=SHORT)
    lost = PeerLost("lost generation-7")
    box.fail(lost)
    with pytest.raises(PeerLost) as e:
        box.get(timeout=SHORT)
    assert e.value is lost


# ---------------------------------------------------------------------- owner state
def test_wait_until_sees_state_changed_in_locked():
    box = Mailbox("weight board")
    versions: dict[int, str] = {}
    t, out = _in_thread(
        lambda: box.wait_until(lambda: 2 in versions, timeout=LONG, what="version 2")
    )
    with box.locked():
        versions[1] = "w1"
    t.join(SHORT)
    assert t.is_alive()  # version 1 is not what it waits for
    with box.locked():
        versions[2] = "w2"
    _join(t)
    assert out == {"result": None}


def test_a_wait_inside_locked_releases_the_lock():
    box = Mailbox("m", capacity=1)
    box.put("a", timeout=SHORT)
    with box.locked():
        t, out = _in_thread(lambda: box.get(timeout=LONG))  # needs the lock
        box.put("b", timeout=LONG)  # waits for room, letting the consumer take "a"
    _join(t)
    assert out["result"] == "a" and box.snapshot() == ["b"]


def test_wait_until_predicate_errors_propagate():
    box = Mailbox("m")

    def predicate():
        raise KeyError("discarded")

    with pytest.raises(KeyError, match="discarded"):
        box.wait_until(predicate, timeout=SHORT, what="x")


def test_remove_by_predicate_frees_room():
    box = Mailbox("m", capacity=3)
    for v in range(3):
        box.put(v, timeout=SHORT)
    assert box.remove(lambda v: v < 2) == [0, 1]
    assert box.size == 1 and box.snapshot() == [2]
    box.put(3, timeout=SHORT, size=2)  # the room removal freed
    assert box.remove(lambda v: True) == [2, 3] and box.size == 0


# ---------------------------------------------------------------------- latch
def test_latch_first_failure_wins_and_listeners_run_once():
    latch = FailureLatch("run")
    calls = []
    latch.add_listener(lambda c, e: calls.append(("stream", c, e)))
    latch.add_listener(lambda c, e: calls.append(("board", c, e)))
    latch.raise_if_failed()  # nothing yet
    assert not latch.wait(SHORT) and latch.error is None and latch.component is None
    first, second = ValueError("reward"), RuntimeError("trainer")
    assert latch.fail("reward function", first)
    assert not latch.fail("trainer", second)
    assert calls == [("stream", "reward function", first), ("board", "reward function", first)]
    assert latch.wait(SHORT) and latch.failed
    assert (latch.component, latch.error) == ("reward function", first)
    late = []
    latch.add_listener(lambda c, e: late.append(c))  # after the failure: called at once
    assert late == ["reward function"]


def test_latch_raise_if_failed_wraps_or_reraises():
    latch = FailureLatch()
    cause = ValueError("x")
    latch.fail("driver", cause)
    with pytest.raises(ValueError) as e:
        latch.raise_if_failed()
    assert e.value is cause
    with pytest.raises(RuntimeError, match="driver: ValueError") as e:
        latch.raise_if_failed(lambda c, exc: RuntimeError(f"{c}: {exc!r}"))
    assert e.value.__cause__ is cause


def test_latch_listener_error_does_not_stop_the_others():
    latch = FailureLatch()
    seen = []
    latch.add_listener(lambda c, e: 1 / 0)
    latch.add_listener(lambda c, e: seen.append(c))
    assert latch.fail("a", ValueError())
    assert seen == ["a"]


def test_latch_rejects_swapped_arguments():
    with pytest.raises(TypeError, match="fail"):
        FailureLatch().fail(ValueError("x"), "component")


def test_latch_wait_wakes_on_failure():
    latch = FailureLatch()
    t, out = _in_thread(lambda: latch.wait(LONG))
    latch.fail("x", ValueError())
    _join(t)
    assert out["result"] is True


def test_one_latch_fails_several_mailboxes_through_listeners():
    latch = FailureLatch("run")
    stream, board = Mailbox("stream"), Mailbox("board")
    latch.add_listener(lambda c, e: stream.fail(e, c))
    latch.add_listener(lambda c, e: board.fail(e, c))
    t, out = _in_thread(lambda: board.wait_until(lambda: False, timeout=LONG, what="v3"))
    latch.fail("trainer", RuntimeError("oom"))
    _join(t)
    assert "trainer failed" in str(out["error"])
    with pytest.raises(MailboxFailed, match="stream: trainer failed"):
        stream.get(timeout=SHORT)
