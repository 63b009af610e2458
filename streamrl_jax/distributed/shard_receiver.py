"""The receiving side of the shard sync (`shard_sync.py`): one generation process.

`ShardReceiver` dials every training process, declares its need, checks each
sender's header against it before allocating anything, lands the pieces'
bytes in the target boxes (or pulls them device to device, `xla_pull.py`),
and `receive` places a version once every sender's pieces cover every box.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    RawSink,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.peers import Endpoint, dial
from streamrl_jax.distributed.shard_wire import (
    Need,
    PieceSpec,
    ShardsHeader,
    ShardStats,
    decode_shards,
)
from streamrl_jax.distributed.xla_pull import PullServer, check_agreement
from streamrl_jax.mailbox import Mailbox


class ChecksumError(TransportError):
    """A received piece's bytes do not match the sender's checksum."""


def empty_aligned(shape: tuple[int, ...], dtype: jnp.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary.

    XLA:CPU then adopts it in `device_put` without a copy instead of copying it
    again; safe because each received version gets fresh buffers that nothing
    else writes.
    """
    dtype = jnp.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


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
    kept: tuple[int, ...] | None = None  # leaves kept from the previous version (a delta)
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
        xla: PullServer | None = None,
        dial_timeout_s: float | None = None,
        deltas: bool = False,
    ):
        """`need`: what this process holds of every leaf (`shard_wire.need_of`). `xla`:
        pull the pieces a sender offers device-to-device through this transfer server
        (`xla_pull.py`); without it such a header fails the channel. `dial_timeout_s`
        bounds each handshake only (None: `timeout_s`, also the silence bound). `deltas`:
        take versions that keep leaves from the previous one (`ShardSender.send(changed=)`;
        the previous version's arrays are then held until the next); refused otherwise."""
        self.name, self.timeout_s, self.need, self._xla = name, timeout_s, need, xla
        self._pending: Mailbox[_Assembly] = Mailbox(
            name, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        self._lock = threading.Lock()
        self._current: _Assembly | None = None
        self._ended = 0
        self._deltas = deltas
        self._last: list[jax.Array] | None = None  # the previous version's leaves (deltas)
        # Copies non-contiguous pieces into place and checksums, off the I/O threads.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, f"{name}-place")
        self._volume = {
            (i, t): reshard.volume(box)
            for i, boxes in enumerate(need.boxes)
            for t, box in enumerate(boxes)
        }
        self._channels: list[Channel] = []
        try:
            for i, address in enumerate(addresses):
                self._channels.append(
                    dial(
                        Endpoint(
                            "weights",
                            name,
                            address,
                            authkey,
                            timeout_s,
                            heartbeat_s,
                            dial_timeout_s=dial_timeout_s,
                        ),
                        on_data=lambda ch, payload, i=i: self._on_data(i, ch, payload),
                        on_lost=lambda ch, exc: self._pending.fail(exc),
                        on_end=self._on_end,
                        grant=1,
                    )
                )
            payload = need.encode()
            for channel in self._channels:
                channel.send(payload, timeout=timeout_s)
        except BaseException:
            self.close(1.0)  # the senders already dialled see an orderly close
            raise

    def _on_end(self, channel: Channel) -> None:
        with self._lock:
            self._ended += 1
            if self._ended == len(self._channels):
                self._pending.close(f"{channel.peer} closed the channel")

    def _on_data(self, index: int, channel: Channel, payload: memoryview) -> RawSink | None:
        """An I/O thread: one sender's header; checked against the need, then its bytes."""
        header = decode_shards(payload, channel.peer)
        if header.xla is not None:
            self._on_offer(index, channel.peer, header)
            return None
        with self._lock:
            a = self._assembly(index, channel.peer, header)
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

    def _assembly(self, index: int, source: str, header: ShardsHeader) -> _Assembly:
        """The version being assembled, for a header from sender `index` (under the lock)."""
        a = self._current
        if a is None:
            a = self._current = _Assembly(header.version, time.perf_counter(), {}, {}, {}, {})
        if header.version != a.version or index in a.headers:
            raise TransportError(
                f"{self.name}: {source} sent weights v{header.version} while v{a.version} is "
                "being assembled"
            )
        kept = tuple(sorted(set(header.kept)))
        if kept and not self._deltas:
            raise TransportError(
                f"{self.name}: {source} sent weights v{header.version} as a delta; this "
                "receiver takes whole versions only"
            )
        if a.kept is None:
            if any(i >= len(self.need.leaves) for i in kept):
                raise TransportError(
                    f"{self.name}: {source} keeps leaves {list(kept)} of weights "
                    f"v{header.version}; this process holds {len(self.need.leaves)}"
                )
            a.kept = kept
        elif kept != a.kept:
            raise TransportError(
                f"{self.name}: {source} keeps other leaves of weights v{header.version} than "
                "the other senders"
            )
        return a

    def _on_offer(self, index: int, source: str, header: ShardsHeader) -> None:
        """An I/O thread: a device-to-device header. Every piece is checked against the
        need and every offered array against the layout it will be pulled into, then the
        pull runs on the helper thread."""
        offer = header.xla
        if self._xla is None:
            raise TransportError(
                f"{self.name}: {source} offers weights device-to-device "
                "(pipeline.weight_transport='xla'); this process did not opt in"
            )
        if len(offer.arrays) != len(header.pieces):
            raise TransportError(f"{self.name}: {source} offers {len(offer.arrays)} arrays "
                                 f"for {len(header.pieces)} pieces")  # fmt: skip
        device = jax.sharding.SingleDeviceSharding(self._xla.device)
        with self._lock:
            a = self._assembly(index, source, header)
            jobs = []
            for piece, offered in zip(header.pieces, offer.arrays, strict=True):
                key, box, leaf, target, where = self._check(a, source, piece)
                extent = tuple(stop - start for start, stop in box)
                spec = jax.ShapeDtypeStruct(extent, jnp.dtype(leaf.dtype), sharding=device)
                check_agreement((offered.shape, offered.dtype, offered.boxes), spec, where)
                offset = tuple(b0 - t0 for (b0, _), (t0, _) in zip(box, target, strict=True))
                jobs.append((key, target, leaf, spec, offset, piece.crc32, where))
            a.headers[index] = header.pieces
            a.bytes[source.split(" ")[0]] = sum(math.prod(j[3].shape) * j[2].itemsize for j in jobs)
            a.remaining += len(jobs)
            if not jobs:
                self._maybe_done(a)
                return

        def pull() -> None:
            try:
                arrays = self._xla.pull(offer.address, offer.uuid, [j[3] for j in jobs])
                for job, x in zip(jobs, arrays, strict=True):
                    self._assemble_on_device(a, job, x)
            except Exception as e:  # noqa: BLE001 - fails the receive that waits for it
                err = e if isinstance(e, TransportError) else TransportError(f"{source}: {e!r}")
                self._pending.fail(err)
                return
            with self._lock:
                a.remaining -= len(jobs)
                self._maybe_done(a)

        a.futures.append(self._pool.submit(pull))

    @staticmethod
    def _assemble_on_device(a: _Assembly, job: tuple, x: jax.Array) -> None:
        """A pulled piece into its target box, on the device it was pulled to (the helper
        thread: the only writer of `a.buffers` on this path)."""
        key, target, leaf, _, offset, crc32, where = job
        if crc32 is not None:
            crc = zlib.crc32(np.ascontiguousarray(jax.device_get(x)).view(np.uint8))
            if crc != crc32:
                raise ChecksumError(
                    f"{where}: a piece of {leaf.path} is corrupt (crc32 {crc:#010x}, "
                    f"expected {crc32:#010x})"
                )
        shape = tuple(stop - start for start, stop in target)
        if tuple(x.shape) == shape:  # the whole box: the pulled array is the buffer
            a.buffers[key] = x
            return
        if key not in a.buffers:
            a.buffers[key] = jnp.zeros(shape, leaf.dtype, device=x.sharding)
        a.buffers[key] = jax.lax.dynamic_update_slice(a.buffers[key], x, offset)

    def _check(self, a: _Assembly, source: str, piece: PieceSpec) -> tuple:
        """A piece checked against the need and the pieces announced before it (under the
        lock): (key, box, leaf, target box, where) or TransportError naming it."""
        need = self.need
        box = tuple(tuple(d) for d in piece.box)
        where = f"{self.name}: weights v{a.version} from {source}"
        if piece.leaf >= len(need.leaves) or piece.target >= len(need.boxes[piece.leaf]):
            raise TransportError(f"{where}: a piece names leaf {piece.leaf} / box {piece.target}, "
                                 "which this process does not hold")  # fmt: skip
        leaf = need.leaves[piece.leaf]
        if piece.leaf in a.kept:
            raise TransportError(f"{where}: a piece of {leaf.path}, which it declared kept")
        target = need.boxes[piece.leaf][piece.target]
        if len(box) != len(target) or reshard.intersect(box, target) != box:
            raise TransportError(f"{where}: piece {box} of {leaf.path} is outside box {target}")
        key = (piece.leaf, piece.target)
        others = a.announced.setdefault(key, [])
        if any(reshard.intersect(box, o) is not None for o in others):
            raise TransportError(f"{where}: piece {box} of {leaf.path} overlaps another piece")
        others.append(box)
        return key, box, leaf, target, where

    def _admit(self, a: _Assembly, source: str, piece: PieceSpec) -> tuple[memoryview, Any]:
        """(where the piece's bytes go, what to run once they are there); under the lock."""
        key, box, leaf, target, where = self._check(a, source, piece)
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
          TransportTimeout: no version arrived in time (names the senders).
          PeerLost: a sender is gone (even if a version had arrived: fail fast).
          ChannelClosed: every sender closed its channel and nothing is left.
        """
        a = self._pending.get(
            timeout=self.timeout_s if timeout is None else timeout,
            what="weights from " + ", ".join(c.peer for c in self._channels),
        )
        for f in a.futures:
            f.result()
        t1 = time.perf_counter()
        kept = set(a.kept or ())
        if kept and self._last is None:
            raise TransportError(
                f"{self.name}: weights v{a.version} keep {len(kept)} leaves from a previous "
                "version, and this process has received none"
            )
        for key, volume in self._volume.items():
            if key[0] in kept:
                continue
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
            if i in kept:
                out.append(self._last[i])
                continue
            index = {b: t for t, b in enumerate(self.need.boxes[i])}

            def piece(idx, i=i, index=index, shape=leaf.shape):
                return a.buffers[(i, index[reshard.box_of(idx, shape)])]

            out.append(jax.make_array_from_callback(leaf.shape, s, piece))
        # Deliberate sync point: the caller swaps these in for decoding at once.
        jax.block_until_ready(out)
        self._last = out if self._deltas else None
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
