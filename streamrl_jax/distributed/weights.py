"""Cross-process weight transfer: the training process → generation processes.

Transport and resharding are kept apart (DESIGN.md §5):

1. *Transport* (`WeightSender.send` → `WeightReceiver`): the sender
   `device_get`s its params (they must be fully addressable by this process:
   a process-local training mesh, or gathered first), and sends one header
   (`wire.encode_header`: version, every leaf's key path, shape, dtype and,
   with `checksum=True`, crc32) followed by each leaf's raw bytes in chunks, straight from the numpy
   buffer (no copy on the sender) into a preallocated numpy buffer on the
   receiver, which first checks the header against the tree it expects
   (`check_header`): nothing a header declares is allocated before that.
2. *Resharding* (`WeightReceiver.receive`): the receiver checks every leaf's
   shape (and crc32, if sent) and key path, then `jax.device_put`s each leaf into the target
   sharding it is given (its own generation mesh, its own layout). Nothing
   about the sender's sharding has to match.

A `jax.experimental.transfer` pull between processes is the device-to-device
alternative; it returns wrong values without an error unless the receiving
sharding matches the sender's exactly (DESIGN.md §5). This path needs no
checksum to be exact: CURVE authenticates every frame (a Poly1305 MAC), so a
byte that changed in transit is never delivered; `checksum=True` adds crc32s
as an end-to-end check of the buffers themselves (it costs ~0.15 s per 538 MB
on each side).

Flow control: each receiver holds at most one weight set not yet taken by
`receive` (one credit); `receive` returns the credit with an acknowledgement
of the version, so `send(..., wait_ack=True)` measures the full trip
(device_get → wire → checksum → device_put on the receiver). A sender whose
receiver has not taken the previous set blocks, up to its timeout, and then
raises `TransportTimeout` naming the receiver.

Security: the channel is authenticated and encrypted with the run key
(`keys.py`); the header is a fixed schema (`wire.py`), never a pickle, so the
receiver places into its own tree structure (a pytree of shardings).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from streamrl_jax.distributed import wire
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    PeerLost,
    RawSink,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.peers import Endpoint, Hub, dial
from streamrl_jax.distributed.wire import LeafSpec, WeightHeader
from streamrl_jax.mailbox import Mailbox


class ChecksumError(TransportError):
    """A received leaf's bytes do not match the sender's checksum."""


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """One transfer's cost, as seen by one side."""

    version: int
    bytes: int  # payload bytes (per receiver)
    seconds: float  # sender: device_get → sent (→ acknowledged with wait_ack); receiver: below
    pack_s: float = 0.0  # sender: device_get + checksums
    wire_s: float = 0.0  # receiver: header arrival → last byte checksummed (overlapped)
    verify_s: float = 0.0  # receiver: comparing the checksums
    place_s: float = 0.0  # receiver: device_put into the target shardings, until ready

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def empty_aligned(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary.

    XLA:CPU then adopts it in `device_put` without a copy (measured: 538 MB
    placed in ~14 ms instead of ~200 ms); safe because each received weight
    set gets fresh buffers that nothing else writes.
    """
    dtype = jnp.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def pack(params: Any, version: int, checksum: bool = True) -> tuple[WeightHeader, list[np.ndarray]]:
    """Host copies of `params`' leaves and the header that describes (and, with
    `checksum`, checksums) them."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in flat:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"weights.pack: leaf {jax.tree_util.keystr(path)} is not fully addressable by "
                "this process; gather it first (e.g. multihost_utils.process_allgather)"
            )
    # One device_get for the whole tree: the copies run concurrently.
    arrays = [np.asarray(a, order="C") for a in jax.device_get([leaf for _, leaf in flat])]
    leaves = tuple(
        LeafSpec(
            jax.tree_util.keystr(path),
            a.shape,
            a.dtype.name,
            zlib.crc32(_bytes_of(a)) if checksum else None,
        )
        for (path, _), a in zip(flat, arrays, strict=True)
    )
    return WeightHeader(version, leaves, treedef), arrays


def expected_leaves(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(key path, shape, dtype name) of every leaf of a params-like pytree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype).name) for p, x in flat]


def check_header(
    header: WeightHeader, expected: list[tuple[str, tuple[int, ...], str]], source: str
) -> None:
    """Raises `TransportError` naming the first leaf whose path, shape or dtype differs
    from `expected`: nothing a header declares is allocated before this passes."""
    got = [(leaf.path, tuple(leaf.shape), leaf.dtype) for leaf in header.leaves]
    if got == expected:
        return
    where = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    detail = (
        f"leaf {where}: declared {got[where]}, expected {expected[where]}"
        if where is not None
        else f"{len(got)} leaves declared, {len(expected)} expected"
    )
    raise TransportError(f"weights from {source}, version {header.version}: {detail}")


def verify(
    header: WeightHeader,
    arrays: list[np.ndarray],
    source: str = "sender",
    crcs: list[int] | None = None,
) -> None:
    """Raises `ChecksumError` naming the first leaf whose bytes do not match the header
    (leaves sent without a checksum are compared by shape only).

    `crcs`: the arrays' crc32s if already computed (the receiver computes them
    while the next leaf is still arriving).
    """
    crcs = crcs or [
        None if spec.crc32 is None else zlib.crc32(_bytes_of(a))
        for spec, a in zip(header.leaves, arrays, strict=True)
    ]
    for spec, a, crc in zip(header.leaves, arrays, crcs, strict=True):
        if crc != spec.crc32 or a.shape != tuple(spec.shape):
            raise ChecksumError(
                f"weights from {source}, version {header.version}: leaf {spec.path} is "
                f"corrupt (crc32 {crc:#010x}, expected {spec.crc32:#010x})"
            )


def place(header: WeightHeader, arrays: list[np.ndarray], shardings: Any) -> Any:
    """`device_put`s each leaf into its target sharding and rebuilds the tree.

    Args:
      shardings: a pytree of `jax.sharding.Sharding` with the params' structure
        (its key paths must equal the sender's), or one `Sharding` for every
        leaf (only in this process: the sender's tree structure does not travel).
    """
    paths = [leaf.path for leaf in header.leaves]
    if isinstance(shardings, jax.sharding.Sharding):
        if header.treedef is None:
            raise ValueError(
                "weights: received weights carry no tree structure; pass a pytree of shardings"
            )
        treedef, targets = header.treedef, [shardings] * len(paths)
    else:
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        want = [jax.tree_util.keystr(p) for p, _ in flat]
        if want != paths:
            diff = next(
                (i for i, (a, b) in enumerate(zip(want, paths, strict=False)) if a != b), None
            )
            where = (
                f"leaf {diff}: target {want[diff]} vs sent {paths[diff]}"
                if diff is not None
                else f"{len(want)} target leaves vs {len(paths)} sent"
            )
            raise ValueError(f"weights version {header.version}: tree mismatch at {where}")
        targets = [s for _, s in flat]
    leaves = [jax.device_put(a, s) for a, s in zip(arrays, targets, strict=True)]
    # Deliberate sync point: the caller swaps these in for decoding at once.
    jax.block_until_ready(leaves)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class WeightSender:
    """Training side: serves `num_receivers` generation processes; `send` pushes to all."""

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        authkey: bytes,
        num_receivers: int = 1,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        name: str = "trainer",
        checksum: bool = False,
    ):
        """`checksum`: also send each leaf's crc32 (the receiver checks it). Off by
        default: CURVE already authenticates every byte (a MAC per frame)."""
        if num_receivers < 1:
            raise ValueError(f"{name}: num_receivers must be >= 1, got {num_receivers}")
        self.name, self.num_receivers, self.timeout_s = name, num_receivers, timeout_s
        self.checksum = checksum
        self._hub = Hub(
            Endpoint("weights", name, address, authkey, timeout_s, heartbeat_s),
            max_peers=num_receivers,
        )

    @property
    def address(self) -> tuple[str, int]:
        return self._hub.address

    def wait_for_receivers(self, timeout: float) -> list[str]:
        """Blocks until all `num_receivers` have connected; returns their names."""
        return self._hub.wait_for_peers(timeout)

    def send(
        self,
        params: Any,
        version: int,
        *,
        timeout: float | None = None,
        wait_ack: bool = False,
        live_only: bool = False,
    ) -> TransferStats:
        """Sends `params` (version `version`) to every receiver, one after another.

        `live_only`: to the receivers connected now, without waiting for the others; a
        receiver that is lost, or has not taken the previous version within `timeout`,
        is skipped (logged, it gets the next send if it is back), and a restarted one
        is served again once it has dialed in (the online ranker's refreshes: scheduling
        quality, never a reason to stop the run).

        Raises:
          TransportTimeout: a receiver has not taken the previous version (or,
            with `wait_ack`, not placed this one) within `timeout`.
          PeerLost: a receiver is gone.
        """
        timeout = self.timeout_s if timeout is None else timeout
        t0 = time.perf_counter()
        header, arrays = pack(params, version, self.checksum)
        pack_s = time.perf_counter() - t0
        payload = wire.encode_header(header)
        raw = [_bytes_of(a) for a in arrays]
        if not live_only:
            self.wait_for_receivers(timeout)
        channels = self._hub.channels
        sent = []
        for channel in channels:
            try:
                channel.send(payload, raw=raw, timeout=timeout)
                sent.append(channel)
            except (PeerLost, TransportTimeout) as e:
                if not live_only:
                    raise
                logging.warning("%s: v%d not sent to %s: %s", self.name, version, channel.peer, e)
        channels = sent
        if wait_ack:
            for channel in channels:
                channel.wait_acked(version, timeout)
        stats = TransferStats(version, header.nbytes, time.perf_counter() - t0, pack_s=pack_s)
        logging.info(
            "%s: weights v%d, %.1f MB to %d receiver(s) in %.3f s",
            self.name,
            version,
            stats.bytes / 1e6,
            len(channels),
            stats.seconds,
        )
        return stats

    def close(self, timeout: float = 5.0) -> None:
        self._hub.close(timeout)


# One arrived weight set: header, leaves, their crc32s, seconds on the wire.
_Arrived = tuple[WeightHeader, list[np.ndarray], list[int], float]


class WeightReceiver:
    """Generation side: receives weight sets in the background; `receive` places the newest."""

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        authkey: bytes,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        name: str = "generation",
        expected: Any = None,
    ):
        """`expected`: a pytree with the params' structure whose leaves have `shape` and
        `dtype` (e.g. the abstract generation params); a header that declares anything
        else is refused before any buffer is allocated. None accepts any header."""
        self.name, self.timeout_s = name, timeout_s
        self._expected = None if expected is None else expected_leaves(expected)
        # Arrived weight sets not yet taken by `receive`: at most one, as the
        # receiver grants one credit at a time.
        self._pending: Mailbox[_Arrived] = Mailbox(
            name, failed=None, closed=ChannelClosed, timeout_error=TransportTimeout
        )
        # Checksums leaf i while leaf i+1 arrives (zlib releases the GIL).
        self._crc = concurrent.futures.ThreadPoolExecutor(1, f"{name}-crc")
        self._channel = dial(
            Endpoint("weights", name, address, authkey, timeout_s, heartbeat_s),
            on_data=self._on_data,
            on_lost=lambda channel, exc: self._pending.fail(exc),
            on_end=lambda channel: self._pending.close(f"{channel.peer} closed the channel"),
            grant=1,  # room for one weight set not yet taken by `receive`
        )

    def _on_data(self, channel: Channel, payload: memoryview) -> RawSink:
        """The I/O thread: check the header, allocate, and take the leaves' bytes."""
        t0 = time.perf_counter()
        header = wire.decode_header(payload, source=channel.peer)
        if self._expected is not None:
            check_header(header, self._expected, channel.peer)
        arrays = [empty_aligned(leaf.shape, leaf.dtype) for leaf in header.leaves]
        crcs: list[Any] = [None] * len(arrays)

        def filled(i: int) -> None:
            if header.leaves[i].crc32 is not None:
                crcs[i] = self._crc.submit(zlib.crc32, _bytes_of(arrays[i]))
            if i == len(arrays) - 1:
                done = [None if f is None else f.result() for f in crcs]
                # Refused only once closed or failed, when nobody will take it.
                self._pending.offer((header, arrays, done, time.perf_counter() - t0), timeout=0.0)

        if not arrays:
            self._pending.offer((header, arrays, [], 0.0), timeout=0.0)
        return RawSink([_bytes_of(a) for a in arrays], filled)

    def receive(
        self, shardings: Any, timeout: float | None = None
    ) -> tuple[Any, int, TransferStats]:
        """Waits for the next weight set, verifies it and places it into `shardings`.

        Returns:
          (params, version, stats) with `stats.seconds` = wire + verify + place.

        Raises:
          ChecksumError: a leaf arrived corrupt (named).
          ValueError: `shardings` does not have the sender's tree structure.
          TransportTimeout: nothing arrived in time (names the sender).
          PeerLost: the sender is gone (even if a weight set had arrived: fail fast).
          ChannelClosed: the sender closed the channel and nothing is left.
        """
        header, arrays, crcs, wire_s = self._pending.get(
            timeout=self.timeout_s if timeout is None else timeout,
            what=f"weights from {self._channel.peer}",
        )
        t1 = time.perf_counter()
        verify(header, arrays, self._channel.peer, crcs)
        t2 = time.perf_counter()
        params = place(header, arrays, shardings)
        t3 = time.perf_counter()
        self._channel.grant(1, header.version)
        stats = TransferStats(
            header.version,
            header.nbytes,
            wire_s + t3 - t1,
            wire_s=wire_s,
            verify_s=t2 - t1,
            place_s=t3 - t2,
        )
        return params, header.version, stats

    def close(self, timeout: float = 5.0) -> None:
        self._channel.close(timeout)
        self._pending.close("the receiver was closed")
        self._crc.shutdown(wait=False, cancel_futures=True)
