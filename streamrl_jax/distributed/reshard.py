"""Which shard of which weight goes from which training process to which generation process.

Host-only and pure (no JAX): a sharding is described here by the index *boxes*
each process addresses, one `((start, stop), ...)` per dimension, as
`Sharding.devices_indices_map(shape)` gives them (`shard_sync.py` derives them).

`make_plan(leaves, sources, needs)`:

* `sources[p][i]`: the boxes of leaf i that training process p addresses (its
  devices' shards; replicas repeat a box, on one process or several);
* `needs[r][i]`: the boxes of leaf i that generation process r must hold (its
  devices' shards of the generation sharding).

For every leaf the distinct source boxes must tile it exactly (true of every
`NamedSharding`: boxes are equal or disjoint); each needed box is then cut into
its intersections with them, and each intersection (a `Piece`) is sent by one
holder of that source box: a box held by several training processes (replicated
over processes) is sent once, by the holder with the fewest bytes assigned so far,
which spreads replicated leaves over the senders. A receiver gets exactly the
bytes of its needed boxes (each once), and a sender sends only slices of shards it
holds. Nothing here materialises a leaf: the receiver holds the full model only
when its own sharding gives it every element (`Plan.full_copies`), e.g. a
generation instance with tensor parallelism 1, which needs every weight on its
device anyway.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension; () for a scalar


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """One weight leaf: its key path, global shape and dtype (name, item size)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def __str__(self) -> str:
        return f"{self.path} {self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class Piece:
    """`box` of leaf `leaf`, cut by `sender` from its shard `source`, for `receiver`'s
    needed box `target` (the `target`-th distinct box the receiver declared)."""

    leaf: int
    sender: int
    receiver: int
    source: Box
    target: int
    box: Box
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    leaves: tuple[LeafLayout, ...]
    pieces: tuple[Piece, ...]
    targets: Mapping[int, tuple[tuple[Box, ...], ...]]  # receiver -> per leaf: distinct boxes

    def between(self, sender: int, receiver: int) -> list[Piece]:
        """The pieces `sender` sends `receiver`, in plan order (leaf, target, source)."""
        return [p for p in self.pieces if p.sender == sender and p.receiver == receiver]

    def bytes_sent(self, sender: int, receiver: int | None = None) -> int:
        return sum(
            p.nbytes for p in self.pieces if p.sender == sender and receiver in (None, p.receiver)
        )

    def full_copies(self) -> list[int]:
        """Receivers whose own sharding gives them every element of every leaf (the
        generation layout forces a full copy on that process)."""
        return [
            r
            for r, per_leaf in sorted(self.targets.items())
            if all(  # distinct boxes of one sharding are disjoint: their volumes add up
                sum(volume(b) for b in boxes) == math.prod(leaf.shape)
                for leaf, boxes in zip(self.leaves, per_leaf, strict=True)
            )
        ]


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of `a` and `b`; None when they do not overlap (a scalar's `()`
    always overlaps itself)."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in out) else out


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Numpy index of `inner` within an array holding `outer`."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box of a `devices_indices_map` index (slices with None ends)."""
    if len(index) != len(shape):
        raise ValueError(f"index {index} does not match shape {tuple(shape)}")
    out = []
    for s, dim in zip(index, shape, strict=True):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"index {index}: strided shards are not supported")
        out.append((start, stop))
    return tuple(out)


def check_box(box: Box, leaf: LeafLayout, who: str) -> None:
    if len(box) != len(leaf.shape) or any(
        not 0 <= start < stop <= dim for (start, stop), dim in zip(box, leaf.shape, strict=True)
    ):
        raise ValueError(f"{who}: box {box} is not inside leaf {leaf.path} {list(leaf.shape)}")


def make_plan(
    leaves: Sequence[LeafLayout],
    sources: Mapping[int, Sequence[Sequence[Box]]],
    needs: Mapping[int, Sequence[Sequence[Box]]],
) -> Plan:
    """The pieces each sender sends each receiver (module docstring).

    Raises:
      ValueError: a process describes another number of leaves, a box outside its
        leaf, or a leaf whose source boxes do not tile it (overlap or gap); the
        message names the leaf and process.
    """
    for role, table in (("training process", sources), ("generation process", needs)):
        for p, per_leaf in table.items():
            if len(per_leaf) != len(leaves):
                raise ValueError(
                    f"{role} {p} describes {len(per_leaf)} leaves; the weights have {len(leaves)}"
                )
            for leaf, boxes in zip(leaves, per_leaf, strict=True):
                for box in boxes:
                    check_box(box, leaf, f"{role} {p}")
    pieces: list[Piece] = []
    load = dict.fromkeys(sorted(sources), 0)  # bytes assigned to each sender so far
    targets: dict[int, list[tuple[Box, ...]]] = {r: [] for r in sorted(needs)}
    for i, leaf in enumerate(leaves):
        holders: dict[Box, list[int]] = {}
        for p in sorted(sources):
            for box in sources[p][i]:
                if p not in holders.setdefault(box, []):
                    holders[box].append(p)
        distinct = sorted(holders)
        _check_tiling(leaf, distinct)
        for r in sorted(needs):
            wanted = tuple(dict.fromkeys(needs[r][i]))  # distinct, in declared order
            targets[r].append(wanted)
            for t, target in enumerate(wanted):
                for source in distinct:
                    box = intersect(source, target)
                    if box is None:
                        continue
                    sender = min(holders[source], key=lambda p: (load[p], p))
                    nbytes = volume(box) * leaf.itemsize
                    load[sender] += nbytes
                    pieces.append(Piece(i, sender, r, source, t, box, nbytes))
    return Plan(tuple(leaves), tuple(pieces), {r: tuple(b) for r, b in targets.items()})


def _check_tiling(leaf: LeafLayout, boxes: list[Box]) -> None:
    total = math.prod(leaf.shape)
    covered = sum(volume(b) for b in boxes)
    overlap = next(
        ((a, b) for j, a in enumerate(boxes) for b in boxes[j + 1 :] if intersect(a, b)), None
    )
    if overlap is not None or covered != total:
        what = (
            f"boxes {overlap[0]} and {overlap[1]} overlap"
            if overlap is not None
            else f"they cover {covered} of its {total} elements"
        )
        raise ValueError(
            f"leaf {leaf.path} {list(leaf.shape)}: the training processes' shards do not tile "
            f"it ({what})"
        )
