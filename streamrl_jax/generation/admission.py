"""Admission rows and shared-prompt prefill: a group's prompt is prefilled once.

The G samples of a GRPO group share one prompt and differ only in their seeds.
With `EngineConfig.share_prefill` the engine prefills such a prompt once and
*forks* every other member from a slot that already holds it:

* a prefill keeps each row's last-token logits in a per-slot store
  (`prefill_keep`: `prefill_into_slots` plus the store write);
* a fork (`fork_into_slots`) copies the source slot's KV at positions
  [0, max_prompt_length) and its stored logits into the member's slot, then
  samples the member's first token from those logits with the member's own key
  and sampling parameters (`slots.start_rows`, the prefill's own tail).

A slot's prompt KV (positions below its prompt length) and its store row are
written only by a prefill or a fork into that slot; decode writes at positions
>= the prompt length and attention masks everything past the current position.
So a slot keeps serving as a fork source after its sample finished, until the
slot is admitted to again (`PromptSources` tracks this on the host), and a
forked member's KV and first-token logits are the very bits its own prefill
would have produced: prefill rows are computed independently of their
batch-mates and row position (tested bitwise), and a fork samples with the
prefill's batch shape. New weights clear the table (a member admitted after an
update is prefilled by the new weights, as without sharing). A continuation (a
paused sample's prompt + response so far) is never shared.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from streamrl_jax.generation import slots as slots_lib
from streamrl_jax.generation.decoder import GenModel, cache_prefix, set_cache_prefix
from streamrl_jax.generation.sampling import request_key_data
from streamrl_jax.generation.types import GenerationRequest

Row = tuple[int, GenerationRequest]  # (destination slot, request)
Fork = tuple[int, GenerationRequest, int]  # (destination slot, request, source slot)


def build_admission(
    rows: Sequence[Row],
    p: int,
    *,
    n: int,
    num_slots: int,
    max_stop_ids: int,
    stop_ids=(),
    starts: Sequence[int] | None = None,
) -> slots_lib.Admission:
    """Host arrays of `rows` padded to `n` rows (padding goes to slot `num_slots`, dropped).

    `p` is the prefill length (the rows' bucket). `starts`: per row, the tokens of
    prompt + continuation its slot's KV already holds (an episode's next turn, extended
    in place: `tokens` holds only the rest); None: prefill everything.
    """
    tokens = np.zeros((n, p), np.int32)
    lengths = np.ones((n,), np.int32)
    slot_ids = np.full((n,), num_slots, np.int32)  # out of range: dropped
    limit = np.ones((n,), np.int32)
    forced = np.zeros((n,), bool)
    keys = np.zeros((n, 2), np.uint32)
    temp, top_p = np.zeros((n,), np.float32), np.ones((n,), np.float32)
    top_k = np.zeros((n,), np.int32)
    stops = np.full((n, max_stop_ids), -1, np.int32)
    generated = np.zeros((n,), np.int32)
    pause_at = np.full((n,), np.iinfo(np.int32).max, np.int32)
    start = np.zeros((n,), np.int32)
    adapter = np.full((n,), -1, np.int32)
    for i, (slot, r) in enumerate(rows):
        held = 0 if starts is None else starts[i]
        full = list(r.prompt)
        if r.continuation is not None:
            full += r.continuation.tokens.tolist()
        new = full[held:]
        tokens[i, : len(new)] = new
        start[i] = held
        generated[i] = r.generated
        if r.segment_tokens is not None:
            pause_at[i] = r.generated + r.segment_tokens
        lengths[i], slot_ids[i], adapter[i] = len(full), slot, r.adapter
        forced[i] = r.forced_length is not None
        limit[i] = r.forced_length if forced[i] else r.max_new_tokens
        keys[i] = request_key_data(r.seed)
        s = r.sampling
        temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
        ids = s.stop_ids or stop_ids
        stops[i, : len(ids)] = ids
    return slots_lib.Admission(
        tokens=tokens,
        lengths=lengths,
        slots=slot_ids,
        limit=limit,
        forced=forced,
        key_data=keys,
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stops,
        generated=generated,
        pause_at=pause_at,
        start=start,
        adapter=adapter,
    )


def prompt_key(req: GenerationRequest) -> bytes | None:
    """What must match for two requests to share a prefill (None: never shared)."""
    if req.continuation is not None:
        return None
    # The adapter decides the prompt's KV (its k and v projections may be adapted).
    return (
        int(req.adapter).to_bytes(4, "little", signed=True)
        + np.asarray(req.prompt, np.int32).tobytes()
    )


class PromptSources:
    """Host table of which slots hold which prompt's prefill (KV prefix + store logits)."""

    def __init__(self, num_slots: int):
        self._key: list[bytes | None] = [None] * num_slots
        self._holders: dict[bytes, set[int]] = {}

    def clear(self) -> None:
        """Forget every source (new weights: later members are prefilled afresh)."""
        self._key = [None] * len(self._key)
        self._holders.clear()

    def _set(self, slot: int, key: bytes | None) -> None:
        old = self._key[slot]
        if old is not None:
            self._holders[old].discard(slot)
            if not self._holders[old]:
                del self._holders[old]
        self._key[slot] = key
        if key is not None:
            self._holders.setdefault(key, set()).add(slot)

    def plan(self, take: Sequence[Row]) -> tuple[list[Row], list[Fork]]:
        """Splits this step's admissions (in admission order) into rows to prefill and
        forks (slot, request, source slot).

        Sources are slots admitted in earlier steps that are not admitted to now (their
        prefix is intact) and this step's prefill rows (the engine runs every prefill
        before any fork); a fork destination becomes a source from the next step on.
        """
        for slot, _ in take:
            self._set(slot, None)  # overwritten this step
        prefill, forks = [], []
        for slot, req in take:
            key = prompt_key(req)
            holders = self._holders.get(key) if key is not None else None
            if holders:
                forks.append((slot, req, min(holders)))
            else:
                prefill.append((slot, req))
                self._set(slot, key)
        for slot, req, _ in forks:
            self._set(slot, prompt_key(req))
        return prefill, forks


def init_store(num_slots: int, vocab_size: int) -> jax.Array:
    """Per-slot last-prompt-token logits, f32[num_slots, V] (call under jit to place it)."""
    return jax.numpy.zeros((num_slots, vocab_size), jax.numpy.float32)


def prefill_keep(
    model: GenModel,
    state: slots_lib.SlotState,
    store: jax.Array,
    adm: slots_lib.Admission,
    top: int = 0,
) -> tuple[slots_lib.SlotState, jax.Array, slots_lib.PrefillOut]:
    """`slots.prefill_into_slots`, also keeping each row's logits in its slot's store row."""
    logits_NxV, cache, routes = model.prefill(
        adm.tokens, adm.lengths, state.cache, adm.slots, adm.adapter
    )
    store = store.at[adm.slots].set(logits_NxV, mode="drop")
    state, out = slots_lib.start_rows(state.replace(cache=cache), adm, logits_NxV, top)
    return state, store, out.replace(routes=routes)


def fork_into_slots(
    state: slots_lib.SlotState,
    store: jax.Array,
    adm: slots_lib.Admission,
    src_N: jax.Array,
    top: int = 0,
) -> tuple[slots_lib.SlotState, jax.Array, slots_lib.PrefillOut]:
    """Starts each row in `adm.slots` from source slot `src_N` (same prompt): copies its
    KV at positions [0, P) (P = the width of `adm.tokens`, whose values are unused: the
    longest prompt) and its stored logits, then samples the row's first token from
    them (padding rows: slot >= B, dropped)."""
    c, prompt_span = state.cache, adm.tokens.shape[1]

    def copy(layers, seq_axis):
        return tuple(
            set_cache_prefix(
                a, adm.slots, cache_prefix(a[src_N], seq_axis, prompt_span), seq_axis, mode="drop"
            )
            for a in layers
        )

    cache = c.replace(
        k=copy(c.k, c.k_seq_axis),
        v=copy(c.v, 2),
        lengths=c.lengths.at[adm.slots].set(adm.lengths, mode="drop"),
    )
    logits_NxV = store[src_N]
    store = store.at[adm.slots].set(logits_NxV, mode="drop")
    state, out = slots_lib.start_rows(state.replace(cache=cache), adm, logits_NxV, top)
    return state, store, out
