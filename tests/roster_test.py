"""Who generates what across generation processes, and what a lost one leaves (roster.py).

Pure host logic: the ownership rule every process computes alike, the trainer's
record (first copies only, the floor of complete batches, the update it publishes),
and the generation driver's share of a lost process's groups (`GenerationDriver.lose`).
"""

import numpy as np
import pytest

from streamrl_jax import config as config_lib
from streamrl_jax.generation.types import GenerationRequest, RequestTag, SamplingParams
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline.driver import GenerationDriver
from streamrl_jax.pipeline.roster import Roster, RosterUpdate, owner, regenerate


def test_owner_moves_only_the_lost_processes_indices():
    assert [owner(i, 3, ()) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    after = [owner(i, 3, {1}) for i in range(6)]
    assert after == [0, 2, 2, 0, 0, 2]  # 1's indices (1, 4) go to live[i % 2] = 2, 0
    assert [owner(i, 3, {1, 2}) for i in range(6)] == [0] * 6
    assert regenerate(range(6), 0, 3, (), {1}) == [4]
    assert regenerate(range(6), 2, 3, (), {1}) == [1]
    assert regenerate(range(6), 0, 3, {1}, {1, 2}) == [1, 2, 5]
    with pytest.raises(ValueError, match="every generation process is lost"):
        owner(0, 2, {0, 1})


def _tag(batch, group, member):
    return RequestTag(batch=batch, group=group, member=member, prompt_id="p")


def test_roster_keeps_first_copies_and_publishes_what_it_has():
    roster = Roster(2, groups=range(2), group_size=2, num_evals=2)
    roster.start(3)  # a resumed run: batches 0-2 are complete
    assert not roster.first(_tag(2, 0, 0))
    assert roster.first(_tag(3, 0, 0)) and roster.first(_tag(3, 0, 1))
    assert not roster.first(_tag(3, 0, 1))  # the copy generated again
    assert roster.first(_tag(3, 1, 0))
    assert roster.first(_tag(4, 1, 0)) and roster.first(_tag(4, 1, 1))
    ev = RequestTag(group=1, prompt_id="e", eval_version=2)
    assert roster.first(ev) and not roster.first(ev)
    update = roster.lose(1)
    assert update == RosterUpdate(
        epoch=1, lost=(1,), floor=3, complete={3: (0,), 4: (1,)}, evals_done=(), evals={2: (1,)}
    )
    assert RosterUpdate.decode(update.encode()) == update
    assert roster.lose(1) is None  # its second channel reporting the same loss
    assert roster.first(_tag(3, 1, 1))  # batch 3 is whole: the floor moves past it
    assert not roster.first(_tag(3, 1, 1))
    with pytest.raises(ValueError, match="no other is left"):
        roster.lose(0)  # the last generation process: the run cannot go on


def _driver(share, staleness=1):
    cd = config_lib.defaults()
    cd.pipeline.mode, cd.pipeline.staleness = "stream_async", staleness
    cd.eval.num_problems = 0
    return GenerationDriver(
        config_lib.from_config_dict(cd),
        service=None,
        live=None,
        eval_prompts=[],
        weights=lambda v: [],
        draw=lambda b, n: [],
        emit=lambda s: None,
        latch=FailureLatch("test"),
        share=share,
    )


def test_driver_takes_over_the_lost_processes_drawn_groups():
    # Generation process 1 of 2 (stream_async, staleness 1: batch b needs W_{b-1}).
    driver = _driver(share=(1, 2))

    def requests(batch):
        return [
            GenerationRequest(
                request_id=f"{batch}/{g}/{m}",
                prompt=np.array([1, 2], np.int32),
                max_new_tokens=4,
                sampling=SamplingParams(temperature=1.0),
                tag=RequestTag(batch=batch, group=g, member=m, prompt_id=f"q{g}"),
            )
            for g in range(4)
            for m in range(2)
        ]

    for b in range(5):
        mine = driver._record(b, requests(b))
        assert sorted({r.tag.group for r in mine}) == [1, 3]
    assert sorted(driver._drawn) == [1, 2, 3, 4]  # staleness + 2 batches back
    update = RosterUpdate(1, (0,), floor=3, complete={3: (0,)}, evals_done=(), evals={})
    assert driver.lose(update) == 2 + 4  # batch 3: group 2 (0 is whole); batch 4: 0, 2
    again = {v: sorted((r.tag.batch, r.tag.group) for r in rs) for v, rs in driver._again.items()}
    assert again == {2: [(3, 2), (3, 2)], 3: [(4, 0), (4, 0), (4, 2), (4, 2)]}  # W_{b-1}
    later = driver._record(5, requests(5))
    assert sorted({r.tag.group for r in later}) == [0, 1, 2, 3]  # the only one left
