"""Device side of the engine: the slot-state pytree, prefill-into-slots and the decode chunk.

A *slot* is one row of the KV cache plus the per-request state needed to keep
sampling it (last token, counts, sampling parameters, key, stop ids). Both
functions here are pure and are jitted by the engine with the weights as an
argument and the slot state donated:

* `prefill_into_slots(model, state, admission)`: runs N right-padded prompts,
  writes them into their slots, samples each first response token
  (`start_rows`, which a shared-prompt fork reuses: `admission.py`).
* `extend_into_slots(model, state, admission)`: appends N rows of new tokens to
  the KV their slots already hold (an episode's next turn) and samples on;
* `decode_chunk(model, state, steps)`: advances every active slot up to
  `steps` tokens inside one `lax.while_loop` (exits early once no slot is
  active); a slot that finishes stops there and keeps its tokens. The engine
  runs it on a compacted state (`compact.decode_compact`: the running rows
  and the filled cache prefix).
* `stop_slots(state, mask)`: ends the masked slots' requests (a stop string the host
  read: `stop_texts.py`), so no later chunk decodes them.

With `top` > 0 (`EngineConfig.top_logprobs`, static) prefill and decode also return
each sampled token's position's `top` most likely tokens and their log-probs
(`sampling.top_logprobs`); with 0 they compute nothing more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from streamrl_jax.generation.decoder import GenModel, LayerCache
from streamrl_jax.generation.sampling import sample_tokens, top_logprobs
from streamrl_jax.model import routes as routes_lib

# Finish codes on the device: 0 = running (or free), 1 + FINISH_REASONS index.
STOP, LENGTH, CONTEXT, FORCED, PAUSED = 1, 2, 3, 4, 5


@struct.dataclass
class SlotState:
    """Everything the decode loop needs per slot (B slots, S max total length)."""

    # k L x [B, K, D, S], v L x [B, K, S, D]; lengths i32[B] = position of last_token
    cache: LayerCache
    last_token: jax.Array  # i32[B] last sampled token, the next decode input
    active: jax.Array  # bool[B] still generating
    num_generated: jax.Array  # i32[B] response tokens sampled so far
    prompt_len: jax.Array  # i32[B]
    limit: jax.Array  # i32[B] max_new_tokens, or the forced length
    forced: jax.Array  # bool[B] forced length: ignore stop ids
    key_data: jax.Array  # u32[B, 2] request key
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    stop_ids: jax.Array  # i32[B, X] padded with -1
    reason: jax.Array  # i32[B] finish code, 0 while running
    pause_at: jax.Array  # i32[B] pause once this many response tokens exist (partial rollout)
    adapter: jax.Array  # i32[B] the slot's LoRA adapter slot (-1: none; `generation/adapters.py`)


@struct.dataclass
class Admission:
    """N requests to prefill (rows with slot >= B are padding and are dropped)."""

    tokens: jax.Array  # i32[N, P] right-padded prompts
    lengths: jax.Array  # i32[N] prompt lengths
    slots: jax.Array  # i32[N] destination slot
    limit: jax.Array  # i32[N]
    forced: jax.Array  # bool[N]
    key_data: jax.Array  # u32[N, 2]
    temperature: jax.Array  # f32[N]
    top_k: jax.Array  # i32[N]
    top_p: jax.Array  # f32[N]
    stop_ids: jax.Array  # i32[N, X]
    generated: (
        jax.Array
    )  # i32[N] response tokens already there (a continuation's), after the prompt
    pause_at: jax.Array  # i32[N] response-token count at which the row pauses
    # i32[N] positions the slot's KV already holds (an episode's next turn: `tokens` are
    # appended there, `extend_into_slots`); 0 for a prefill. `lengths` is the total.
    start: jax.Array
    adapter: jax.Array  # i32[N] each row's LoRA adapter slot (-1: none)


@struct.dataclass
class ChunkOut:
    """Tokens of one decode chunk; slot b's are columns [0, emitted[b])."""

    tokens: jax.Array  # i32[B, C]
    logp: jax.Array  # f32[B, C] model log-probs
    sampling_logp: jax.Array  # f32[B, C]
    emitted: jax.Array  # i32[B]
    reason: jax.Array  # i32[B] finish code after the chunk
    # u8/u16[B, C, L, k] with `record_routes`: the experts of the token each step fed
    # (column c: the token before tokens[:, c]); None otherwise
    routes: jax.Array | None = None
    # i32[B, C, k], f32[B, C, k] with `top` k > 0: each token's position's k most likely
    # tokens and their model log-probs; None otherwise
    top_ids: jax.Array | None = None
    top_logp: jax.Array | None = None


@struct.dataclass
class PrefillOut:
    """First response token of each admitted row."""

    tokens: jax.Array  # i32[N]
    logp: jax.Array  # f32[N]
    sampling_logp: jax.Array  # f32[N]
    reason: jax.Array  # i32[N]
    # u8/u16[N, P, L, k] with `record_routes`: the experts of every row's fed tokens
    # (a fork's come from its source's record, on the host); None otherwise
    routes: jax.Array | None = None
    top_ids: jax.Array | None = None  # i32[N, k] with `top` k > 0 (as `ChunkOut`)
    top_logp: jax.Array | None = None  # f32[N, k]


def init_slot_state(cache: LayerCache, max_stop_ids: int) -> SlotState:
    """All slots free; call under jit with out_shardings to place it."""
    b = cache.num_slots
    zi = jnp.zeros((b,), jnp.int32)
    return SlotState(
        cache=cache,
        last_token=zi,
        active=jnp.zeros((b,), bool),
        num_generated=zi,
        prompt_len=zi,
        limit=zi,
        forced=jnp.zeros((b,), bool),
        key_data=jnp.zeros((b, 2), jnp.uint32),
        temperature=jnp.zeros((b,), jnp.float32),
        top_k=zi,
        top_p=jnp.ones((b,), jnp.float32),
        stop_ids=jnp.full((b, max_stop_ids), -1, jnp.int32),
        reason=zi,
        pause_at=zi,
        adapter=jnp.full((b,), -1, jnp.int32),
    )


def _finish_code(
    token_B: jax.Array,
    n_after_B: jax.Array,
    prompt_len_B: jax.Array,
    limit_B: jax.Array,
    forced_B: jax.Array,
    stop_ids_BxX: jax.Array,
    max_total: int,
    pause_at_B: jax.Array,
) -> jax.Array:
    """Finish code after appending `token_B` as response token number `n_after_B`
    (a real finish wins over a pause at the same token)."""
    at_limit = n_after_B >= limit_B
    is_stop = ~forced_B & jnp.any(token_B[:, None] == stop_ids_BxX, axis=-1)
    context = prompt_len_B + n_after_B >= max_total
    code = jnp.where(n_after_B >= pause_at_B, PAUSED, 0)
    code = jnp.where(context, CONTEXT, code)
    code = jnp.where(~forced_B & at_limit, LENGTH, code)
    code = jnp.where(is_stop, STOP, code)
    return jnp.where(forced_B & at_limit, FORCED, code).astype(jnp.int32)


def prefill_into_slots(
    model: GenModel, state: SlotState, adm: Admission, top: int = 0
) -> tuple[SlotState, PrefillOut]:
    """Prefills the admitted prompts (and a continuation's response so far) into their
    slots and samples each row's next token: token number `generated`, drawn with that
    counter, as the uninterrupted decode would."""
    logits_NxV, cache, routes = model.prefill(
        adm.tokens, adm.lengths, state.cache, adm.slots, adm.adapter
    )
    state, out = start_rows(state.replace(cache=cache), adm, logits_NxV, top)
    return state, out.replace(routes=routes)


def extend_into_slots(
    model: GenModel, state: SlotState, adm: Admission, top: int = 0
) -> tuple[SlotState, PrefillOut]:
    """Appends each row's new tokens (`adm.tokens[:, :lengths - start]`) to the KV its
    slot already holds (positions [0, start): the episode's turns so far) and samples
    the row's next token, as `prefill_into_slots` would after re-prefilling it all."""
    logits_NxV, cache, routes = model.extend(
        adm.tokens, adm.lengths - adm.start, adm.start, state.cache, adm.slots, adm.adapter
    )
    state, out = start_rows(state.replace(cache=cache), adm, logits_NxV, top)
    return state, out.replace(routes=routes)


def start_rows(
    state: SlotState, adm: Admission, logits_NxV: jax.Array, top: int = 0
) -> tuple[SlotState, PrefillOut]:
    """Samples each admitted row's next token from its logits and writes the row's
    request state into its slot (`state.cache` already holds the row's KV); with `top`,
    the row's `top` most likely tokens too."""
    cache = state.cache
    tok, logp, slogp = sample_tokens(
        logits_NxV, adm.key_data, adm.generated, adm.temperature, adm.top_k, adm.top_p
    )
    prompt_len_N = adm.lengths - adm.generated
    code = _finish_code(
        tok,
        adm.generated + 1,
        prompt_len_N,
        adm.limit,
        adm.forced,
        adm.stop_ids,
        cache.max_length,
        adm.pause_at,
    )

    def put(dst: jax.Array, src: jax.Array) -> jax.Array:
        return dst.at[adm.slots].set(src.astype(dst.dtype), mode="drop")

    state = SlotState(
        cache=cache,
        last_token=put(state.last_token, tok),
        active=put(state.active, code == 0),
        num_generated=put(state.num_generated, adm.generated + 1),
        prompt_len=put(state.prompt_len, prompt_len_N),
        limit=put(state.limit, adm.limit),
        forced=put(state.forced, adm.forced),
        key_data=put(state.key_data, adm.key_data),
        temperature=put(state.temperature, adm.temperature),
        top_k=put(state.top_k, adm.top_k),
        top_p=put(state.top_p, adm.top_p),
        stop_ids=put(state.stop_ids, adm.stop_ids),
        reason=put(state.reason, code),
        pause_at=put(state.pause_at, adm.pause_at),
        adapter=put(state.adapter, adm.adapter),
    )
    out = PrefillOut(tokens=tok, logp=logp, sampling_logp=slogp, reason=code)
    if top:
        top_ids, top_logp = top_logprobs(logits_NxV, top)
        out = out.replace(top_ids=top_ids, top_logp=top_logp)
    return state, out


def decode_chunk(
    model: GenModel, state: SlotState, steps: int, max_total: int | None = None, top: int = 0
) -> tuple[SlotState, ChunkOut]:
    """Advances every active slot by up to `steps` tokens (sampling inside the loop).

    `max_total` is the context cap of the finish codes, default the cache length (the
    compacted chunk, `compact.py`, runs on a cache prefix and passes the full length);
    `top`: each token's `top` most likely tokens too (0: none)."""
    b = state.last_token.shape[0]
    max_total = state.cache.max_length if max_total is None else max_total
    buf_i = jnp.zeros((b, steps), jnp.int32)
    buf_f = jnp.zeros((b, steps), jnp.float32)
    buf_r = None
    if model.record:
        spec = routes_lib.Spec.of(model.cfg)
        buf_r = jnp.zeros((b, steps, spec.layers, spec.k), spec.dtype)
    buf_t = None
    if top:
        buf_t = (jnp.zeros((b, steps, top), jnp.int32), jnp.zeros((b, steps, top), jnp.float32))

    def cond(carry):
        step, st, _ = carry
        return (step < steps) & jnp.any(st.active)

    def body(carry):
        step, st, (tok_buf, logp_buf, slogp_buf, route_buf, top_buf) = carry
        logits_BxV, cache, routes = model.decode(st.last_token, st.cache, st.active, st.adapter)
        tok, logp, slogp = sample_tokens(
            logits_BxV, st.key_data, st.num_generated, st.temperature, st.top_k, st.top_p
        )
        act = st.active
        n_after = st.num_generated + 1
        code = _finish_code(
            tok, n_after, st.prompt_len, st.limit, st.forced, st.stop_ids, max_total, st.pause_at
        )
        tok_buf = tok_buf.at[:, step].set(jnp.where(act, tok, 0))
        logp_buf = logp_buf.at[:, step].set(jnp.where(act, logp, 0.0))
        slogp_buf = slogp_buf.at[:, step].set(jnp.where(act, slogp, 0.0))
        if route_buf is not None:  # an inactive row's entry is never read
            route_buf = route_buf.at[:, step].set(routes)
        if top_buf is not None:  # an inactive row's entry is never read
            ids, lp = top_logprobs(logits_BxV, top)
            top_buf = (top_buf[0].at[:, step].set(ids), top_buf[1].at[:, step].set(lp))
        st = st.replace(
            cache=cache,
            last_token=jnp.where(act, tok, st.last_token),
            num_generated=jnp.where(act, n_after, st.num_generated),
            reason=jnp.where(act, code, st.reason),
            active=act & (code == 0),
        )
        return step + 1, st, (tok_buf, logp_buf, slogp_buf, route_buf, top_buf)

    init = (jnp.zeros((), jnp.int32), state, (buf_i, buf_f, buf_f, buf_r, buf_t))
    _, new, bufs = jax.lax.while_loop(cond, body, init)
    tok_buf, logp_buf, slogp_buf, route_buf, top_buf = bufs
    out = ChunkOut(
        tokens=tok_buf,
        logp=logp_buf,
        sampling_logp=slogp_buf,
        emitted=new.num_generated - state.num_generated,
        reason=new.reason,
        routes=route_buf,
        top_ids=None if top_buf is None else top_buf[0],
        top_logp=None if top_buf is None else top_buf[1],
    )
    return new, out


def stop_slots(state: SlotState, mask_B: jax.Array) -> SlotState:
    """`state` with the slots of `mask_B` (bool[B]) finished (reason "stop"): the host
    cut their responses at a stop string while the device was still decoding them."""
    return state.replace(
        active=state.active & ~mask_B, reason=jnp.where(mask_B, STOP, state.reason)
    )
