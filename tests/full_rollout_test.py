"""The full rollout (pipeline/rollouts/full.py), the registry and the wrapper base, on a
fake stream: which groups each micro-batch of step b holds, in every taking rule
(streaming, batch modes, deterministic, several training processes)."""

import dataclasses
import inspect
import threading

import pytest
from support import group_of_scores, rollout_context

from streamrl_jax import config as config_lib
from streamrl_jax.pipeline import rollouts
from streamrl_jax.pipeline.rollouts.full import FullRollout
from streamrl_jax.pipeline.rollouts.protocol import Rollout, Rounds, Wrapper
from streamrl_jax.pipeline.shards import ownership


def _put(ctx, batch, group, members=2):
    for s in group_of_scores(batch, group, [0.0, 1.0][:members]):
        ctx.stream.put(s, timeout=1)


def _keys(micro):
    return [[(g[0].sample.tag.batch, g[0].sample.tag.group) for g in groups] for groups in micro]


def test_registry_names_are_the_configs():
    assert set(rollouts.KINDS) == set(config_lib.ROLLOUTS)
    assert set(rollouts.WRAPPERS) == set(config_lib.ROLLOUT_WRAPPERS)
    ctx = rollout_context(group_size=2)
    assert isinstance(rollouts.make_rollout("full", ctx), FullRollout)
    wrapped = rollouts.make_rollout("curriculum+full", ctx)
    assert isinstance(wrapped.inner, FullRollout) and wrapped.inner.ctx.prompts is wrapped.prompts

    # The registry hands a wrapper its kit (none here): one that needs it says so.
    with pytest.raises(ValueError, match="'episodes' needs an environment"):
        rollouts.make_rollout("episodes+full", ctx)


def test_the_wrapper_base_hands_every_protocol_method_to_its_inner_kind():
    calls = []

    class Inner:  # answers every method with its name, recording the call
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args)) or name

    wrapper, expected = Wrapper(Inner()), []
    methods = sorted(n for n in vars(Rollout) if not n.startswith("_"))
    assert len(methods) == 12
    returns_nothing = {"settle", "scored", "report", "fail"}
    for name in methods:
        args = tuple(range(len(inspect.signature(getattr(Rollout, name)).parameters) - 1))
        assert getattr(wrapper, name)(*args) == (None if name in returns_nothing else name)
        expected.append((name, args))
    assert calls == expected
    # A wrapper places no episode's turns itself, whatever its inner kind.
    assert not isinstance(wrapper, Rounds)


def test_streaming_trains_groups_of_its_batch_as_they_arrive():
    ctx = rollout_context(
        mode="stream_sync", group_size=2, prompts_per_step=4, min_groups=1, micro_batch_groups=2
    )
    ro = FullRollout(ctx)
    assert [q.problem.prompt_id for q in ro.draw(0)] == ["p0", "p1", "p2", "p3"]
    _put(ctx, 1, 0)  # a later batch's group, delivered early: parked
    _put(ctx, 0, 2)
    micro = ro.micro_batches(0, 0)
    assert _keys([next(micro)]) == [[(0, 2)]]  # min_groups = 1: no wait for more
    for g in (0, 3, 1):
        _put(ctx, 0, g)
    rest = _keys(list(micro))
    assert all(1 <= len(ks) <= 2 for ks in rest)  # at most micro_batch_groups
    assert sorted(k for ks in rest for k in ks) == [(0, 0), (0, 1), (0, 3)]
    _put(ctx, 1, 1)
    _put(ctx, 1, 2)
    _put(ctx, 1, 3)
    assert sorted(k for ks in _keys(ro.micro_batches(1, 0)) for k in ks) == [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    assert ro.finish(1).metrics == {} and ro.state(2) == {} and ro.restore(2, {}) == []
    assert ro.plannable(2, 5) == range(2, 5)


def test_batch_modes_wait_for_the_whole_mini_batch():
    ctx = rollout_context(
        mode="disaggregated_batch", group_size=2, prompts_per_step=4, micro_batch_groups=2
    )
    ro, got = FullRollout(ctx), []
    thread = threading.Thread(target=lambda: got.extend(_keys(ro.micro_batches(0, 0))))
    thread.start()
    for g in (3, 1, 0):
        _put(ctx, 0, g)
    thread.join(0.3)
    assert thread.is_alive() and got == []  # three of the four groups: still waiting
    _put(ctx, 0, 2)
    thread.join(5)
    assert sorted(k for ks in got for k in ks) == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_deterministic_takes_each_micro_batch_in_group_order_members_in_order():
    ctx = rollout_context(
        mode="stream_sync",
        group_size=2,
        prompts_per_step=4,
        micro_batch_groups=2,
        mini_batches=2,
        deterministic=True,
    )
    ro = FullRollout(ctx)
    for g in (3, 2, 1, 0):
        for s in reversed(group_of_scores(0, g, [0.0, 1.0])):
            ctx.stream.put(s, timeout=1)
    first, second = list(ro.micro_batches(0, 0)), list(ro.micro_batches(0, 1))
    assert _keys(first) == [[(0, 0), (0, 1)]] and _keys(second) == [[(0, 2), (0, 3)]]
    assert [s.sample.tag.member for g in first[0] for s in g] == [0, 1, 0, 1]


@dataclasses.dataclass
class _Second:
    """Training process 1 of 2: its slice of every micro-batch (no collectives here)."""

    own: object
    count: int = 2

    def owned(self, mini, j):
        return self.own.local_groups(mini, j, 1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_several_training_processes_take_their_fixed_slice(deterministic):
    ctx = rollout_context(
        mode="stream_sync",
        group_size=2,
        prompts_per_step=4,
        micro_batch_groups=2,
        deterministic=deterministic,
    )
    ctx = dataclasses.replace(ctx, trainers=_Second(ownership(ctx.pipeline, 2)))
    for g in (1, 3):  # this process's groups: index 1 of micro-batch 0, 3 of micro-batch 1
        _put(ctx, 0, g)
    assert _keys(FullRollout(ctx).micro_batches(0, 0)) == [[(0, 1)], [(0, 3)]]
