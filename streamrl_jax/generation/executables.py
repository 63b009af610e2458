"""The engine's jitted executables, and the keys by which engines share them.

`jitted`: prefill, the decode chunk, the logits-keeping prefill, the fork, the
in-place extension of an episode's next turn and the host's stop (a stop string), one set
per (model config, chunk length, placement, top log-probs), so engines of equal statics share one
executable cache (`Engine.compile_count`, `Engine.compile_shapes`). `relayout_fn`:
training layout -> the decoder's layout on an instance's mesh. `signature`: the
params' structure and leaf shapes, what a weight update must keep.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.generation import adapters as adapters_lib
from streamrl_jax.generation import admission, compact, decoder
from streamrl_jax.generation import slots as slots_lib
from streamrl_jax.model.config import ModelConfig


@functools.lru_cache(maxsize=32)
def jitted(
    model_cfg: ModelConfig,
    steps: int,
    state_sh: Any,
    repl: NamedSharding,
    decode_options: tuple[tuple[str, str], ...] = (),
    attention: str = "dot",
    record_routes: bool = False,
    gate_up_parts_major: bool = False,
    top_logprobs: int = 0,
):
    """The jitted prefill, decode chunk, logits-keeping prefill, fork, extension and
    stop (`slots.stop_slots`), shared by engines with equal statics.

    Engines of the same model config, chunk length, decode compiler options
    (`EngineConfig.decode_compiler_options`), decode attention form
    (`EngineConfig.attention`), route recording (`EngineConfig.record_routes`), weight
    layout (`EngineConfig.gate_up_layout`), top log-probs (`EngineConfig.top_logprobs`)
    and
    placement (the slot
    state's shardings: its mesh and cache partitioning, not its shapes) get the
    same two jit objects and so one executable cache, which holds one executable
    per input shape: a static-batch baseline engine next to a continuous one, a
    rebuilt service, or repeated `complete.generate` calls of one shape compile
    nothing new. The key is hashable because `SlotState` is a frozen dataclass
    of `NamedSharding`s. Bounded so that a process building engines on many
    meshes or models does not keep every executable alive; an evicted entry only
    stops being shared with later engines, those holding it keep working.
    """

    def model(weights, form="dot"):
        return decoder.GenModel(weights, model_cfg, form, record_routes, gate_up_parts_major)

    top = top_logprobs

    def prefill(weights, state, adm):
        return slots_lib.prefill_into_slots(model(weights), state, adm, top)

    def chunk(weights, state, rows, seq):
        return compact.decode_compact(model(weights, attention), state, rows, steps, seq, top)

    def prefill_keep(weights, state, store, adm):
        return admission.prefill_keep(model(weights), state, store, adm, top)

    def fork(state, store, adm, src):
        return admission.fork_into_slots(state, store, adm, src, top)

    def extend(weights, state, adm):
        return slots_lib.extend_into_slots(model(weights), state, adm, top)

    out_sh, out3 = (state_sh, repl), (state_sh, repl, repl)
    return (
        jax.jit(prefill, donate_argnums=1, out_shardings=out_sh),
        jax.jit(
            chunk,
            donate_argnums=1,
            out_shardings=out_sh,
            static_argnames="seq",
            compiler_options=dict(decode_options) or None,
        ),
        jax.jit(prefill_keep, donate_argnums=(1, 2), out_shardings=out3),
        jax.jit(fork, donate_argnums=(0, 1), out_shardings=out3),
        jax.jit(extend, donate_argnums=1, out_shardings=out_sh),
        jax.jit(slots_lib.stop_slots, donate_argnums=0, out_shardings=state_sh),
    )


def slot_state(
    model_cfg: ModelConfig,
    num_slots: int,
    max_length: int,
    max_stop_ids: int,
    keys_positions_minor: bool = True,
):
    """(init, shardings, replicated) of an instance's slot state on `mesh` (bound below):
    `init()` builds the all-free `slots.SlotState` (jit it with `out_shardings`), its KV
    cache's keys (`decoder.LayerCache.keys_positions_minor`) and values sharded by
    `decoder.cache_sharding`, everything else replicated."""

    def init() -> slots_lib.SlotState:
        cache = decoder.init_cache(model_cfg, num_slots, max_length, keys_positions_minor)
        return slots_lib.init_slot_state(cache, max_stop_ids)

    def place(mesh: Mesh) -> tuple[Any, NamedSharding]:
        repl = NamedSharding(mesh, PartitionSpec())
        k_sh, v_sh = decoder.cache_sharding(
            model_cfg, num_slots, max_length, mesh, keys_positions_minor
        )
        state_sh = jax.tree.map(lambda _: repl, jax.eval_shape(init))
        layers = model_cfg.num_layers
        cache = state_sh.cache.replace(k=(k_sh,) * layers, v=(v_sh,) * layers)
        return state_sh.replace(cache=cache), repl

    return init, place


def relayout_fn(
    graphdef: nnx.GraphDef,
    model_cfg: ModelConfig,
    mesh: Mesh,
    params: Any,
    weight_dtype: str,
    adapter_slots: int = 0,
    gate_up_parts_major: bool = False,
):
    """Jitted training layout -> `decoder` layout (quantised with "int8"; with
    `adapter_slots`, LoRA unmerged in a table of slots; `gate_up` [2, E, M] with
    `gate_up_parts_major`), placed on the instance's mesh."""
    fn = functools.partial(
        decoder.from_training_layout,
        graphdef,
        cfg=model_cfg,
        weight_dtype=weight_dtype,
        adapter_slots=adapter_slots,
        gate_up_parts_major=gate_up_parts_major,
    )
    shapes = jax.eval_shape(fn, params)
    return jax.jit(fn, out_shardings=decoder.weight_shardings(shapes, mesh, gate_up_parts_major))


def adapter_fns(model_cfg: ModelConfig, mesh: Mesh, params: Any, slots: int):
    """(layout, write) of an engine with adapter slots (`adapters.py`), jitted: `layout`
    takes a model's LoRA adapters (an `nnx.LoRAParam` state) and their scale (alpha / r,
    an f32 scalar: one compile for every alpha) to each layer's entries (no slot axis);
    `write(tables, entries, slot)` puts them in slot `slot` of the
    layers' tables (donated), in the tables' shardings. The tables are never quantised
    (`quant.CONTRACTED` holds none), whatever the engine's weight dtype."""
    dtype = np.dtype(model_cfg.jnp_dtype)

    def layout(adapter_state, scale):
        trained = adapters_lib.adapters_of(model_cfg, adapter_state)
        return tuple(
            adapters_lib.layer_entries(trained, model_cfg, i, dtype, scale)
            for i in range(model_cfg.num_layers)
        )

    def write(tables, entries, slot):
        return tuple(
            {n: t[n].at[slot].set(e[n]) for n in t} for t, e in zip(tables, entries, strict=True)
        )

    shapes = jax.eval_shape(layout, params.filter(nnx.LoRAParam), np.float32(1))
    table_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((slots, *x.shape), x.dtype), shapes)
    table_sh = decoder.weight_shardings({"layers": table_shapes}, mesh)["layers"]
    return jax.jit(layout), jax.jit(write, donate_argnums=0, out_shardings=table_sh)


def signature(params: Any) -> Any:
    leaves, tree = jax.tree.flatten(params)
    return tree, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
