"""Shard-to-shard weight sync: each training process sends only its own shards.

`weights.py` moves a whole tree from one process; here every training process
runs a `ShardSender` and every generation process a `ShardReceiver` that dials
all of them (T senders x G receivers, each pair one CURVE `Channel`):

1. On connecting, a receiver sends each sender its *need* (`_Need`): for every
   leaf its key path, shape, dtype and the index boxes its own devices hold in
   the generation sharding. A sender refuses a need whose leaves differ from its
   params (naming the first), so both sides agree on the tree before any weight
   moves.
2. Every sender computes the same `reshard.make_plan` from the training
   sharding (`devices_indices_map`: which process addresses which box) and the
   needs, and sends each receiver one `_Shards` header (version; per piece: leaf,
   target box index, global box, crc32) followed by the pieces' bytes, cut from
   its addressable shards (`device_get` of only the shards it sends). A box
   replicated over training processes is sent by one of them.
3. A receiver checks every header against its own need before allocating: each
   piece must lie inside the target box it names and overlap no piece already
   announced for it; so the bytes a sender can make it allocate are bounded by
   its own need. Pieces land directly in the target buffers when their region is
   contiguous there, otherwise in a buffer of their own copied into place on a
   helper thread (which also checksums). Once every sender's header for the
   version has arrived and the announced pieces cover every target box exactly,
   `receive` places the buffers (`jax.make_array_from_callback` into the
   receiver's shardings) and returns `(params, version, ShardStats)`.

Flow control is `weights.py`'s: each receiver grants every sender one credit
per version, returned (with the version acknowledged) once `receive` took it.

Security: the channel is `weights.py`'s (CURVE with the run key, the `weights`
channel kind); both messages are fixed msgspec schemas with bounds, never a
pickle.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
from absl import logging

from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    RawSink,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.messages import Str, WireStruct
from streamrl_jax.distributed.peers import Endpoint, Hub, dial
from streamrl_jax.distributed.weights import ChecksumError, empty_aligned
from streamrl_jax.distributed.wire import DTYPES, ITEMSIZE, MAX_LEAVES, MAX_RANK, WireError
from streamrl_jax.mailbox import Mailbox

MAX_BOXES = 4096  # boxes of one leaf a receiver may declare (its devices)
MAX_PIECES = 1 << 20
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


class _Piece(WireStruct):
    leaf: Annotated[int, msgspec.Meta(ge=0)]
    target: Annotated[int, msgspec.Meta(ge=0)]
    box: _WireBox
    crc32: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)] | None


class _Shards(WireStruct, tag="shards"):
    version: int
    sender: Annotated[int, msgspec.Meta(ge=0)]
    pieces: Annotated[tuple[_Piece, ...], msgspec.Meta(max_length=MAX_PIECES)]


_ENCODER = msgspec.msgpack.Encoder()
_NEED_DECODER = msgspec.msgpack.Decoder(_Need)
_SHARDS_DECODER = msgspec.msgpack.Decoder(_Shards)


def _decode(decoder: msgspec.msgpack.Decoder, payload: Any, what: str, source: str) -> Any:
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
        return _ENCODER.encode(
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
        out.update({f"bytes/{peer}": float(n) for peer, n in self.bytes.items()})
        return out


# ---------------------------------------------------------------------- sender
class ShardSender:
    """Training process `process`: serves `num_receivers` generation processes."""

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        authkey: bytes,
        process: int,
        num_receivers: int,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        name: str = "training",
        checksum: bool = False,
    ):
        if num_receivers < 1:
            raise ValueError(f"{name}: num_receivers must be >= 1, got {num_receivers}")
        self.name, self.process, self.num_receivers = name, process, num_receivers
        self.timeout_s, self.checksum = timeout_s, checksum
        self._needs: dict[int, tuple[Channel, Need]] = {}
        self._cv = threading.Condition()
        self._plans: dict[Any, reshard.Plan] = {}
        self.history: list[ShardStats] = []
        self._hub = Hub(
            Endpoint("weights", name, address, authkey, timeout_s, heartbeat_s),
            max_peers=num_receivers,
            on_data=self._on_need,
            grant=1,  # room for the receiver's one need message
        )

    @property
    def address(self) -> tuple[str, int]:
        return self._hub.address

    def _on_need(self, channel: Channel, payload: memoryview) -> None:
        """The I/O thread: a receiver's need (one per channel: it has one credit)."""
        need = Need.decode(payload, channel.peer)
        with self._cv:
            if need.process in self._needs:
                raise TransportError(
                    f"{self.name}: {channel.peer} claims generation process {need.process}, "
                    "which another receiver already is"
                )
            self._needs[need.process] = (channel, need)
            self._cv.notify_all()

    def wait_for_receivers(self, timeout: float) -> dict[int, Need]:
        """Blocks until every receiver has connected and declared its need."""
        deadline = time.monotonic() + timeout
        self._hub.wait_for_peers(timeout)
        with self._cv:
            ok = self._cv.wait_for(
                lambda: len(self._needs) >= self.num_receivers,
                max(0.0, deadline - time.monotonic()),
            )
            if not ok:
                raise TransportTimeout(
                    f"{self.name}: {len(self._needs)}/{self.num_receivers} receivers declared "
                    f"their weight need within {timeout:.1f} s ({self._hub.names()})"
                )
            return {p: need for p, (_, need) in self._needs.items()}

    def plan(
        self, leaves: tuple[reshard.LeafLayout, ...], sources: dict[int, list], timeout: float
    ) -> reshard.Plan:
        """The plan for these leaves and sources and the receivers' needs (cached)."""
        needs = self.wait_for_receivers(timeout)
        for p, need in needs.items():
            if need.leaves != leaves:
                pairs = zip(need.leaves, leaves, strict=False)
                diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
                detail = (
                    f"leaf {diff}: needs {need.leaves[diff]}, this process sends {leaves[diff]}"
                    if diff is not None
                    else f"{len(need.leaves)} leaves needed, {len(leaves)} sent"
                )
                raise TransportError(
                    f"{self.name}: generation process {p} needs other weights: {detail}"
                )
        key = (leaves, tuple((p, tuple(map(tuple, b))) for p, b in sorted(sources.items())))
        if key not in self._plans:
            per_source = {p: [sources[p][i] for i in range(len(leaves))] for p in sources}
            self._plans[key] = plan = reshard.make_plan(
                leaves, per_source, {p: need.boxes for p, need in needs.items()}
            )
            full = plan.full_copies()
            logging.info(
                "%s: shard plan, %d pieces; sends %.1f MB per sync (%s)%s",
                self.name,
                len(plan.pieces),
                plan.bytes_sent(self.process) / 1e6,
                ", ".join(f"g{r}: {plan.bytes_sent(self.process, r) / 1e6:.1f}" for r in needs),
                f"; generation processes {full} hold a full copy (their sharding)" if full else "",
            )
        return self._plans[key]

    def send(
        self, params: Any, version: int, *, timeout: float | None = None, wait_ack: bool = False
    ) -> ShardStats:
        """Sends this process's pieces of `params` (jax Arrays, possibly over a mesh spanning
        several processes) to every receiver."""
        t0 = time.perf_counter()
        leaves = layouts(params)
        flat = jax.tree.leaves(params)
        sources: dict[int, list] = {}
        for i, x in enumerate(flat):
            for p, boxes in boxes_by_process(x.sharding, tuple(x.shape)).items():
                sources.setdefault(p, [[] for _ in flat])[i] = boxes
        timeout = self.timeout_s if timeout is None else timeout
        plan = self.plan(leaves, sources, timeout)
        # device_get only the shards this process sends from (one per box: replicas skipped).
        used = {(p.leaf, p.source) for p in plan.pieces if p.sender == self.process}
        shards = {}
        for i, x in enumerate(flat):
            for s in x.addressable_shards:
                key = (i, reshard.box_of(s.index, x.shape))
                if key in used and key not in shards:
                    shards[key] = s.data
        keys = list(shards)
        host = dict(zip(keys, jax.device_get([shards[k] for k in keys]), strict=True))
        return self.send_shards(plan, host, version, t0=t0, timeout=timeout, wait_ack=wait_ack)

    def send_shards(
        self,
        plan: reshard.Plan,
        shards: dict[tuple[int, reshard.Box], np.ndarray],
        version: int,
        *,
        t0: float | None = None,
        timeout: float | None = None,
        wait_ack: bool = False,
    ) -> ShardStats:
        """Sends this process's pieces of `plan`, cut from `shards` ((leaf, source box) ->
        the host array of that shard), to every receiver."""
        t0 = time.perf_counter() if t0 is None else t0
        timeout = self.timeout_s if timeout is None else timeout
        with self._cv:
            channels = {p: ch for p, (ch, _) in self._needs.items()}
        messages = {}
        for r in sorted(channels):
            pieces, raw = [], []
            for piece in plan.between(self.process, r):
                src = np.asarray(shards[(piece.leaf, piece.source)])
                cut = np.ascontiguousarray(src[reshard.relative(piece.box, piece.source)])
                data = memoryview(cut.reshape(-1).view(np.uint8))
                crc = zlib.crc32(data) if self.checksum else None
                pieces.append(_Piece(piece.leaf, piece.target, piece.box, crc))
                raw.append(data)
            messages[r] = (_ENCODER.encode(_Shards(version, self.process, tuple(pieces))), raw)
        pack_s = time.perf_counter() - t0
        for r, (payload, raw) in messages.items():
            channels[r].send(payload, raw=raw, timeout=timeout)
        if wait_ack:
            for r in messages:
                channels[r].wait_acked(version, timeout)
        stats = ShardStats(
            version,
            time.perf_counter() - t0,
            {f"generation-{r}": plan.bytes_sent(self.process, r) for r in messages},
            self.checksum,
            pack_s=pack_s,
        )
        self.history.append(stats)
        logging.info(
            "%s: weights v%d, %.1f MB of its shards to %d receiver(s) in %.3f s",
            self.name,
            version,
            stats.total_bytes / 1e6,
            len(messages),
            stats.seconds,
        )
        return stats

    def close(self, timeout: float = 5.0) -> None:
        self._hub.close(timeout)


# ---------------------------------------------------------------------- receiver
@dataclasses.dataclass
class _Assembly:
    """One version being assembled from every sender's pieces."""

    version: int
    t0: float
    buffers: dict[tuple[int, int], np.ndarray]  # (leaf, target) -> the target box's array
    announced: dict[tuple[int, int], list[reshard.Box]]
    headers: dict[int, tuple[Any, ...]]  # sender index -> its pieces
    bytes: dict[str, int]
    remaining: int = 0  # pieces announced and not yet in place
    futures: list[concurrent.futures.Future] = dataclasses.field(default_factory=list)


class ShardReceiver:
    """Generation process: dials every training process; `receive` places the next version."""

    def __init__(
        self,
        addresses: Sequence[str | tuple[str, int]],
        need: Need,
        *,
        authkey: bytes,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        name: str = "generation",
    ):
        self.name, self.timeout_s, self.need = name, timeout_s, need
        self._pending: Mailbox[_Assembly] = Mailbox(
            name, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._lock = threading.Lock()
        self._current: _Assembly | None = None
        self._ended = 0
        # Copies non-contiguous pieces into place and checksums, off the I/O threads.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, f"{name}-place")
        self._volume = {
            (i, t): reshard.volume(box)
            for i, boxes in enumerate(need.boxes)
            for t, box in enumerate(boxes)
        }
        self._channels: list[Channel] = []
        for i, address in enumerate(addresses):
            self._channels.append(
                dial(
                    Endpoint("weights", name, address, authkey, timeout_s, heartbeat_s),
                    on_data=lambda ch, payload, i=i: self._on_data(i, ch, payload),
                    on_lost=lambda ch, exc: self._pending.fail(exc),
                    on_end=self._on_end,
                    grant=1,
                )
            )
        payload = need.encode()
        for channel in self._channels:
            channel.send(payload, timeout=timeout_s)

    def _on_end(self, channel: Channel) -> None:
        with self._lock:
            self._ended += 1
            if self._ended == len(self._channels):
                self._pending.close(f"{channel.peer} closed the channel")

    def _on_data(self, index: int, channel: Channel, payload: memoryview) -> RawSink:
        """An I/O thread: one sender's header; checked against the need, then its bytes."""
        header = _decode(_SHARDS_DECODER, payload, "weight shards", channel.peer)
        with self._lock:
            a = self._current
            if a is None:
                a = _Assembly(header.version, time.perf_counter(), {}, {}, {}, {})
                self._current = a
            if header.version != a.version or index in a.headers:
                raise TransportError(
                    f"{self.name}: {channel.peer} sent weights v{header.version} while v"
                    f"{a.version} is being assembled"
                )
            sinks = [self._admit(a, channel.peer, piece) for piece in header.pieces]
            a.headers[index] = header.pieces
            a.bytes[channel.peer.split(" ")[0]] = sum(v.nbytes for v, _ in sinks)
            a.remaining += len(sinks)
            if not sinks:
                self._maybe_done(a)

        def filled(j: int) -> None:
            view, finish = sinks[j]
            a.futures.append(self._pool.submit(finish))
            with self._lock:
                a.remaining -= 1
                self._maybe_done(a)

        return RawSink([view for view, _ in sinks], filled)

    def _admit(self, a: _Assembly, source: str, piece: _Piece) -> tuple[memoryview, Any]:
        """(where the piece's bytes go, what to run once they are there); under the lock."""
        need = self.need
        box = tuple(tuple(d) for d in piece.box)
        where = f"{self.name}: weights v{a.version} from {source}"
        if piece.leaf >= len(need.leaves) or piece.target >= len(need.boxes[piece.leaf]):
            raise TransportError(f"{where}: a piece names leaf {piece.leaf} / box {piece.target}, "
                                 "which this process does not hold")  # fmt: skip
        leaf = need.leaves[piece.leaf]
        target = need.boxes[piece.leaf][piece.target]
        if len(box) != len(target) or reshard.intersect(box, target) != box:
            raise TransportError(f"{where}: piece {box} of {leaf.path} is outside box {target}")
        key = (piece.leaf, piece.target)
        others = a.announced.setdefault(key, [])
        if any(reshard.intersect(box, o) is not None for o in others):
            raise TransportError(f"{where}: piece {box} of {leaf.path} overlaps another piece")
        others.append(box)
        if key not in a.buffers:
            a.buffers[key] = empty_aligned(
                tuple(stop - start for start, stop in target), jnp.dtype(leaf.dtype)
            )
        region = reshard.relative(box, target)
        dst = a.buffers[key][region] if region else a.buffers[key]  # a scalar: the array
        direct = dst.flags.c_contiguous
        buf = dst if direct else empty_aligned(dst.shape, dst.dtype)
        view = memoryview(buf.reshape(-1).view(np.uint8))

        def finish() -> None:
            if not direct:
                dst[...] = buf
            if piece.crc32 is not None:
                crc = zlib.crc32(view)
                if crc != piece.crc32:
                    raise ChecksumError(
                        f"{where}: piece {box} of {leaf.path} is corrupt (crc32 {crc:#010x}, "
                        f"expected {piece.crc32:#010x})"
                    )

        return view, finish

    def _maybe_done(self, a: _Assembly) -> None:
        """Offers the version once every sender's pieces are in (under the lock)."""
        if a.remaining or len(a.headers) < len(self._channels):
            return
        self._current = None
        # Refused only once closed or failed, when nobody will take it.
        self._pending.offer(a, timeout=0.0)

    def receive(self, shardings: Any, timeout: float | None = None) -> tuple[Any, int, ShardStats]:
        """Waits for the next version from every sender, checks it covers the need and
        places it into `shardings` (the shardings the need was made from).

        Raises:
          TransportError: the senders' pieces do not cover a needed box (named).
          ChecksumError: a piece arrived corrupt (named).
          TransportTimeout / PeerLost / ChannelClosed: as `WeightReceiver.receive`.
        """
        a = self._pending.get(
            timeout=self.timeout_s if timeout is None else timeout,
            what="weights from " + ", ".join(c.peer for c in self._channels),
        )
        for f in a.futures:
            f.result()
        t1 = time.perf_counter()
        for key, volume in self._volume.items():
            got = sum(reshard.volume(b) for b in a.announced.get(key, []))
            if got != volume:
                leaf = self.need.leaves[key[0]]
                raise TransportError(
                    f"{self.name}: weights v{a.version}: the senders covered {got} of the "
                    f"{volume} elements of box {self.need.boxes[key[0]][key[1]]} of {leaf.path}"
                )
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        if [jax.tree_util.keystr(p) for p, _ in flat] != [x.path for x in self.need.leaves]:
            raise ValueError(f"{self.name}: the shardings' tree is not the one the need declared")
        out = []
        for i, ((_, s), leaf) in enumerate(zip(flat, self.need.leaves, strict=True)):
            index = {b: t for t, b in enumerate(self.need.boxes[i])}

            def piece(idx, i=i, index=index, shape=leaf.shape):
                return a.buffers[(i, index[reshard.box_of(idx, shape)])]

            out.append(jax.make_array_from_callback(leaf.shape, s, piece))
        # Deliberate sync point: the caller swaps these in for decoding at once.
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        for channel in self._channels:
            channel.grant(1, a.version)
        stats = ShardStats(
            a.version, t2 - a.t0, dict(a.bytes), any(
                p.crc32 is not None for ps in a.headers.values() for p in ps
            ), wire_s=t1 - a.t0, place_s=t2 - t1,
        )  # fmt: skip
        return jax.tree_util.tree_unflatten(treedef, out), a.version, stats

    def close(self, timeout: float = 5.0) -> None:
        for channel in self._channels:
            channel.close(timeout)
        self._pending.close("the receiver was closed")
        self._pool.shutdown(wait=False, cancel_futures=True)
