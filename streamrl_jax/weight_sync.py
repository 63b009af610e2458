"""Training-mesh parameters → generation-mesh parameters, versioned and timed.

A transfer has two parts, kept apart so a cross-process transport can replace
the second later (DESIGN.md §5):

1. *Cast* on the training mesh (jitted, same sharding unless told otherwise):
   float32 master weights become the generation dtype (e.g. bf16), halving the
   bytes moved.
2. *Move*: a `Mover` function handed in by the owner (composition, not
   subclassing). `place_on(shardings)` is the in-process mover: `jax.device_put`
   onto each generation instance's shardings (between disjoint meshes a
   cross-mesh copy; in colocated mode only a layout change). A multi-controller
   run hands in a mover that sends the cast weights to other processes
   (`pipeline/processes/training.py`).

`WeightSync.transfer` is synchronous and returns timing; `start` runs the
same transfer on a background thread (async mode overlaps it with generation
and training) and `result(timeout)` collects it. The version travels with the
weights: a `Published` pair (params, version) is what an engine receives.

With LoRA (`adapters_only`), the first transfer moves every parameter and each
destination keeps the base it received; later transfers move the adapters
(`nnx.LoRAParam`) alone, and each destination's `Published` params are those
adapters with its own base (the engine merges them as it lays the weights out).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

# A model's parameter pytree (an `nnx.State` of arrays, in a role's sharding and dtype).
Params: TypeAlias = Any


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """One transfer's cost."""

    version: int
    bytes: int  # bytes moved per destination (after the cast)
    seconds: float  # cast + move, blocked until the destination arrays are ready
    destinations: int
    report: dict[str, float] = dataclasses.field(default_factory=dict)  # the mover's own figures

    @property
    def gbps(self) -> float:
        return self.bytes * self.destinations / max(self.seconds, 1e-9) / 1e9


@dataclasses.dataclass(frozen=True)
class Published:
    """Weights as placed on one generation instance, tagged with their policy version."""

    params: Params
    version: int


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# (cast params, version) -> (what each destination now holds, number of destinations
# [, the mover's report: per-sync figures for the trace, e.g. bytes per receiver]).
Mover = Callable[[Any, int], tuple[list[Published], int] | tuple[list[Published], int, dict]]


def place_on(destination_shardings: Sequence[Any]) -> Mover:
    """The in-process mover: `device_put` onto every destination's shardings.

    Args:
      destination_shardings: per generation instance, a pytree of NamedShardings
        with the params' structure (e.g. `sharding.state_shardings(..., "generate")`).
    """
    destinations = list(destination_shardings)

    def move(cast: Any, version: int) -> tuple[list[Published], int]:
        out = [Published(jax.device_put(cast, _like(dst, cast)), version) for dst in destinations]
        # Deliberate sync point: the timing must cover the copy, and an engine
        # must not start decoding on weights still in flight.
        jax.block_until_ready([p.params for p in out])
        return out, len(out)

    return move


def _like(shardings: Any, tree: Any) -> Any:
    """`shardings` (of every parameter) for `tree`: all of them, or the adapters' alone
    when `tree` is a LoRA run's adapters (`WeightSync(adapters_only=True)`)."""
    if jax.tree.structure(shardings) == jax.tree.structure(tree):
        return shardings
    return shardings.filter(nnx.LoRAParam)


def adapter_leaves(params: Any) -> frozenset[int]:
    """Indices (in `jax.tree.leaves` order) of a model state's LoRA adapter leaves
    (`nnx.LoRAParam`): what an adapter-only sync changes after its first version, across
    processes a delta of them (`ShardSender.send(changed=)`)."""
    paths = jax.tree_util.tree_leaves_with_path
    keystr = jax.tree_util.keystr
    adapters = {keystr(p) for p, _ in paths(params.filter(nnx.LoRAParam))}
    return frozenset(i for i, (p, _) in enumerate(paths(params)) if keystr(p) in adapters)


def cast_floats(params: Any, dtype: Any) -> Any:
    """Floating leaves of `params` cast to `dtype` (pure; jitted by `WeightSync`)."""

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, params)


class WeightSync:
    """Casts trainer params to the generation dtype and hands them to a `Mover`."""

    def __init__(
        self,
        dtype: Any,
        move: Mover,
        *,
        cast_sharding: Any = None,
        name: str = "weight_sync",
        adapters_only: bool = False,
        bases: list[Any] | None = None,
    ):
        """Args:
        dtype: generation parameter dtype (floating leaves are cast to it).
        move: places or sends the cast weights (`place_on`, or a cross-process sender).
        cast_sharding: output sharding of the cast (e.g. replicated, to gather a
          training mesh that spans processes before sending); None keeps the input's.
        name: used in logs and errors.
        adapters_only: a LoRA run: after the first transfer only the adapters move
          (module docstring).
        bases: with `adapters_only`, each destination's base already in place (another
          learner's on a shared service): every transfer, the first too, moves the
          adapters alone.
        """
        if bases is not None and not adapters_only:
            raise ValueError(f"{name}: bases are an adapters_only sync's")
        self.dtype = jnp.dtype(dtype)
        self.name = name
        self._move_fn = move
        self.adapters_only = adapters_only
        self._bases: list[Any] | None = bases  # each destination's base (adapters_only)
        # A collective when `cast_sharding` gathers a mesh spanning processes: every
        # training process runs it, in the same order, on its trainer thread.
        out = {} if cast_sharding is None else {"out_shardings": cast_sharding}
        self._cast = jax.jit(functools.partial(cast_floats, dtype=self.dtype), **out)
        self._thread: threading.Thread | None = None
        self._result: tuple[list[Published], SyncStats] | None = None
        self._error: BaseException | None = None
        self.history: list[SyncStats] = []

    @property
    def bases(self) -> list[Any] | None:
        """Each destination's base once placed (`adapters_only`), else None."""
        return self._bases

    def transfer(self, params: Any, version: int) -> tuple[list[Published], SyncStats]:
        """Casts and moves `params`; blocks until every destination holds them."""
        t0 = time.perf_counter()
        return self._move(self._cast(self._what(params)), version, t0)

    def _what(self, params: Any) -> Any:
        """What moves: every parameter, or once the bases are in place the adapters."""
        if self.adapters_only and self._bases is not None:
            return params.filter(nnx.LoRAParam)
        return params

    def _move(self, cast: Any, version: int, t0: float) -> tuple[list[Published], SyncStats]:
        out, destinations, *report = self._move_fn(cast, version)
        if self.adapters_only:
            if self._bases is None:  # the first transfer: every destination keeps its base
                self._bases = [p.params.filter(nnx.Not(nnx.LoRAParam)) for p in out]
            elif len(self._bases) != len(out):
                raise RuntimeError(
                    f"{self.name}: {len(out)} destinations, but bases were placed on "
                    f"{len(self._bases)} (an adapter-only sync needs the same destinations)"
                )
            else:
                out = [
                    Published(nnx.merge_state(p.params, base), p.version)
                    for p, base in zip(out, self._bases, strict=True)
                ]
        stats = SyncStats(
            version=version,
            bytes=tree_bytes(cast),
            seconds=time.perf_counter() - t0,
            destinations=destinations,
            report=report[0] if report else {},
        )
        self.history.append(stats)
        # Every step transfers: the first at INFO (the size, the path), the rest at DEBUG;
        # their seconds are each step's `weight_sync_s` in metrics.jsonl and the trace.
        logging.log(
            logging.INFO if len(self.history) == 1 else logging.DEBUG,
            "%s: version %d, %.1f MB x %d in %.3f s (%.2f GB/s)",
            self.name,
            version,
            stats.bytes / 1e6,
            stats.destinations,
            stats.seconds,
            stats.gbps,
        )
        return out, stats

    # ------------------------------------------------------------------ background
    def start(
        self,
        params: Any,
        version: int,
        on_done: Callable[[list[Published], SyncStats], None] | None = None,
    ) -> None:
        """Starts a transfer whose copy runs on a background thread (one at a time).

        The cast is dispatched here, on the caller's thread, before returning:
        the caller may donate `params` to its next step right after.
        `on_done(published, stats)` runs on the background thread when the
        weights have landed; `result` returns the same.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: a transfer is already in flight; call result()")
        self._result, self._error = None, None
        t0 = time.perf_counter()
        cast = self._cast(self._what(params))

        def run():
            try:
                self._result = self._move(cast, version, t0)
                if on_done is not None:
                    on_done(*self._result)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"{self.name}-v{version}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def result(self, timeout: float) -> tuple[list[Published], SyncStats]:
        """Waits for the background transfer.

        Raises:
          TimeoutError: naming this component when it does not finish in time.
          Exception: whatever the transfer raised.
        """
        if self._thread is None:
            raise RuntimeError(f"{self.name}: no transfer in flight")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name}: transfer did not finish within {timeout:.1f} s")
        self._thread = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
