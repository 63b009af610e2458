"""The shard sync's messages and what they describe (`shard_sync.py`).

Two fixed msgspec schemas with bounds, never a pickle: a receiver's `Need`
(per leaf: key path, shape, dtype and the index boxes its devices hold) and a
sender's `ShardsHeader` (version, sender, per piece: leaf, target box index,
global box, crc32; with the device-to-device path, the transfer server's
address and pull id instead of bytes). Also the JAX-facing helpers that turn
shardings into boxes, and `ShardStats`, the per-sync report.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import msgspec

from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.messages import Str, WireStruct
from streamrl_jax.distributed.wire import WireError

MAX_RANK = 8
MAX_LEAVES = 100_000
# Dtype names a need may declare (`jnp.dtype(x).name`), with their sizes.
ITEMSIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}
DTYPES = tuple(ITEMSIZE)
MAX_BOXES = 4096  # boxes of one leaf a receiver may declare (its devices)
MAX_PIECES = 1 << 20
MAX_PEERS_REPORTED = 48  # per-peer byte counts in a report (a span carries at most 64 figures)
_Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_WireBox = Annotated[tuple[tuple[_Dim, _Dim], ...], msgspec.Meta(max_length=MAX_RANK)]


class _NeedLeaf(WireStruct):
    path: Str
    shape: Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_RANK)]
    dtype: Literal[DTYPES]
    boxes: Annotated[tuple[_WireBox, ...], msgspec.Meta(min_length=1, max_length=MAX_BOXES)]


class _Need(WireStruct, tag="need"):
    process: Annotated[int, msgspec.Meta(ge=0)]
    leaves: Annotated[tuple[_NeedLeaf, ...], msgspec.Meta(max_length=MAX_LEAVES)]


_Leaf = Annotated[int, msgspec.Meta(ge=0)]


class PieceSpec(WireStruct):
    leaf: Annotated[int, msgspec.Meta(ge=0)]
    target: Annotated[int, msgspec.Meta(ge=0)]
    box: _WireBox
    crc32: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)] | None


class OfferedArray(WireStruct):
    """A piece offered on the device-to-device path: the array the receiver will pull."""

    shape: Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_RANK)]
    dtype: Literal[DTYPES]
    boxes: Annotated[tuple[_WireBox, ...], msgspec.Meta(max_length=MAX_BOXES)]  # per device


class XlaOffer(WireStruct):
    """Where to pull the pieces from (`xla_pull.py`): one offered array per piece."""

    address: Str
    uuid: Annotated[int, msgspec.Meta(ge=0)]
    arrays: Annotated[tuple[OfferedArray, ...], msgspec.Meta(max_length=MAX_PIECES)]


class ShardsHeader(WireStruct, tag="shards"):
    version: int
    sender: Annotated[int, msgspec.Meta(ge=0)]
    pieces: Annotated[tuple[PieceSpec, ...], msgspec.Meta(max_length=MAX_PIECES)]
    xla: XlaOffer | None = None  # None: the pieces' bytes follow on the channel
    # Leaves this version keeps from the receiver's previous one (a delta: LoRA's base
    # after the first sync); their pieces are not sent. Empty: every leaf is sent.
    kept: Annotated[tuple[_Leaf, ...], msgspec.Meta(max_length=MAX_PIECES)] = ()


ENCODER = msgspec.msgpack.Encoder()
_NEED_DECODER = msgspec.msgpack.Decoder(_Need)
_SHARDS_DECODER = msgspec.msgpack.Decoder(ShardsHeader)


def _decode(decoder: msgspec.msgpack.Decoder, payload: Any, what: str, source: str) -> Any:
    """`payload` decoded; `WireError` naming `source` when it is not the schema."""
    try:
        return decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as e:
        raise WireError(f"malformed {what} from {source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Need:
    """What one receiver holds of every leaf: `boxes[i]` are leaf i's distinct boxes."""

    process: int
    leaves: tuple[reshard.LeafLayout, ...]
    boxes: tuple[tuple[reshard.Box, ...], ...]

    def encode(self) -> bytes:
        return ENCODER.encode(
            _Need(
                self.process,
                tuple(
                    _NeedLeaf(leaf.path, leaf.shape, leaf.dtype, boxes)
                    for leaf, boxes in zip(self.leaves, self.boxes, strict=True)
                ),
            )
        )

    @staticmethod
    def decode(payload: Any, source: str) -> Need:
        wire = _decode(_NEED_DECODER, payload, "weight need", source)
        leaves, boxes = [], []
        for w in wire.leaves:
            leaf = reshard.LeafLayout(w.path, tuple(w.shape), w.dtype, ITEMSIZE[w.dtype])
            try:
                for box in w.boxes:
                    reshard.check_box(tuple(box), leaf, f"weight need from {source}")
            except ValueError as e:
                raise WireError(str(e)) from None
            leaves.append(leaf)
            boxes.append(tuple(dict.fromkeys(tuple(tuple(d) for d in b) for b in w.boxes)))
        return Need(wire.process, tuple(leaves), tuple(boxes))


def layouts(tree: Any) -> tuple[reshard.LeafLayout, ...]:
    """(key path, shape, dtype) of every leaf of a params-like pytree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for path, x in flat:
        dtype = jnp.dtype(x.dtype)
        out.append(reshard.LeafLayout(jax.tree_util.keystr(path), tuple(x.shape), dtype.name,
                                      dtype.itemsize))  # fmt: skip
    return tuple(out)


def boxes_by_process(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[int, list]:
    """Process index -> the boxes its devices hold of an array of `shape`."""
    out: dict[int, list[reshard.Box]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out.setdefault(device.process_index, []).append(reshard.box_of(index, shape))
    return out


def need_of(shardings: Any, abstract: Any, process: int) -> Need:
    """This generation process's need: the boxes its devices hold under `shardings`
    (a pytree of shardings with `abstract`'s structure) of every leaf of `abstract`."""
    leaves = layouts(abstract)
    flat = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(flat) != len(leaves):
        raise ValueError(f"{len(flat)} shardings for {len(leaves)} weight leaves")
    boxes = []
    for leaf, s in zip(leaves, flat, strict=True):
        mine = [
            reshard.box_of(index, leaf.shape)
            for index in s.addressable_devices_indices_map(leaf.shape).values()
        ]
        boxes.append(tuple(dict.fromkeys(mine)))
    return Need(process, leaves, tuple(boxes))


@dataclasses.dataclass(frozen=True)
class ShardStats:
    """One shard sync as one side saw it (the per-sync report)."""

    version: int
    seconds: float  # sender: cut + wire (+ acknowledged); receiver: first header -> placed
    bytes: dict[str, int]  # per peer (sender: to each receiver; receiver: from each sender)
    checksum: bool
    pack_s: float = 0.0  # sender: device_get of its shards + cutting + crc32
    wire_s: float = 0.0  # receiver: first header -> last byte copied into place
    place_s: float = 0.0  # receiver: device_put into its shardings

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def gbps(self) -> float:
        return self.total_bytes / max(self.seconds, 1e-9) / 1e9

    def report(self) -> dict[str, float]:
        """Flat figures for a trace span / SpanReport."""
        out = {
            "version": float(self.version),
            "seconds": self.seconds,
            "gbps": self.gbps,
            "bytes": float(self.total_bytes),
            "checksum": float(self.checksum),
            "pack_s": self.pack_s,
            "wire_s": self.wire_s,
            "place_s": self.place_s,
        }
        if len(self.bytes) <= MAX_PEERS_REPORTED:
            out.update({f"bytes/{peer}": float(n) for peer, n in self.bytes.items()})
        else:  # a SpanReport carries at most messages.MAX_SPAN_ARGS figures
            out.update(bytes_min=float(min(self.bytes.values())),
                       bytes_max=float(max(self.bytes.values())))  # fmt: skip
        return out


def decode_shards(payload: Any, source: str) -> ShardsHeader:
    """A sender's header; `WireError` naming `source` when malformed (its pieces are
    checked against the receiver's need by the receiver)."""
    return _decode(_SHARDS_DECODER, payload, "weight shards", source)
