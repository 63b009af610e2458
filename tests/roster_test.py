"""Who generates what across generation processes, and what a lost one leaves
(processes/roster.py, processes/roster_share.py).

Pure host logic: the ownership rule every process computes alike, the trainer's
record (first copies only, the floor of complete batches, the update it publishes),
a generation process's share of a lost process's groups (`RosterShare.lose`), and the
driver generating them again under their own version.
"""

import queue
import threading
import time
import types

import numpy as np
import pytest

from streamrl_jax.generation.types import GenerationRequest, RequestTag, SamplingParams
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.pipeline.driver import DriverPlan, GenerationDriver, Whole
from streamrl_jax.pipeline.processes.roster import Roster, RosterUpdate, owner, regenerate
from streamrl_jax.pipeline.processes.roster_share import RosterShare
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.pipeline.rollouts import Returned
from streamrl_jax.pipeline.schedules import Schedule


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


ASYNC = Schedule(mode="stream_async", staleness=1, streaming=True, colocated=False, max_lag=1)


def _share(share, roster=None):
    """Generation process `share` = (k, G) in stream_async (batch b needs W_{b-1})."""
    roster = roster or RosterUpdate(0, (), 0, {}, (), {})
    return RosterShare(share[0], share, roster, ASYNC.generation_version, keep=1 + 2)


def _requests(batch, groups, members):
    return [
        GenerationRequest(
            request_id=f"{batch}/{g}/{m}",
            prompt=np.array([1, 2], np.int32),
            max_new_tokens=4,
            sampling=SamplingParams(temperature=1.0),
            tag=RequestTag(batch=batch, group=g, member=m, prompt_id=f"q{g}"),
        )
        for g in range(groups)
        for m in range(members)
    ]


def test_a_batchs_refill_groups_count_after_its_own_groups_are_whole():
    # Dynamic sampling across processes: refills (groups past the batch's own) come after
    # the batch's own groups are whole and the floor moved past it; they are kept once.
    roster = Roster(1, groups=range(2), group_size=2, num_evals=0)
    for group in range(2):
        assert roster.first(_tag(0, group, 0)) and roster.first(_tag(0, group, 1))
    assert not roster.first(_tag(0, 1, 1))  # the floor moved past batch 0
    assert roster.first(_tag(0, 2, 0)) and roster.first(_tag(0, 2, 1))  # its refill
    assert not roster.first(_tag(0, 2, 1))  # a copy of it
    assert roster.first(_tag(1, 3, 0))  # a refill of a batch before its own groups


def test_a_share_takes_over_the_lost_processes_drawn_groups():
    # Generation process 1 of 2 (stream_async, staleness 1: batch b needs W_{b-1}).
    share = _share((1, 2))

    def requests(batch):
        return _requests(batch, groups=4, members=2)

    for b in range(5):
        mine = share.keep(b, requests(b))
        assert sorted({r.tag.group for r in mine}) == [1, 3]
    assert sorted(share._drawn) == [1, 2, 3, 4]  # staleness + 2 batches back
    update = RosterUpdate(1, (0,), floor=3, complete={3: (0,)}, evals_done=(), evals={})
    assert share.lose(update) == 2 + 4  # batch 3: group 2 (0 is whole); batch 4: 0, 2
    again = {v: sorted((r.tag.batch, r.tag.group) for r in rs) for v, rs in share.again().items()}
    assert again == {2: [(3, 2), (3, 2)], 3: [(4, 0), (4, 0), (4, 2), (4, 2)]}  # W_{b-1}
    assert share.again() == {}  # taken once
    later = share.keep(5, requests(5))
    assert sorted({r.tag.group for r in later}) == [0, 1, 2, 3]  # the only one left


def test_reserved_processes_own_batches_from_their_activation_on():
    # 3 generation processes, the last reserved: it owns nothing until the trainer's
    # elastic rule activates it from batch 5; batches drawn before keep their owners.
    roster = Roster(3, groups=range(4), group_size=2, num_evals=0, reserved=(2,))
    assert roster.counts() == (2, 1)
    start = roster._update()
    assert start.lost_at(0) == {2} and start.lost_at(10**6) == {2}
    k, update = roster.activate(5)
    assert k == 2 and update.active_from == {2: 5} and roster.counts() == (3, 0)
    assert update.lost_at(4) == {2} and update.lost_at(5) == frozenset()
    assert RosterUpdate.decode(update.encode()) == update
    assert roster.activate(6) is None  # none left
    # Ownership of batch 4 does not move (nothing generated twice), batch 5's does.
    assert [owner(i, 3, update.lost_at(4)) for i in range(6)] == [0, 1, 0, 0, 1, 1]
    assert [owner(i, 3, update.lost_at(5)) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_losing_the_last_active_process_activates_a_reserved_one_at_the_floor():
    roster = Roster(2, groups=range(2), group_size=1, num_evals=0, reserved=(1,))
    roster.start(3)
    update = roster.lose(0)
    assert update.lost == (0,) and update.active_from == {1: 3}
    assert update.lost_at(3) == {0} and roster.counts() == (1, 0)
    with pytest.raises(ValueError, match="no other is left"):
        roster.lose(1)


def test_a_share_splits_each_batch_under_the_roster_of_its_draw():
    # Generation process 2 of 3 is reserved; activated from batch 3 while batches 1-2
    # are drawn: it generates nothing of them (no regeneration), then its share.
    share = _share((2, 3), RosterUpdate(0, (), 0, {}, (), {}, reserved=(2,)))

    def requests(batch):
        return _requests(batch, groups=6, members=1)

    assert share.keep(1, requests(1)) == [] and share.keep(2, requests(2)) == []
    update = RosterUpdate(1, (), 1, {}, (), {}, reserved=(2,), active_from={2: 3})
    assert share.lose(update) == 0  # batches 1 and 2 keep their owners
    assert [r.tag.group for r in share.keep(3, requests(3))] == [2, 5]
    # Then process 0 is lost: 2 takes its groups of batch 3 (those not already whole)
    # but not of batches 1-2, where it was not active (1 takes them all there).
    lost = RosterUpdate(2, (0,), 1, {3: (0,)}, (), {}, reserved=(2,), active_from={2: 3})
    assert share.lose(lost) == 1
    again = {v: [r.tag.group for r in rs] for v, rs in share.again().items() if rs}
    assert again == {2: [3]}  # W_{b-1}


class _SlowService:
    """Returns each submitted request as a sample 0.2 s later; records every weight
    swap with the number of requests still out at that moment."""

    def __init__(self):
        self.out: queue.Queue = queue.Queue()
        self.swaps: list[tuple[int, int]] = []
        self.driver = None

    def submit(self, requests, instances=None):
        for r in requests:
            sample = types.SimpleNamespace(
                request_id=r.request_id,
                tag=r.tag,
                finish_reason="length",
                prompt=r.prompt,
                num_tokens=4,
            )
            threading.Timer(0.2, self.out.put, (sample,)).start()

    def get(self, timeout):
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None

    def update_weights(self, weights, version):
        self.swaps.append((version, self.driver.pending()))

    def release(self, request_id):
        del request_id  # no slot is kept here


class _Again(Whole):
    """A share that hands back `requests` (under `version`) once."""

    def __init__(self, version, requests):
        self.pending = {version: requests}

    def again(self):
        pending, self.pending = self.pending, {}
        return pending


class _WaitingWeights:
    """Weights whose `wait` runs the driver's idle work once before it returns."""

    def wait(self, version, idle):
        idle()
        return []

    def kept(self, version):
        return []


def test_groups_generated_again_while_waiting_for_weights_finish_before_the_swap():
    # A generation process waiting for W_{v+1} generates a lost process's groups again
    # meanwhile (its weights' `wait` runs the driver's `regenerate`); those under the
    # loaded W_v must all be collected before W_{v+1} replaces it, or their tokens would
    # span versions.
    service = _SlowService()
    live = types.SimpleNamespace(observe=lambda prompt, tokens: None)
    rollout = types.SimpleNamespace(returned=lambda s: Returned(s, []))
    plan = DriverPlan(schedule=ASYNC, start=0, steps=3, loaded_version=1, held_out=(), timeout=30)
    share = _Again(1, _requests(2, groups=1, members=2))
    driver = GenerationDriver(
        service, rollout, live, _WaitingWeights(), share, Requests(2, 4, None, 0, False),
        lambda s: None, FailureLatch("test"), plan,
    )  # fmt: skip
    service.driver = driver
    collector = threading.Thread(target=driver._collect, daemon=True)
    collector.start()
    try:
        driver._load(2)
    finally:
        driver._stop.set()
        collector.join(5)
    assert service.swaps == [(2, 0)]
    assert driver.version == 2 and driver.pending() == 0


class _SettleOnTheLostGroups:
    """A rollout whose batch settles only once the lost process's groups it hands back
    (as the roster watcher would, while the driver settles) were submitted: dynamic
    sampling's wait for every group's verdict, when the lost process made some."""

    def __init__(self, share, service, lost):
        self.share, self.service, self.lost = share, service, lost
        self.settled = False

    def draw(self, batch):
        return []

    def open(self, batch, requests):
        return requests

    def returned(self, sample):
        return Returned(sample, [])

    def settle(self, batch, submit, stopped):
        self.share.pending = {0: self.lost}  # the loss is applied while the batch settles
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not stopped():
            if {r.request_id for r in self.lost} <= self.service.submitted:
                self.settled = True
                return
            time.sleep(0.02)


def test_a_lost_processs_groups_are_generated_again_while_a_batch_settles():
    # The stall of the curriculum over dynamic sampling across processes: generation
    # process 0 lost while process 1's driver waited for batch 0's verdicts, the groups
    # it must generate again were queued but generated only before the next batch,
    # which the wait for exactly their verdicts never reached (the trainer waited 300 s).
    service = _SlowService()
    service.submitted = set()
    submit = service.submit

    def record(requests, instances=None):
        service.submitted |= {r.request_id for r in requests}
        submit(requests, instances)

    service.submit = record
    share = _Again(0, [])
    share.pending = {}
    lost = _requests(0, groups=1, members=2)
    rollout = _SettleOnTheLostGroups(share, service, lost)
    plan = DriverPlan(schedule=ASYNC, start=0, steps=1, loaded_version=0, held_out=(), timeout=30)
    latch = FailureLatch("test")
    driver = GenerationDriver(
        service, rollout, types.SimpleNamespace(plan=lambda b, r: (r, None)), _WaitingWeights(),
        share, Requests(2, 4, None, 0, False), lambda s: None, latch, plan,
    )  # fmt: skip
    service.driver = driver
    driver._drive(types.SimpleNamespace(run=lambda b: None))
    assert latch.error is None
    assert rollout.settled


def test_a_restarted_generation_process_does_not_rejoin_a_curriculum_run():
    # Its draws would depend on its place in the prompt pipeline since the run's start
    # and on the prompts it passed over, which it cannot rebuild: refused by name
    # before it dials anything (the run goes on with the processes it has).
    from support import tiny_config

    from streamrl_jax.distributed import roles
    from streamrl_jax.pipeline.processes.generation import run_generation

    cfg = tiny_config(pipeline__rollout="curriculum+dynamic_sampling")
    r = roles.Roles("generation", 1, 3, (0, 1), (2,), (), (), rejoined=True)
    with pytest.raises(RuntimeError, match="generation-1: restarted into a run of the curric"):
        run_generation(cfg, "/nonexistent", roles.DistributedConfig(), r)
