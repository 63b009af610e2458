"""orbax over an active set: the checkpoints of a multi-controller run's training
processes, saved and restored by them alone (`Checkpointer(processes=...)`)."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp


class _ActiveSetJax:
    """`jax` as orbax's array serializer sees it in an active-set save: the process
    count is the active set's. orbax refuses a fully addressable array when
    `jax.process_count() > 1` (a pmap-era host-local array); with one training process
    in a multi-controller program every array is fully addressable *and* global to
    the active set, so the check must count the active set only."""

    def __init__(self, count: int):
        self._count = count

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def process_count(self) -> int:
        return self._count


def options(processes: tuple[int, ...]) -> tuple[Any, Any]:
    """orbax options and handler registry for saves by `processes` only.

    orbax 0.12.8 needs three things beyond `MultiprocessingOptions` for an active set
    that excludes process 0 (each found by a hang or an error on this machine): every
    item handler built with the options (else its array-metadata store waits for
    process 0 to create a directory), the jax.Array type handler built with the
    primary host (else the zarr metadata is written by process 0 alone, i.e. never),
    and its process count seen as the active set's (`_ActiveSetJax`). Host numpy
    arrays would still be written by process 0 only: `Checkpointer.save` places them
    on the state's mesh first.
    """
    from orbax.checkpoint._src.serialization import jax_array_handlers

    mp = ocp.options.MultiprocessingOptions(
        primary_host=processes[0], active_processes=set(processes)
    )
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(primary_host=processes[0]), override=True
    )
    jax_array_handlers.jax = _ActiveSetJax(len(processes))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    standard = ocp.StandardCheckpointHandler(multiprocessing_options=mp)
    json_handler = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
    for args, handler in (
        (ocp.args.StandardSave, standard),
        (ocp.args.StandardRestore, standard),
        (ocp.args.JsonSave, json_handler),
        (ocp.args.JsonRestore, json_handler),
    ):
        registry.add(None, args, handler)
    return mp, registry
