"""The judge's channel between training and scoring processes (distributed/judge_channel.py):
verdicts in order, a judge that raises answered as failures, a lost scoring process's
forward sent to its restart, a reply nobody asked for refused, and a bounded wait.

Real sockets on loopback (CURVE, the run key) in one process; the coordination
service's board is a dict."""

import math
import threading
import time

import pytest

from streamrl_jax.distributed import judge_channel
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.judge_channel import JudgeServer, RemoteJudge, publish_address
from streamrl_jax.rewards.judge import Item, Verdict

KEY = b"test-key-0123456789abcdef"


class _Board:
    """The coordination service's key-value store, as the channel uses it."""

    def __init__(self):
        self.values, self.cv = {}, threading.Condition()

    def publish(self, key, value, overwrite=False):
        with self.cv:
            assert overwrite or key not in self.values
            self.values[key] = value
            self.cv.notify_all()

    def lookup(self, key, timeout_s):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.values, timeout_s):
                raise TimeoutError(key)
            return self.values[key]

    def try_lookup(self, key):
        with self.cv:
            return self.values.get(key)


def _grade(items):
    return [Verdict(len(it.response) / 10, 0.9, None, it.answer or None) for it in items]


def _server(judge=_grade, name="scoring-0", lost=None):
    return JudgeServer(
        judge,
        "127.0.0.1:0",
        authkey=KEY,
        peers=1,
        timeout_s=5,
        name=name,
        on_lost=lambda peer, e: (lost or []).append(peer),
    )


def _client(board, timeout_s=10.0, scoring=1):
    return RemoteJudge(
        scoring,
        4,
        authkey=KEY,
        name="training-0",
        timeout_s=timeout_s,
        peer_timeout_s=5,
        board=board,
    )


def test_verdicts_come_back_in_order_and_a_raising_judge_answers_with_failures():
    board, server = _Board(), _server()
    publish_address(0, server.address, board)
    client = _client(board)
    try:
        client.connect(5)
        items = [Item("q", "r" * n, "a" if n % 2 else "") for n in range(1, 6)]
        got = client(items)
        assert got == [Verdict(n / 10, 0.9, None, "a" if n % 2 else None) for n in range(1, 6)]
        assert (server.forwards, server.items) == (1, 5)
        # A parsed verdict (what the judge wrote; no probability mass: NaN) crosses too.
        server.judge = lambda items: [Verdict(1.0, float("nan"), None, "Score: Yes")]
        parsed = client([Item("q", "r")])[0]
        assert parsed.score == 1.0 and math.isnan(parsed.mass) and parsed.text == "Score: Yes"
        server.judge = lambda items: 1 / 0
        failed = client([Item("q", "r")])
        assert failed[0].score is None and "ZeroDivisionError" in failed[0].failure
        assert "scoring-0" in failed[0].failure
    finally:
        client.close(2)
        server.close(2)
    assert server.ended == {"training-0"}  # closed in order


def test_a_lost_scoring_processs_forward_goes_to_its_restart():
    # The first scoring process dies with the forward unanswered; the call waits for the
    # restarted process's address and gets its verdicts (sent once more, counted).
    board, started = _Board(), threading.Event()
    release = threading.Event()

    def stuck(items):
        started.set()
        release.wait(10)
        return _grade(items)

    first = _server(stuck)
    publish_address(0, first.address, board)
    client = _client(board)
    client.connect(5)
    result = {}
    call = threading.Thread(target=lambda: result.update(v=client([Item("q", "rrr")])))
    call.start()
    assert started.wait(5)
    first.close(0.5)  # gone, its forward unanswered
    release.set()
    time.sleep(0.3)
    assert call.is_alive()  # waiting for a restart
    second = _server()
    publish_address(0, second.address, board)
    call.join(10)
    try:
        assert result["v"] == [Verdict(0.3, 0.9, None, None)]
        assert client.resent == 1 and second.forwards == 1
    finally:
        client.close(2)
        second.close(2)


def test_a_reply_nobody_asked_for_fails_the_channel_naming_the_peer(monkeypatch):
    board, server = _Board(), _server()
    publish_address(0, server.address, board)
    client = _client(board, timeout_s=3)
    client.connect(5)
    real = judge_channel.Verdicts
    monkeypatch.setattr(judge_channel, "Verdicts", lambda fid, verdicts: real(fid + 7, verdicts))
    try:
        with pytest.raises(TransportError, match="scoring-0.*answered forward 7, never asked"):
            client([Item("q", "r")])
    finally:
        client.close(1)
        server.close(1)


def test_no_scoring_process_is_a_bounded_wait_naming_it():
    board = _Board()
    client = _client(board, timeout_s=1)
    with pytest.raises(TimeoutError, match="scoring process 0 did not serve its judge"):
        client.connect(0.5)
    server = _server()
    publish_address(0, server.address, board)
    client.connect(5)
    server.close(0.5)  # and never restarted
    with pytest.raises(TimeoutError, match="no scoring process answered a forward of 1 samples"):
        client([Item("q", "r")])


def test_a_forward_given_up_on_leaves_the_channel_to_the_next():
    # The first forward outlives the call's timeout (its samples are then masked by the
    # stage); its late reply is dropped, and the next forward uses the same channel.
    board, release = _Board(), threading.Event()

    def slow_once(items):
        if not release.is_set():
            release.wait(10)
        return _grade(items)

    server = _server(slow_once)
    publish_address(0, server.address, board)
    client = _client(board, timeout_s=0.5)
    client.connect(5)
    try:
        with pytest.raises(TimeoutError, match="no scoring process answered"):
            client([Item("q", "r")])
        release.set()
        client.timeout_s = 10.0
        assert client([Item("q", "rr")]) == [Verdict(0.2, 0.9, None, None)]
        assert server.forwards == 2 and client.resent == 0
    finally:
        client.close(2)
        server.close(2)


def test_a_server_not_up_is_passed_at_once_while_another_serves():
    # Round robin over two servers, one never published (a generation process lost
    # before it served its tenant judge, pipeline/tenant.py): every forward goes to the
    # other on its first pass over the links, never waiting on the missing address.
    board, server = _Board(), _server(name="generation-1")
    publish_address(1, server.address, board)
    waits = []
    real = board.lookup
    board.lookup = lambda key, timeout_s: waits.append(key) or real(key, timeout_s)
    client = RemoteJudge(
        2, 4, authkey=KEY, name="training-0", timeout_s=10, peer_timeout_s=5, board=board,
        serving="generation process",
    )  # fmt: skip
    try:
        for n in range(1, 5):
            assert client([Item("q", "r" * n)]) == [Verdict(n / 10, 0.9, None, None)]
        assert server.forwards == 4 and waits == []
    finally:
        client.close(1)
        server.close(1)
    with pytest.raises(TimeoutError, match="no generation process answered"):
        RemoteJudge(
            1, 4, authkey=KEY, name="t", timeout_s=1, peer_timeout_s=5, board=_Board(),
            serving="generation process",
        )([Item("q", "r")])  # fmt: skip
