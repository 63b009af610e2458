"""The shard sync's device-to-device data path: `jax.experimental.transfer` (opt-in).

With it the CURVE channel still carries the need and every header (so every
piece is checked against the receiver's need, as on the byte path), but a
piece's bytes do not follow the header: the sender offers the pieces as device
arrays on its transfer server (`await_pull`) and names the pull id and the
offered arrays (shape, dtype, per-device index boxes) in the header; the
receiver checks that each offered array agrees exactly with what it will pull
it into (shape, dtype, and the index boxes of its own single-device sharding)
and only then pulls, then assembles each target box on its device
(`dynamic_update_slice`).

Why the check: a pull into a different shape or sharding than the one offered
returns wrong values without an error (measured here: a (4, 3) float32 array
pulled as (3, 4) came back as the same 12 numbers reshaped; DESIGN.md §5).

Security: the transfer server has **no authentication** and carries the
weights in clear: anyone who can reach its port can pull an offered array (by
guessing its id) or connect. Keep it to trusted networks (a pod's own
interconnect); it is off unless `pipeline.weight_transport="xla"`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging

from streamrl_jax.config import PipelineSection
from streamrl_jax.distributed import reshard
from streamrl_jax.distributed.channel import TransportError


def index_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple:
    """The boxes an array of `shape` has on each device of `sharding`, in device-id order."""
    items = sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id)
    return tuple(reshard.box_of(index, shape) for _, index in items)


def check_agreement(
    offered: tuple[tuple[int, ...], str, tuple], spec: jax.ShapeDtypeStruct, where: str
) -> None:
    """Raises `TransportError` unless the offered (shape, dtype name, index boxes) equal
    the receiving `spec`'s: a pull that disagrees is silently wrong."""
    shape, dtype, boxes = offered
    want = (tuple(spec.shape), jax.numpy.dtype(spec.dtype).name,
            index_boxes(spec.sharding, tuple(spec.shape)))  # fmt: skip
    got = (tuple(shape), dtype, tuple(tuple(tuple(d) for d in b) for b in boxes))
    if got != want:
        raise TransportError(
            f"{where}: the offered array {got} does not match the receiving layout {want}; "
            "refusing the device-to-device pull (it would return wrong values silently)"
        )


class PullServer:
    """One process's transfer server: offers arrays (sender) and pulls them (receiver)."""

    def __init__(self, host: str, device: jax.Device):
        from jax.experimental import transfer  # noqa: PLC0415 - only when opted in

        # An explicit transport address: with [] the server aborted the process on its
        # first connection in jax 0.10.2 (docs/multicontroller.md).
        self._server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.device = device
        self._ids = itertools.count(1)
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, arrays: Sequence[jax.Array]) -> int:
        """Offers `arrays` for one pull; returns its id."""
        uuid = next(self._ids)
        self._server.await_pull(uuid, list(arrays))
        return uuid

    def pull(self, address: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct]) -> list:
        """Pulls offer `uuid` from the server at `address` into `specs` (checked first
        with `check_agreement` by the caller)."""
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            connection = self._connections[address]
        return list(connection.pull(uuid, list(specs)))


def pull_server(pipeline: PipelineSection, host: str) -> PullServer | None:
    """This process's transfer server when `pipeline.weight_transport == "xla"` (on its
    first local device), else None."""
    if pipeline.weight_transport != "xla":
        return None
    logging.warning(
        "pipeline.weight_transport='xla': weights travel device to device through "
        "jax.experimental.transfer, which has no authentication (trusted networks only)"
    )
    return PullServer(host, jax.local_devices()[0])
