"""Several training processes: which groups each one trains, and the few values they agree on.

With T > 1 training processes the training mesh spans all of their devices and
the trainer is one SPMD program: every training process must call the same
jitted functions, in the same order, on arrays of the same global shape. Each
process feeds its own rows of every micro-batch
(`jax.make_array_from_process_local_data`), so samples never move between
training processes:

* **Ownership.** Micro-batch j of mini-batch k holds the groups
  `k*per_mini + j*m .. + size` (m = `pipeline.micro_batch_groups`,
  size = min(m, per_mini - j*m)), exactly as in one process; training process t
  owns the t-th of T equal slices of them. Generation processes send each
  group's samples to its owner only, so the global micro-batch (process 0's rows,
  then process 1's, ...) holds the same groups in the same order as one
  process's. Needs T | m and T | per_mini (checked at start-up).
* **Agreement.** Before each micro-batch the processes agree (a max over the
  training mesh) on the padded shape, since the longest sequence and the rows
  kept by the version gate differ per process; a process whose groups were all
  dropped feeds padding rows. Per-step host statistics (rewards, lengths,
  staleness, sample counts) are summed the same way, so every training process
  reports the whole batch.

Both are collectives over the training mesh only (the generation processes
take no part), issued on the trainer thread in program order.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.config import PipelineSection, check_training_split
from streamrl_jax.model import routes as routes_lib
from streamrl_jax.trainer.batch import TrainBatch

K = TypeVar("K")


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Which training process trains which group of a batch."""

    count: int  # T training processes
    per_mini: int  # groups per mini-batch
    micro: int  # groups per micro-batch (in one process)

    def __post_init__(self):
        check_training_split(self.count, self.per_mini, self.micro)  # config.check's rule

    def _slot(self, group: int) -> tuple[int, int, int, int]:
        """(mini-batch, micro-batch, position, micro-batch size) of a group index."""
        k, r = divmod(group, self.per_mini)
        j, pos = divmod(r, self.micro)
        return k, j, pos, min(self.micro, self.per_mini - j * self.micro)

    def owner(self, group: int) -> int:
        _, _, pos, size = self._slot(group)
        return pos // (size // self.count)

    def micro_batches(self) -> int:
        """Micro-batches per mini-batch."""
        return -(-self.per_mini // self.micro)

    def settled_slices(
        self, keys: Sequence[K], group: Callable[[K], int], process: int
    ) -> Iterator[list[K]]:
        """A step whose groups are known only once they are settled (dynamic sampling's
        informative groups, a partial-rollout round's completed ones): of `keys` (in
        order, the same on every training process), those `process` owns by group index
        (`owner`, as every group), `micro / count` per micro-batch, as many micro-batches
        as the process with the most needs (every process makes the same calls; one with
        fewer feeds padding rows)."""
        per = self.micro // self.count
        counts = collections.Counter(self.owner(group(k)) for k in keys)
        mine = [k for k in keys if self.owner(group(k)) == process]
        for j in range(-(-max(counts.values(), default=0) // per)):
            yield mine[j * per : (j + 1) * per]

    def local_groups(self, mini: int, j: int, process: int) -> list[int]:
        """Group indices (in order) that training process `process` feeds to micro-batch
        `j` of mini-batch `mini`."""
        first = mini * self.per_mini + j * self.micro
        size = min(self.micro, self.per_mini - j * self.micro)
        share = size // self.count
        return list(range(first + process * share, first + (process + 1) * share))


def ownership(p: PipelineSection, training_processes: int) -> Ownership:
    """Which training process trains which group of the run's batches; ValueError if the
    processes cannot split every micro-batch equally."""
    return Ownership(training_processes, p.prompts_per_step // p.mini_batches, p.micro_batch_groups)


class TrainerShare(Protocol):
    """This process's share of the training: which groups of every micro-batch it feeds,
    and the values all training processes agree on (`Alone`: one training process;
    `TrainingGroup`: several)."""

    count: int  # training processes
    index: int  # this one's, 0 .. count - 1
    own: Ownership

    def owned(self, mini: int, j: int) -> list[int]:
        """Group indices (in order) this process feeds to micro-batch j of mini-batch
        `mini` (the deterministic split)."""

    def agree(
        self,
        batch: TrainBatch | None,
        pad_id: int,
        buckets: Sequence[int],
        routing_replay: routes_lib.Spec | None = None,
    ) -> TrainBatch | None:
        """This process's rows of a micro-batch in the shape all processes agreed on
        (with routes of `routing_replay`'s size when routes are replayed)."""

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the training processes."""

    def max(self, values: Sequence[int]) -> list[int]:
        """Element-wise maxima over the training processes."""


class Alone:
    """One training process: it owns every group, and agrees with itself."""

    count, index = 1, 0

    def __init__(self, ownership: Ownership):
        self.own = ownership

    def owned(self, mini: int, j: int) -> list[int]:
        return self.own.local_groups(mini, j, 0)

    def agree(
        self,
        batch: TrainBatch | None,
        pad_id: int,
        buckets: Sequence[int],
        routing_replay: routes_lib.Spec | None = None,
    ) -> TrainBatch | None:
        del pad_id, buckets, routing_replay
        return batch

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def max(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


class TrainingGroup:
    """The training processes' collectives: shape agreement, sums and maxima."""

    def __init__(self, mesh: Mesh, ownership: Ownership, index: int):
        self.mesh, self.own, self.index = mesh, ownership, index
        self.fsdp = mesh.shape["fsdp"]
        if self.fsdp % ownership.count:
            raise ValueError(
                f"training mesh fsdp size {self.fsdp} is not a multiple of the "
                f"{ownership.count} training processes"
            )
        self._rows = NamedSharding(mesh, PartitionSpec("fsdp"))
        rep = NamedSharding(mesh, PartitionSpec())
        self._max = jax.jit(lambda x: x.max(0), out_shardings=rep)
        self._sum = jax.jit(lambda x: x.sum(0), out_shardings=rep)

    @property
    def count(self) -> int:
        return self.own.count

    def owned(self, mini: int, j: int) -> list[int]:
        return self.own.local_groups(mini, j, self.index)

    def _global(self, rows: np.ndarray) -> jax.Array:
        """[fsdp / T, k] rows of this process -> a [fsdp, k] array over the training mesh."""
        return jax.make_array_from_process_local_data(self._rows, rows, (self.fsdp, rows.shape[1]))

    def max(self, values: Sequence[int]) -> list[int]:
        """Element-wise max of `values` over the training processes."""
        local = np.tile(np.asarray(values, np.int32)[None], (self.fsdp // self.count, 1))
        return [int(v) for v in host(self._max(self._global(local)))]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of `values` over the training processes (float32)."""
        local = np.zeros((self.fsdp // self.count, len(values)), np.float32)
        local[0] = values
        return [float(v) for v in host(self._sum(self._global(local)))]

    def agree(
        self,
        batch: TrainBatch | None,
        pad_id: int,
        buckets: Sequence[int],
        routing_replay: routes_lib.Spec | None = None,
    ):
        """This process's rows of a micro-batch, padded to the shape all processes agreed
        on (rows, columns and `loss_columns` width); None when every process's groups
        were dropped (all skip the micro-batch).

        `buckets` are the trainer's global batch buckets (each divisible by the fsdp size).
        """
        rows = 0 if batch is None else int(batch.attention_mask.any(axis=1).sum())
        seq = 0 if batch is None else batch.tokens.shape[1]
        width = 0 if batch is None else batch.loss_columns.shape[1]
        max_rows, max_seq, max_width = self.max([rows, seq, width])
        if max_rows == 0:
            return None
        need = max_rows * self.count
        fits = [b for b in buckets if b >= need]
        if not fits:
            raise ValueError(f"micro-batch of {need} rows exceeds the batch buckets {buckets}")
        local_rows = fits[0] // self.count
        return pad_batch(
            batch, local_rows, max_seq, pad_id, width=max_width, routing_replay=routing_replay
        )


def pad_batch(
    batch: TrainBatch | None,
    rows: int,
    seq: int,
    pad_id: int,
    width: int | None = None,
    routing_replay: routes_lib.Spec | None = None,
) -> TrainBatch:
    """`batch` padded (or cut: its real rows come first) to [rows, seq], its
    `loss_columns` to [rows, width] (None: its own width; 1 for None); an all-padding
    batch for None (with routes of `routing_replay`'s size when given). Padding rows and
    columns are masked out of every loss term, every padding `loss_columns` entry is
    `seq` (out of range), and padding routes are `no_route`."""

    def fit(x: np.ndarray | None, fill: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        out = np.full(shape, fill, dtype)
        if x is not None:
            r, *t = x.shape
            r = min(r, shape[0])
            if t:
                out[:r, : t[0]] = x[:r]
            else:
                out[:r] = x[:r]
        return out

    f = (lambda name: None) if batch is None else (lambda name: getattr(batch, name))
    fields = {}
    for name in TrainBatch.__dataclass_fields__:
        if name == "loss_columns":
            old = f(name)
            w = width or (1 if old is None else old.shape[1])
            if old is not None:  # entries past the old row end stay past the new one
                old = np.where(old >= batch.tokens.shape[1], seq, old)
            fields[name] = fit(old, seq, np.int32, (rows, w))
        elif name in ("prefix_ids", "group_ids"):
            fields[name] = fit(f(name), -1, np.int32, (rows, seq))
        elif name in ("positions", "segment_ids"):
            fields[name] = fit(f(name), 0, np.int32, (rows, seq))
        elif name == "tokens":
            fields[name] = fit(f(name), pad_id, np.int32, (rows, seq))
        elif name in ("attention_mask", "loss_mask"):
            fields[name] = fit(f(name), False, bool, (rows, seq))
        elif name == "routes":  # a replayed run's batches all carry them (None: absent)
            spec = routing_replay
            if spec is not None:
                shape = (rows, seq, spec.layers, spec.k)
                fields[name] = fit(f(name), spec.no_route, spec.dtype, shape)
        else:
            fields[name] = fit(f(name), 0, np.float32, (rows, seq))
    return TrainBatch(**fields)


def host(x: Any) -> Any:
    """Host copy of a (possibly multi-process, replicated) array or pytree of them.

    A value replicated over a mesh that spans processes is not fully addressable, so
    `jax.device_get` refuses it; any local shard holds all of it.
    """

    def one(a: Any) -> Any:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if not a.sharding.is_fully_replicated:
                raise ValueError(
                    f"host(): a {a.shape} array sharded over other processes; gather it first"
                )
            a = a.addressable_shards[0].data
        return np.asarray(jax.device_get(a))

    return jax.tree.map(one, x)
