"""pipeline/supervisor.py: what counts as a stop rather than a failure."""

from __future__ import annotations

from streamrl_jax.mailbox import Mailbox
from streamrl_jax.pipeline.supervisor import Shutdown, caused_by_shutdown


def test_a_wait_ended_by_the_stop_is_a_stop_not_a_failure():
    # The driver's weight-board wait ends with the mailbox's wrapped error, raised from
    # the Shutdown that `RunParts.interrupt` failed the board with.
    box: Mailbox[int] = Mailbox("weight board")
    box.fail(Shutdown("shutdown requested by signal"))
    try:
        box.get(timeout=1.0)
    except Exception as e:  # noqa: BLE001 - whatever the mailbox raises
        wrapped = e
    assert not isinstance(wrapped, Shutdown)
    assert caused_by_shutdown(wrapped)
    assert caused_by_shutdown(Shutdown("x"))


def test_an_ordinary_failure_is_not_a_stop():
    try:
        try:
            raise ValueError("a real fault")
        except ValueError as e:
            raise RuntimeError("weight board: failed") from e
    except RuntimeError as e:
        assert not caused_by_shutdown(e)
    assert not caused_by_shutdown(RuntimeError("alone"))
