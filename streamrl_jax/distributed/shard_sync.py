"""Shard-to-shard weight sync: each training process sends only its own shards.

Every training process runs a `ShardSender` (here) and every generation process
a `ShardReceiver` (`shard_receiver.py`) that dials all of them (T senders x G
receivers, each pair one CURVE `Channel`; the messages are `shard_wire.py`'s).
It carries every tree that goes training -> generation: the policy (one sender
per training process) and the online ranker's parameters (one more sender, on
the first training process: a host tree, so its shards are whole leaves).

1. On connecting, a receiver sends each sender its *need* (`Need`): for every
   leaf its key path, shape, dtype and the index boxes its own devices hold in
   the generation sharding. A sender refuses a need whose leaves differ from its
   params (naming the first), so both sides agree on the tree before any weight
   moves.
2. Every sender computes the same `reshard.make_plan` from the training
   sharding (`devices_indices_map`: which process addresses which box) and the
   needs, and sends each receiver one `ShardsHeader` (version; per piece: leaf,
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
4. Device to device (`xla=PullServer`, `pipeline.weight_transport="xla"`): the
   header names offered device arrays instead of bytes following; the receiver
   checks each against the layout it pulls into before pulling (`xla_pull.py`).

Memory: a sender copies to host only the shards it sends from (the byte path;
none on the device-to-device path); a receiver allocates only its own boxes. A
process holds the whole model only when its own sharding holds it
(`reshard.Plan.full_copies`, logged with the plan).

Host trees: a leaf that is not a `jax.Array` (a numpy array: the ranker's
parameters, `Ranker.params()`) is one whole box held by the sending process,
sent as bytes.

Flow control: each receiver grants every sender one credit per version,
returned (with the version acknowledged) once `receive` took it; a sender whose
receiver has not taken the previous version waits, up to its timeout, and then
raises `TransportTimeout` naming it.

Deltas (`send(..., changed=leaves)`, a LoRA run's adapter-only sync): only the changed
leaves' pieces are sent; the header names the others as kept, and the receiver takes
them from the version it received before (refusing a delta when it has none). A
catch-up sends the kept versions whole, so a restarted receiver starts from a full copy.

Live-only sends (`send(..., live_only=True)`, the ranker's refreshes: scheduling
quality, never a reason to stop the run): to the receivers that have declared
their need by now, without waiting for the others; a receiver that is lost (or
whose channel failed) is skipped and dropped (logged; its restarted process is
admitted again when it dials in and gets the next send), one that has not taken
the previous version within the timeout, or closed its channel, is skipped.
Each sender plans for the receivers it sees, so live-only sends suit one sender
per tree.

Security: every channel is CURVE with the run key (`peers.py`, the `weights`
channel kind); both messages are fixed msgspec schemas with bounds, never a
pickle. The device-to-device path is not authenticated (`xla_pull.py`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.channel import (
    Channel,
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.peers import Endpoint, Hub
from streamrl_jax.distributed.shard_wire import (
    ENCODER,
    Need,
    OfferedArray,
    PieceSpec,
    ShardsHeader,
    ShardStats,
    XlaOffer,
    boxes_by_process,
    layouts,
)
from streamrl_jax.distributed.xla_pull import PullServer, index_boxes


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
        xla: PullServer | None = None,
        on_lost: Callable[[int, TransportError], bool] | None = None,
        on_rejoin: Callable[[int], None] | None = None,
        keep: int = 1,
    ):
        """`checksum`: crc32 of every piece, checked on arrival (off by default: CURVE
        authenticates every byte). `on_lost(process, error)`: a receiver lost while
        sending; True drops it (the run goes on without it: `pipeline/processes/roster.py`),
        else the error is raised. A dropped receiver that connects again (a restarted
        process) is admitted: `on_rejoin(process)` (on the I/O thread) is told, and
        `catch_up` sends it the kept versions (the last `keep`). `xla`: offer the
        pieces on this transfer server instead of sending their bytes (`xla_pull.py`;
        unauthenticated: opt-in)."""
        if num_receivers < 1:
            raise ValueError(f"{name}: num_receivers must be >= 1, got {num_receivers}")
        self.name, self.process, self.num_receivers = name, process, num_receivers
        self.timeout_s, self.checksum, self._xla = timeout_s, checksum, xla
        self._needs: dict[int, tuple[Channel, Need]] = {}
        self._lost: set[int] = set()  # receivers dropped after a loss (`on_lost`)
        self._on_lost, self._on_rejoin = on_lost, on_rejoin
        self._sending = threading.Lock()  # one version at a time, catch-ups included
        self.keep = keep
        self._kept: dict[int, Any] = {}  # the last `keep` versions sent
        self._only: int | None = None  # a catch-up: its one receiver
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
            rejoined = need.process in self._lost
            if rejoined:
                self._lost.discard(need.process)
                logging.warning("%s: generation process %d rejoined", self.name, need.process)
            elif need.process in self._needs:
                raise TransportError(
                    f"{self.name}: {channel.peer} claims generation process {need.process}, "
                    "which another receiver already is"
                )
            self._needs[need.process] = (channel, need)
            self._cv.notify_all()
        if rejoined and self._on_rejoin is not None:
            self._on_rejoin(need.process)

    def wait_for_receivers(self, timeout: float) -> dict[int, Need]:
        """Blocks until every receiver has connected and declared its need."""
        deadline = time.monotonic() + timeout
        if not self._lost:
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
        self,
        leaves: tuple[reshard.LeafLayout, ...],
        sources: dict[int, list],
        timeout: float,
        *,
        live_only: bool = False,
    ) -> reshard.Plan:
        """The plan for these leaves and sources and the receivers' needs (cached).

        `live_only`: for the receivers that have declared their need so far, without
        waiting for the others (`send(live_only=True)`)."""
        if live_only:
            with self._cv:
                needs = {p: need for p, (_, need) in self._needs.items()}
        else:
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
        key = (
            leaves,
            tuple((p, tuple(map(tuple, b))) for p, b in sorted(sources.items())),
            tuple(sorted(needs)),  # a live-only send plans for the receivers it has
        )
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
        self,
        params: Any,
        version: int,
        *,
        timeout: float | None = None,
        wait_ack: bool = False,
        live_only: bool = False,
        changed: frozenset[int] | None = None,
    ) -> ShardStats:
        """Sends this process's pieces of `params` to every receiver; keeps the last `keep`
        versions for a receiver that rejoins (`catch_up`).

        Args:
          params: jax Arrays (possibly over a mesh spanning several processes) or host
            arrays (whole leaves of this process, sent as bytes).
          live_only: to the receivers connected now (module docstring): a lost one is
            skipped and dropped, one without room within `timeout` skipped this time.
          changed: a delta: the indices (in `jax.tree.leaves` order) of the leaves that
            changed since the previous version, the only ones sent (module docstring);
            None sends every leaf.

        Raises:
          TransportTimeout: a receiver has not declared its need or taken the previous
            version within `timeout` (not with `live_only`).
          PeerLost: a receiver is lost and `on_lost` does not go on without it (not with
            `live_only`).
        """
        with self._sending:
            self._kept[version] = params
            for v in sorted(self._kept)[: -self.keep]:
                del self._kept[v]
            return self._send(params, version, timeout, wait_ack, live_only, changed)

    def catch_up(self, process: int, first: int, timeout: float | None = None) -> list[int]:
        """Sends a receiver that rejoined every kept version from `first` on, in order,
        before any later version; returns the versions sent (none when `first` is not
        made yet: the next `send` includes the receiver). TransportError when `first`
        is older than every kept version."""
        with self._sending:
            versions = [v for v in sorted(self._kept) if v >= first]
            if self._kept and first < min(self._kept):
                raise TransportError(
                    f"{self.name}: generation process {process} rejoined needing W_{first}; "
                    f"kept versions: {sorted(self._kept)}"
                )
            self._only = process
            try:
                for v in versions:
                    self._send(self._kept[v], v, timeout, wait_ack=False)
            finally:
                self._only = None
            return versions

    def _send(
        self,
        params: Any,
        version: int,
        timeout: float | None,
        wait_ack: bool,
        live_only: bool = False,
        changed: frozenset[int] | None = None,
    ) -> ShardStats:
        t0 = time.perf_counter()
        leaves = layouts(params)
        flat = jax.tree.leaves(params)
        sources: dict[int, list] = {}
        for i, x in enumerate(flat):
            if isinstance(x, jax.Array):
                by_process = boxes_by_process(x.sharding, tuple(x.shape))
            elif self._xla is not None:
                raise ValueError(
                    f"{self.name}: leaf {leaves[i]} is a host array; the device-to-device "
                    "path offers device arrays only"
                )
            else:  # a host array: one whole box, held by this process
                by_process = {self.process: [tuple((0, d) for d in np.shape(x))]}
            for p, boxes in by_process.items():
                sources.setdefault(p, [[] for _ in flat])[i] = boxes
        timeout = self.timeout_s if timeout is None else timeout
        plan = self.plan(leaves, sources, timeout, live_only=live_only)
        kept: tuple[int, ...] = ()
        if changed is not None:  # a delta: the changed leaves' pieces alone
            bad = sorted(i for i in changed if not 0 <= i < len(leaves))
            if bad:
                raise ValueError(f"{self.name}: changed leaves {bad} outside [0, {len(leaves)})")
            kept = tuple(i for i in range(len(leaves)) if i not in changed)
            pieces = tuple(p for p in plan.pieces if p.leaf in changed)
            plan = dataclasses.replace(plan, pieces=pieces)
        # Only the shards this process sends from (one per box: replicas skipped).
        used = {(p.leaf, p.source) for p in plan.pieces if p.sender == self.process}
        shards = {}
        for i, x in enumerate(flat):
            if not isinstance(x, jax.Array):
                key = (i, sources[self.process][i][0])
                if key in used:
                    shards[key] = np.asarray(x)
                continue
            for s in x.addressable_shards:
                key = (i, reshard.box_of(s.index, x.shape))
                if key in used and key not in shards:
                    shards[key] = s.data
        opts = dict(t0=t0, timeout=timeout, wait_ack=wait_ack, live_only=live_only, kept=kept)
        return self.send_device_shards(plan, shards, version, **opts)

    def send_device_shards(
        self,
        plan: reshard.Plan,
        shards: dict[tuple[int, reshard.Box], jax.Array],
        version: int,
        *,
        t0: float | None = None,
        timeout: float | None = None,
        wait_ack: bool = False,
        live_only: bool = False,
        kept: tuple[int, ...] = (),
    ) -> ShardStats:
        """`send_shards` from device arrays: offered device to device with `xla`, else
        copied to host (one `device_get` for all of them) and sent as bytes."""
        t0 = time.perf_counter() if t0 is None else t0
        timeout = self.timeout_s if timeout is None else timeout
        if self._xla is not None:
            return self._offer(plan, shards, version, t0, timeout, wait_ack, live_only, kept)
        keys = list(shards)
        host = dict(zip(keys, jax.device_get([shards[k] for k in keys]), strict=True))
        opts = dict(t0=t0, timeout=timeout, wait_ack=wait_ack, live_only=live_only, kept=kept)
        return self.send_shards(plan, host, version, **opts)

    def _offer(self, plan, shards, version, t0, timeout, wait_ack, live_only, kept) -> ShardStats:
        """The device-to-device path: each receiver's pieces offered as device arrays on
        this process's transfer server; the header names them."""
        assert self._xla is not None
        messages = {}
        cuts: dict[tuple, tuple[jax.Array, int | None]] = {}  # a box several receivers need
        for r in self._receivers(plan):
            pieces, arrays = [], []
            for piece in plan.between(self.process, r):
                key = (piece.leaf, piece.source, piece.box)
                if key not in cuts:
                    src = shards[(piece.leaf, piece.source)]
                    region = reshard.relative(piece.box, piece.source)
                    arr = src if piece.box == piece.source else src[region]
                    crc = None
                    if self.checksum:
                        host = np.ascontiguousarray(jax.device_get(arr))
                        crc = zlib.crc32(host.reshape(-1).view(np.uint8))
                    cuts[key] = (arr, crc)
                arr, crc = cuts[key]
                pieces.append(PieceSpec(piece.leaf, piece.target, piece.box, crc))
                arrays.append(arr)
            offered = tuple(
                OfferedArray(tuple(a.shape), jnp.dtype(a.dtype).name,
                             index_boxes(a.sharding, tuple(a.shape)))
                for a in arrays
            )  # fmt: skip
            uuid = self._xla.offer(arrays) if arrays else 0
            offer = XlaOffer(self._xla.address, uuid, offered)
            header = ShardsHeader(version, self.process, tuple(pieces), offer, kept)
            messages[r] = (ENCODER.encode(header), [])
        return self._deliver(plan, messages, version, t0, timeout, wait_ack, live_only)

    def receivers(self) -> list[int]:
        """The generation processes a send reaches now: declared their need, not dropped."""
        with self._cv:
            return sorted(p for p in self._needs if p not in self._lost)

    def _receivers(self, plan: reshard.Plan) -> list[int]:
        """The receivers of `plan` in this sender's order: rotated by its process id, so
        that the senders start on different receivers and every receiver is busy from the
        start (each socket sends its receivers one after another)."""
        only = self._only  # a catch-up: its one receiver
        order = [p for p in self.receivers() if p in plan.targets and only in (None, p)]
        k = self.process % len(order) if order else 0
        return order[k:] + order[:k]

    def send_shards(
        self,
        plan: reshard.Plan,
        shards: dict[tuple[int, reshard.Box], np.ndarray],
        version: int,
        *,
        t0: float | None = None,
        timeout: float | None = None,
        wait_ack: bool = False,
        live_only: bool = False,
        kept: tuple[int, ...] = (),
    ) -> ShardStats:
        """Sends this process's pieces of `plan`, cut from `shards` ((leaf, source box) ->
        the host array of that shard), to every receiver of `plan`; `kept`: the leaves
        a delta keeps from the receivers' previous version (`send`)."""
        t0 = time.perf_counter() if t0 is None else t0
        timeout = self.timeout_s if timeout is None else timeout
        messages = {}
        cuts: dict[tuple, tuple[memoryview, int | None]] = {}  # a box several receivers need
        for r in self._receivers(plan):
            pieces, raw = [], []
            for piece in plan.between(self.process, r):
                key = (piece.leaf, piece.source, piece.box)
                if key not in cuts:
                    src = np.asarray(shards[(piece.leaf, piece.source)])
                    # A copy only when the piece is not contiguous in its shard.
                    cut = np.ascontiguousarray(src[reshard.relative(piece.box, piece.source)])
                    data = memoryview(cut.reshape(-1).view(np.uint8))
                    cuts[key] = (data, zlib.crc32(data) if self.checksum else None)
                data, crc = cuts[key]
                pieces.append(PieceSpec(piece.leaf, piece.target, piece.box, crc))
                raw.append(data)
            header = ShardsHeader(version, self.process, tuple(pieces), kept=kept)
            messages[r] = (ENCODER.encode(header), raw)
        return self._deliver(plan, messages, version, t0, timeout, wait_ack, live_only)

    def _deliver(self, plan, messages, version, t0, timeout, wait_ack, live_only) -> ShardStats:
        """Sends each receiver its header (and bytes), then reports."""
        pack_s = time.perf_counter() - t0
        with self._cv:
            channels = {p: ch for p, (ch, _) in self._needs.items()}
        for r, (payload, raw) in list(messages.items()):
            try:
                channels[r].send(payload, raw=raw, timeout=timeout)
            except TransportError as e:
                if live_only:
                    self._skip(r, version, e)
                elif isinstance(e, PeerLost):
                    self._drop(r, e)
                else:
                    raise
                del messages[r]
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

    def drop(self, process: int) -> None:
        """The owner lost this receiver elsewhere (its sample channel): send it nothing
        more, and admit it again when it reconnects."""
        with self._cv:
            if process not in self._needs or process in self._lost:
                return
            self._lost.add(process)
            channel = self._needs[process][0]
        # A send waiting for its credit wakes now instead of at the channel's timeout.
        channel.fail(PeerLost(f"{self.name}: generation process {process} is lost"))

    def _skip(self, process: int, version: int, exc: TransportError) -> None:
        """A live-only send skips a receiver: one without room (or closed) gets the next
        version; a lost or failed one is dropped (admitted again when its restarted process
        dials in)."""
        if not isinstance(exc, TransportTimeout | ChannelClosed):
            with self._cv:
                self._lost.add(process)
        logging.warning(
            "%s: v%d not sent to generation process %d: %s", self.name, version, process, exc
        )

    def _drop(self, process: int, exc: PeerLost) -> None:
        """A receiver lost mid-send: dropped when the owner goes on without it."""
        if self._on_lost is None or not self._on_lost(process, exc):
            raise exc
        with self._cv:
            self._lost.add(process)
        logging.warning("%s: dropped generation process %d: %s", self.name, process, exc)

    def close(self, timeout: float = 5.0) -> None:
        self._hub.close(timeout)
