"""The resharding plan (distributed/reshard.py): pure, host-only.

Layouts come from real `NamedSharding`s over the 8 test CPU devices, read as
if devices 0-3 were training process 0, 4-7 training process 1 (and, for the
receivers, 0-3 generation process 0, 4-7 generation process 1): the plan only
sees index boxes per process. Every case checks the plan's invariants: each
receiver gets every element of each box it needs exactly once, each piece is
cut from a shard its sender holds, and no box is sent twice to one receiver.
"""

import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.reshard import LeafLayout


def per_process(sharding, shape, processes=2):
    """{process: [boxes]} with devices split evenly into `processes` in device order."""
    n = sharding.mesh.devices.size
    order = {d: k * processes // n for k, d in enumerate(sharding.mesh.devices.flat)}
    out: dict[int, list] = {p: [] for p in range(processes)}
    for d, index in sharding.devices_indices_map(shape).items():
        out[order[d]].append(reshard.box_of(index, shape))
    return out


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def check(plan, sources, needs):
    """The plan's invariants, by counting every element."""
    for r, per_leaf in needs.items():
        for i, leaf in enumerate(plan.leaves):
            for t, target in enumerate(dict.fromkeys(per_leaf[i])):
                hits = np.zeros([b - a for a, b in target], np.int32)
                for p in plan.pieces:
                    if p.receiver == r and p.leaf == i and p.target == t:
                        hits[reshard.relative(p.box, target)] += 1
                        assert p.source in sources[p.sender][i]  # cut from its own shard
                        assert reshard.intersect(p.box, p.source) == p.box
                        assert p.nbytes == reshard.volume(p.box) * leaf.itemsize
                assert (hits == 1).all(), (r, leaf.path, target)


def layouts(*shapes, itemsize=2):
    return [LeafLayout(f"w{i}", s, "bfloat16", itemsize) for i, s in enumerate(shapes)]


def test_fsdp_training_to_replicated_generation_sends_each_half_once_per_receiver():
    shape = (64, 16)
    train = per_process(NamedSharding(mesh((8,), ("fsdp",)), P("fsdp")), shape)
    gen = per_process(NamedSharding(mesh((8,), ("x",)), P()), shape)
    leaves = layouts(shape)
    plan = reshard.make_plan(
        leaves, {p: [b] for p, b in train.items()}, {r: [b] for r, b in gen.items()}
    )
    check(plan, {p: [b] for p, b in train.items()}, {r: [b] for r, b in gen.items()})
    total = leaves[0].nbytes
    for sender in (0, 1):
        for receiver in (0, 1):
            assert plan.bytes_sent(sender, receiver) == total // 2
    assert plan.full_copies() == [0, 1]  # a replicated generation layout forces it


def test_replicated_training_leaves_are_sent_once_and_spread_over_the_senders():
    shapes = [(64,), (64,), (128,), (32,)]
    rep = NamedSharding(mesh((8,), ("fsdp",)), P())
    sources = {p: [per_process(rep, s)[p] for s in shapes] for p in (0, 1)}
    needs = {r: [per_process(rep, s)[r] for s in shapes] for r in (0, 1)}
    plan = reshard.make_plan(layouts(*shapes), sources, needs)
    check(plan, sources, needs)
    total = sum(math.prod(s) * 2 for s in shapes)
    for r in (0, 1):
        received = sum(p.nbytes for p in plan.pieces if p.receiver == r)
        assert received == total  # each element once per receiver
    sent = [plan.bytes_sent(p) for p in (0, 1)]
    assert sum(sent) == 2 * total and min(sent) > 0  # both senders share the work
    assert abs(sent[0] - sent[1]) <= 128 * 2  # within the largest leaf


def test_tp_training_to_tp_generation_on_the_same_axis_moves_matching_shards():
    shape = (16, 64)
    train = per_process(NamedSharding(mesh((4, 2), ("fsdp", "tp")), P(None, "tp")), shape)
    gen = per_process(NamedSharding(mesh((4, 2), ("slots", "tp")), P(None, "tp")), shape)
    sources, needs = {p: [b] for p, b in train.items()}, {r: [b] for r, b in gen.items()}
    plan = reshard.make_plan(layouts(shape), sources, needs)
    check(plan, sources, needs)
    # Every process holds both tp halves here: each receiver gets each half once.
    assert all(reshard.volume(p.box) == 16 * 32 for p in plan.pieces)
    assert len(plan.pieces) == 4


def test_mismatched_fsdp_rows_to_tp_columns_cut_pieces_across_both():
    shape = (24, 12)
    train = per_process(NamedSharding(mesh((8,), ("fsdp",)), P("fsdp")), shape)
    gen_sharding = NamedSharding(mesh((2, 4), ("data", "tp")), P(None, "tp"))
    gen = per_process(gen_sharding, shape)
    sources, needs = {p: [b] for p, b in train.items()}, {r: [b] for r, b in gen.items()}
    plan = reshard.make_plan(layouts(shape), sources, needs)
    check(plan, sources, needs)
    # Receiver r holds columns [3r', 3r'+3) for its devices' tp indices; pieces are
    # the (3-row, 3-column) crossings of training rows and those columns.
    assert {reshard.volume(p.box) for p in plan.pieces} == {9}
    assert plan.full_copies() == [0, 1]  # each process holds all four tp columns


def test_uneven_boxes_and_a_scalar_are_planned_exactly():
    """Hand-made tilings the sharding API does not produce: rows 3, 3, 3, 1 on the
    senders against 5, 5 on the receivers; and a scalar leaf held by both."""
    leaves = [LeafLayout("w", (10, 4), "float32", 4), LeafLayout("step", (), "int32", 4)]
    rows = lambda a, b: ((a, b), (0, 4))  # noqa: E731
    sources = {0: [[rows(0, 3), rows(3, 6)], [()]], 1: [[rows(6, 9), rows(9, 10)], [()]]}
    needs = {0: [[rows(0, 5)], [()]], 1: [[rows(5, 10)], [()]]}
    plan = reshard.make_plan(leaves, sources, needs)
    check(plan, sources, needs)
    assert [p.box for p in plan.between(0, 1) if p.leaf == 0] == [rows(5, 6)]
    assert not [p for p in plan.between(1, 0) if p.leaf == 0]  # 0 holds rows 0-5 itself
    assert sum(p.leaf == 1 for p in plan.pieces) == 2  # the scalar, once per receiver


@pytest.mark.parametrize(
    "sources, match",
    [
        ({0: [[((0, 6), (0, 4))]], 1: [[((5, 10), (0, 4))]]}, "overlap"),
        ({0: [[((0, 5), (0, 4))]], 1: [[((6, 10), (0, 4))]]}, "cover 36 of its 40"),
        ({0: [[((0, 11), (0, 4))]], 1: [[]]}, "not inside leaf w"),
        ({0: [[], []]}, "describes 2 leaves"),
    ],
)
def test_bad_layouts_are_refused_naming_the_leaf(sources, match):
    leaves = [LeafLayout("w", (10, 4), "float32", 4)]
    with pytest.raises(ValueError, match=match):
        reshard.make_plan(leaves, sources, {0: [[((0, 10), (0, 4))]]})
