"""One generation instance: fixed slots, bucketed prefill, decode chunks, continuous batching.

The engine owns a KV cache of `num_slots` rows (its batch size) on one
instance mesh. Each `step()` is one host round trip:

1. apply a pending weight update (so weights only change between chunks);
2. admit waiting requests into free slots (FIFO, or longest-predicted-first
   "lpt"), prefilling them in batches of `prefill_batch` per prompt-length
   bucket; each prefill also samples the request's first token (a paused
   sample's continuation re-prefills prompt + its response so far and samples
   on from there; `segment_tokens` pauses a request after that many new tokens;
   with `share_prefill` a request whose prompt a slot already holds forks that
   slot's KV and logits instead of prefilling: `admission.py`; an episode's next turn
   extends the slot its last turn kept: `kept_slots.py`);
3. dispatch one decode chunk (up to `chunk_steps` tokens for every active
   slot, sampling inside the loop, finished slots stop) on the smallest
   decode shape covering the running slots: a batch bucket of rows and a
   length bucket of cache positions (`compact.py`), so a step's cost follows
   the active count and the longest active sequence;
4. fetch the prefill and chunk outputs in one `jax.device_get` and hand out
   every sample that finished; a request that asked for partial results
   (`GenerationRequest.on_tokens`) is told the tokens it gained first. A request with stop strings
   (`SamplingParams.stop_texts`) is read on the host: when the text of the tokens it
   sampled contains one (`stop_texts.first_stop`, with the detokenizer the engine was
   built with), its response ends with the token that completed it, the tokens the
   round trip sampled after that one are discarded, and the device stops its slot
   (`slots.stop_slots`). Its kept KV (`keep_kv`) is then that of the response it
   returned: the positions past it hold the discarded tokens, which the next turn's
   tokens overwrite and nothing attends to.

With `refill=False` the same engine is the static-batch baseline: it admits a
full batch only when every slot is free.

Determinism: a request's tokens depend only on (weights, prompt, seed): token
t is drawn with `fold_in(key(seed), t)`, prefill shapes depend only on the
prompt's own length bucket. Samples are therefore the same whatever the slot,
batch-mates or admission time, up to floating-point effects of the decode
shape (the batch bucket, the length bucket, or another engine's slot count
changes matmul and reduction shapes; tests hold log-probs to 1e-5).

Weights are a jit argument; `update_weights` swaps the reference (after a
`device_put` onto this instance's sharding), never recompiling. With adapter slots
(`EngineConfig.adapters`) the base is kept once and `update_adapter` rewrites one slot's
LoRA adapter; each slot has its own policy version, which that slot's samples carry.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.generation import adapters as adapters_lib
from streamrl_jax.generation import admission, decoder, executables, kept_slots, stop_texts
from streamrl_jax.generation import slots as slots_lib
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.generation.types import (
    FINISH_REASONS,
    ChunkReport,
    GenerationRequest,
    Sample,
    Timings,
    TokenDelta,
)
from streamrl_jax.model import routes as routes_lib
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.sharding import GENERATE_RULES, state_shardings


@dataclasses.dataclass
class _Admitted:
    """One admission call's rows: their slots and device output, and per row the
    positions its slot already held (an extension's `starts`) or its source slot (a
    fork's `sources`); neither for a prefill."""

    slots: list[int]
    out: slots_lib.PrefillOut
    starts: list[int] | None = None
    sources: list[int] | None = None


# Chunks an engine's metrics timeline keeps (the newest; `chunks` counts them all)
TIMELINE_CHUNKS = 1 << 16


@dataclasses.dataclass
class _Running:
    request: GenerationRequest
    enqueue: float
    admit: float
    version: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    slogp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # per response token
    # The continuation's policy mask when it holds an environment's tokens (None: every
    # token is the policy's); tokens sampled here are the policy's.
    mask: np.ndarray | None = None
    # `EngineConfig.record_routes`: the routes of the fed positions, in order (pieces)
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)
    # `EngineConfig.top_logprobs`: per response token its top ids and log-probs (pieces)
    top_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    top_logp: list[np.ndarray] = dataclasses.field(default_factory=list)
    checked: int = 0  # tokens of its own known to complete no stop string

    def cut(self, n: int) -> None:
        """Keeps the first `n` response tokens (a stop string ended the response)."""
        del self.tokens[n:], self.logp[n:], self.slogp[n:], self.versions[n:]
        if self.routes:  # fed positions: the prompt, then every response token but the last
            fed = len(self.request.prompt) + n - 1
            self.routes = [np.concatenate(self.routes)[:fed]]
        if self.top_ids:
            self.top_ids = [np.concatenate(self.top_ids)[:n]]
            self.top_logp = [np.concatenate(self.top_logp)[:n]]


class Engine:
    """A generation instance on one ("tp",) mesh. Not thread-safe except
    `update_weights`, which may be called from any thread.

    Args:
      graphdef, params: the split model; params are placed on `mesh` under the
        generation rule table.
      model_cfg: the model's config.
      cfg: slots, lengths, chunking and admission policy.
      mesh: this instance's 1-D ("tp",) mesh.
      instance_id: echoed in every `Sample` and callback.
      version: policy version of `params`.
      on_chunk: optional observer of each `step()` (one host round trip), called on
        the stepping thread with its `ChunkReport` (wall times, tokens emitted, slots
        running, decode steps, prompts prefilled). The pipeline meters and draws its
        trace with it.
      detokenize: token ids -> text (the tokenizer's decode), for requests with stop
        strings (`SamplingParams.stop_texts`); without it they are refused.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        mesh: Mesh,
        *,
        instance_id: int = 0,
        version: int = 0,
        on_chunk: Callable[[ChunkReport], None] | None = None,
        detokenize: stop_texts.Detokenize | None = None,
    ):
        if cfg.max_total_length > model_cfg.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_total_length ({cfg.max_total_length}) exceeds the model "
                f"context ({model_cfg.max_position_embeddings})"
            )
        if cfg.record_routes and not model_cfg.num_experts:
            raise ValueError(
                "EngineConfig.record_routes: the model has no experts (routing replay is "
                "for mixture-of-experts models)"
            )
        adapters_lib.check(model_cfg, cfg.adapters)
        if cfg.top_logprobs > model_cfg.vocab_size:
            raise ValueError(
                f"EngineConfig.top_logprobs ({cfg.top_logprobs}) exceeds the vocabulary "
                f"({model_cfg.vocab_size})"
            )
        self._detokenize = detokenize
        self.cfg, self.model_cfg, self.mesh, self.instance_id = cfg, model_cfg, mesh, instance_id
        self._repl = NamedSharding(mesh, PartitionSpec())
        self._param_shardings = state_shardings(params, mesh, GENERATE_RULES)
        self._param_sig = executables.signature(params)
        platform = mesh.devices.flat[0].platform
        parts_major = cfg.gate_up_parts_major(platform)  # the weights' layout, both jits'
        self._relayout = executables.relayout_fn(
            graphdef, model_cfg, mesh, params, cfg.weight_dtype, cfg.adapters, parts_major
        )
        self._params = self._relayout(jax.device_put(params, self._param_shardings))
        self.version = version
        self._pending_weights: tuple[Any, int] | None = None
        # Adapter slots (`EngineConfig.adapters`): each slot's policy version, and the
        # adapter writes queued for the next step (slot, layout, version).
        self.adapter_versions = [version] * cfg.adapters
        self._pending_adapters: list[tuple[int, Any, int]] = []
        if cfg.adapters:
            self._adapter_fns = executables.adapter_fns(model_cfg, mesh, params, cfg.adapters)
        self._lock = threading.Lock()

        init, place = executables.slot_state(
            model_cfg,
            cfg.num_slots,
            cfg.max_total_length,
            cfg.max_stop_ids,
            cfg.keys_positions_minor(platform),
        )
        state_sh, _ = place(mesh)
        self._state = jax.jit(init, out_shardings=state_sh)()

        # The decode chunk's XLA options (its matmul library on CPU: `EngineConfig.cpu_dots`).
        self.decode_options = cfg.decode_compiler_options(platform, model_cfg.hidden_size)
        self.decode_attention = cfg.attention(platform)
        self._prefill, self._chunk, self._prefill_keep, self._fork, self._extend, self._stop = (
            executables.jitted(
                model_cfg,
                cfg.chunk_steps,
                state_sh,
                self._repl,
                self.decode_options,
                self.decode_attention,
                cfg.record_routes,
                parts_major,
                cfg.top_logprobs,
            )
        )
        # Each slot's prompt routes from its last prefill or fork (a fork copies its
        # source's KV, so its record too).
        self._prompt_routes: list[np.ndarray | None] = [None] * cfg.num_slots
        # Shared-prompt prefill: per-slot prompt logits and which slot holds which prompt.
        self._sources = admission.PromptSources(cfg.num_slots)
        if cfg.share_prefill:
            store = functools.partial(admission.init_store, cfg.num_slots, model_cfg.vocab_size)
            self._store = jax.jit(store, out_shardings=self._repl)()
        self._shapes = cfg.decode_shapes()

        self._seq = itertools.count()
        self._queue: list[tuple[tuple[float, int], GenerationRequest, float]] = []
        self._slots: list[_Running | None] = [None] * cfg.num_slots
        # the timeline keeps the last TIMELINE_CHUNKS chunks: a serving engine runs for days
        timeline: collections.deque = collections.deque(maxlen=TIMELINE_CHUNKS)
        self._metrics: dict[str, Any] = {
            "tokens": 0,
            "busy_s": 0.0,
            "chunks": 0,
            "timeline": timeline,
        }
        self._metrics.update(prefill_calls=0, prefill_rows=0, forked=0)
        # Continuations: appended to a kept slot's KV, or re-prefilled (no slot was kept).
        self._metrics.update(extended=0, extended_tokens=0, reprefilled=0, reprefilled_tokens=0)
        self._metrics.update(kept_given_up=0)  # kept slots given up for a waiting request
        # Responses a stop string ended, and the tokens their round trips sampled past it.
        self._metrics.update(stopped_on_text=0, discarded_tokens=0)
        self._kept = kept_slots.KeptSlots()  # slots kept for an episode's next turn
        self._on_chunk = on_chunk

    def version_of(self, adapter: int) -> int:
        """The policy version a request of `adapter` decodes with: its adapter slot's, or
        (no slots, or -1: the base alone) the weights'."""
        return (
            self.adapter_versions[adapter] if self.cfg.adapters and adapter >= 0 else self.version
        )

    def _running(self, req: GenerationRequest, enq: float, now: float) -> _Running:
        """A slot's host record; a continuation starts with the response it already has."""
        run = _Running(req, enq, now, self.version_of(req.adapter))
        c = req.continuation
        if c is not None:
            run.admit, run.version = c.admit, int(c.versions[0])
            run.tokens, run.logp = c.tokens.tolist(), c.logprobs.tolist()
            run.slogp, run.versions = c.sampling_logprobs.tolist(), c.versions.tolist()
            if c.policy_mask is not None and not np.all(c.policy_mask):
                run.mask = np.asarray(c.policy_mask, bool)
        if self.cfg.top_logprobs and c is not None:  # none for tokens not sampled here
            k, n = self.cfg.top_logprobs, len(c.tokens)
            run.top_ids = [np.full((n, k), -1, np.int32)]
            run.top_logp = [np.full((n, k), -np.inf, np.float32)]
        return run

    # ------------------------------------------------------------------ requests
    def validate(self, req: GenerationRequest) -> None:
        """Raises ValueError naming the field of a request this engine cannot serve."""
        validate_request(
            self.cfg, self.model_cfg.vocab_size, req, reads_text=self._detokenize is not None
        )

    def submit(self, requests: Sequence[GenerationRequest], enqueue_time: float | None = None):
        """Validates every request (all or none are queued), then queues them."""
        for r in requests:
            self.validate(r)
        now = time.time() if enqueue_time is None else enqueue_time
        for r in requests:
            seq = next(self._seq)
            key = (-r.priority if self.cfg.admission == "lpt" else 0.0, seq)
            heapq.heappush(self._queue, (key, r, now))

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_held(self) -> int:
        """Slots kept for a continuation (`GenerationRequest.keep_kv`)."""
        return len(self._kept)

    def holding(self, request_id: Any) -> bool:
        """Whether a slot is kept for a continuation of `request_id`."""
        return request_id in self._kept

    def release(self, request_id: Any) -> bool:
        """Gives up the slot kept for `request_id` (its episode ended); False if none."""
        return self._kept.release(request_id)

    def has_work(self) -> bool:
        return bool(self._queue) or self.num_running > 0

    # ------------------------------------------------------------------ weights
    def update_weights(self, params: nnx.State, version: int) -> None:
        """Queues new weights (same structure, shapes, dtypes); applied before the next
        chunk. With adapter slots: the base, and `params`' adapter in slot 0, every other
        slot reset to the base alone (`update_adapter` writes one slot)."""
        if executables.signature(params) != self._param_sig:
            raise ValueError(
                f"instance {self.instance_id}: update_weights params differ in structure, "
                "shape or dtype from the engine's weights"
            )
        # The engine's own layout (`decoder`), made here on the caller's thread.
        placed = self._relayout(jax.device_put(params, self._param_shardings))
        with self._lock:
            self._pending_weights = (placed, int(version))

    def update_adapter(
        self, slot: int, params: nnx.State, version: int, alpha: float | None = None
    ) -> None:
        """Queues LoRA adapter `params` (a model state, or its adapters alone:
        `state.filter(nnx.LoRAParam)`, what an adapter-only sync sends) for adapter slot
        `slot` at policy `version`; written before the next chunk, the base untouched.
        `alpha`: this adapter's LoRA alpha (its scale alpha / rank is folded into its B;
        None: the model config's); the rank is the table's. Any thread."""
        if not self.cfg.adapters:
            raise ValueError(
                f"instance {self.instance_id}: update_adapter needs adapter slots "
                "(EngineConfig.adapters is 0: adapters are merged by update_weights)"
            )
        if not isinstance(slot, int | np.integer) or not 0 <= slot < self.cfg.adapters:
            raise ValueError(
                f"instance {self.instance_id}: adapter slot {slot!r} outside "
                f"[0, {self.cfg.adapters})"
            )
        alpha = self.model_cfg.lora_alpha if alpha is None else alpha
        real = isinstance(alpha, int | float | np.floating) and not isinstance(alpha, bool)
        if not (real and np.isfinite(alpha) and alpha > 0):
            raise ValueError(
                f"instance {self.instance_id}: adapter slot {slot}: alpha {alpha!r} must be a "
                "finite number > 0"
            )
        layout, _ = self._adapter_fns
        try:
            scale = np.float32(alpha / self.model_cfg.lora_rank)
            entries = layout(params.filter(nnx.LoRAParam), scale)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"instance {self.instance_id}: update_adapter params are not this model's "
                f"LoRA adapters ({type(e).__name__}: {e})"
            ) from None
        with self._lock:
            self._pending_adapters.append((int(slot), entries, int(version)))

    def _apply_pending_weights(self) -> None:
        with self._lock:
            pending, self._pending_weights = self._pending_weights, None
            writes, self._pending_adapters = self._pending_adapters, []
        if pending is not None:
            self._params, self.version = pending
            self.adapter_versions = [self.version] * self.cfg.adapters
            self._sources.clear()
            logging.info("instance %d: weights version %d", self.instance_id, self.version)
        for slot, entries, version in writes:
            write = self._adapter_fns[1]
            self._params = adapters_lib.with_tables(
                self._params, write(adapters_lib.tables_of(self._params), entries, slot)
            )
            self.adapter_versions[slot] = version
            self._sources.clear()
            logging.info("instance %d: adapter %d version %d", self.instance_id, slot, version)

    @property
    def param_shardings(self) -> Any:
        """The NamedShardings (an nnx.State) this instance keeps its weights in."""
        return self._param_shardings

    @property
    def weights(self) -> dict:
        """The weights this instance decodes with, in the decoder's layout on its mesh
        (`decoder.from_training_layout`; int8 matrices with `weight_dtype="int8"`)."""
        return self._params

    @property
    def cache(self) -> decoder.LayerCache:
        """The slots' KV cache: `num_slots` rows of `max_total_length` positions."""
        return self._state.cache

    def compile_count(self) -> int:
        """Compiled executables of prefill (one per bucket; with `share_prefill` the
        logits-keeping prefill, and one fork) and decode chunk (one per (batch, length)
        bucket used, at most `len(cfg.decode_shapes().all())`), shared with engines of
        equal statics (see `_jitted`)."""
        fns = (self._prefill, self._chunk, self._prefill_keep, self._fork)
        return sum(f._cache_size() for f in fns)

    def compile_decode_shapes(self) -> None:
        """Compiles every decode shape now (e.g. before timing) by running each once with
        no slot active (`idle_chunk`). Only while no slot is running."""
        for rows, seq in self._shapes.all():
            self.idle_chunk(rows, seq)

    def idle_chunk(self, rows: int, seq: int) -> None:
        """Runs one decode chunk on `rows` slots and `seq` cache positions with no slot
        active, and waits for it: the loop exits at once, so this is the chunk's gather,
        scatter and dispatch alone (compiling the shape on first use). Only while idle."""
        if self.num_running:
            raise RuntimeError(
                f"instance {self.instance_id}: idle_chunk needs an idle engine "
                f"({self.num_running} slots running)"
            )
        idx = jax.device_put(np.arange(rows, dtype=np.int32), self._repl)
        self._state, out = self._chunk(self._params, self._state, idx, seq=seq)
        jax.block_until_ready(out)  # deliberate sync: callers time or precompile the call

    def compile_shapes(self, continuations: bool = False) -> int:
        """Compiles every executable this engine can run (`pipeline.precompile`): the
        decode shapes (`compile_decode_shapes`), prefill at every prompt bucket (with
        `continuations`, the partial-rollout buckets past the prompt too) and, with
        `share_prefill`, the fork, each run once on padding rows, which write nothing
        (their slot is `num_slots`: dropped). Only while idle. Returns the executables
        compiled."""
        before = self.compile_count()
        self.compile_decode_shapes()
        nb = self.cfg.prefill_batch
        for bucket in self.cfg.prefill_buckets(continuations):
            adm = jax.device_put(self._admission([], bucket), self._repl)
            if self.cfg.share_prefill:
                self._state, self._store, _ = self._prefill_keep(
                    self._params, self._state, self._store, adm
                )
            else:
                self._state, _ = self._prefill(self._params, self._state, adm)
        if self.cfg.share_prefill:
            adm = self._admission([], self.cfg.max_prompt_length)
            adm, src = jax.device_put((adm, np.zeros((nb,), np.int32)), self._repl)
            self._state, self._store, _ = self._fork(self._state, self._store, adm, src)
        jax.block_until_ready(self._state)
        return self.compile_count() - before

    # ------------------------------------------------------------------ host loop
    def _continue_kept(self) -> list[tuple[int, GenerationRequest, float, int]]:
        """Queued continuations of a kept slot (slot, request, enqueue, tokens kept),
        taken off the queue (`KeptSlots.take`)."""
        if not len(self._kept):
            return []
        out, left = [], []
        for entry in self._queue:
            _, req, enq = entry
            kept = self._kept.take(req)
            if kept is None:
                left.append(entry)
            else:
                out.append((kept[0], req, enq, kept[1]))
        if out:
            self._queue = left
            heapq.heapify(self._queue)
        return out

    def _free_slots(self) -> list[int]:
        """Free slots; when the queue wants more, kept slots older than `kv_hold_s`
        too, least recently used first (kept longest: their continuation is the most
        overdue). With `kv_hold_s=0` (a served endpoint) no request waits on an idle
        episode: its KV is dropped and re-prefilled when it returns."""
        kept = self._kept.slots()
        free = [i for i, s in enumerate(self._slots) if s is None and i not in kept]
        if len(free) < len(self._queue) and kept:
            for rid, slot in self._kept.overdue(self.cfg.kv_hold_s):
                if len(free) >= len(self._queue):
                    break
                if self.cfg.kv_hold_s > 0:
                    logging.warning(
                        "instance %d: slot kept for %r given up after %.0f s without its "
                        "continuation", self.instance_id, rid, self.cfg.kv_hold_s,
                    )  # fmt: skip
                self._kept.release(rid)
                self._metrics["kept_given_up"] += 1
                free.append(slot)
        return free

    def _admit(self) -> list[_Admitted]:
        nb, m = self.cfg.prefill_batch, self._metrics
        outs = []
        extend = self._continue_kept()
        now = time.time()
        for slot, req, enq, _ in extend:
            self._slots[slot] = self._running(req, enq, now)
        # Continuations into their kept slots first: their slots are theirs already.
        by_bucket: dict[int, list[tuple[int, GenerationRequest, int]]] = {}
        for slot, req, _, kept in extend:
            new = len(req.prompt) + req.history - kept
            by_bucket.setdefault(self.cfg.bucket(new), []).append((slot, req, kept))
            m["extended"] += 1
            m["extended_tokens"] += new
        for bucket, rows in sorted(by_bucket.items()):
            for i in range(0, len(rows), nb):
                group = rows[i : i + nb]
                rows_kept = [(slot, req) for slot, req, _ in group]
                adm = self._admission(rows_kept, bucket, [kept for _, _, kept in group])
                self._state, out = self._extend(
                    self._params, self._state, jax.device_put(adm, self._repl)
                )
                slots = [slot for slot, _, _ in group]
                outs.append(_Admitted(slots, out, starts=[kept for _, _, kept in group]))
        free = self._free_slots()
        if not self.cfg.refill and len(free) < self.cfg.num_slots:
            return outs
        take = []
        while self._queue and len(take) < len(free):
            _, req, enq = heapq.heappop(self._queue)
            take.append((free[len(take)], req, enq))
        now = time.time()
        for slot, req, enq in take:
            self._slots[slot] = self._running(req, enq, now)
            if req.keep_kv and req.continuation is not None:
                m["reprefilled"] += 1  # its kept slot was given up, or never kept here
                m["reprefilled_tokens"] += len(req.prompt) + req.history
        rows = [(slot, req) for slot, req, _ in take]
        forks = []
        if self.cfg.share_prefill:
            rows, forks = self._sources.plan(rows)
        by_bucket: dict[int, list[tuple[int, GenerationRequest]]] = {}
        for slot, req in rows:
            bucket = self.cfg.bucket(len(req.prompt) + req.history)
            by_bucket.setdefault(bucket, []).append((slot, req))
        for bucket, rows in sorted(by_bucket.items()):
            for i in range(0, len(rows), nb):
                group = rows[i : i + nb]
                adm = jax.device_put(self._admission(group, bucket), self._repl)
                if self.cfg.share_prefill:
                    self._state, self._store, out = self._prefill_keep(
                        self._params, self._state, self._store, adm
                    )
                else:
                    self._state, out = self._prefill(self._params, self._state, adm)
                outs.append(_Admitted([slot for slot, _ in group], out))
                m["prefill_calls"] += 1
                m["prefill_rows"] += len(group)
        # Forks after every prefill: a fork may copy from a slot prefilled just above.
        for i in range(0, len(forks), nb):
            group = forks[i : i + nb]
            src = np.zeros((nb,), np.int32)
            src[: len(group)] = [source for _, _, source in group]
            # Its tokens are unused; their width, max_prompt_length, is the KV span copied.
            rows = [(slot, req) for slot, req, _ in group]
            adm = self._admission(rows, self.cfg.max_prompt_length)
            adm, src = jax.device_put((adm, src), self._repl)
            self._state, self._store, out = self._fork(self._state, self._store, adm, src)
            sources = [source for _, _, source in group]
            outs.append(_Admitted([slot for slot, _, _ in group], out, sources=sources))
            m["forked"] += len(group)
        return outs

    def _admission(
        self, rows: list[tuple[int, GenerationRequest]], p: int, starts: list[int] | None = None
    ) -> slots_lib.Admission:
        return admission.build_admission(
            rows,
            p,
            n=self.cfg.prefill_batch,
            num_slots=self.cfg.num_slots,
            max_stop_ids=self.cfg.max_stop_ids,
            stop_ids=self.cfg.stop_ids,
            starts=starts,
        )

    def step(self) -> list[Sample]:
        """One host round trip: admit, one decode chunk, return the finished samples."""
        t0 = time.time()
        self._apply_pending_weights()
        before = {k: self._metrics[k] for k in ("prefill_rows", "extended", "reprefilled")}
        prefills = self._admit()
        if self.num_running == 0:
            return []
        running = [i for i, s in enumerate(self._slots) if s is not None]
        # Upper bound of each running slot's cache length (prompt + response - 1 once
        # its first token is known to the host; prompt + continuation when just admitted).
        filled = [len(self._slots[i].request.prompt) + len(self._slots[i].tokens) for i in running]
        rows, seq = self._shapes.pick(running, filled)
        idx = jax.device_put(rows, self._repl)
        self._state, chunk = self._chunk(self._params, self._state, idx, seq=seq)
        # The one deliberate sync point per chunk: the host needs the done flags.
        prefills_h, chunk_h = jax.device_get(([a.out for a in prefills], chunk))
        # Requests that asked for partial results, and the tokens each had before.
        watched = [
            (r, len(r.tokens))
            for r in self._slots
            if r is not None and r.request.on_tokens is not None
        ]
        done: list[Sample] = []
        emitted = 0
        for admitted, out in zip(prefills, prefills_h, strict=True):
            for i, slot in enumerate(admitted.slots):
                run = self._slots[slot]
                if self.cfg.record_routes:
                    self._admitted_routes(slot, run, admitted, out.routes, i)
                run.tokens.append(int(out.tokens[i]))
                run.logp.append(float(out.logp[i]))
                run.slogp.append(float(out.sampling_logp[i]))
                run.versions.append(self.version_of(run.request.adapter))
                if out.top_ids is not None:
                    run.top_ids.append(out.top_ids[i][None])
                    run.top_logp.append(out.top_logp[i][None])
                emitted += 1
                if out.reason[i]:  # (running ones are read with their chunk's tokens)
                    done.append(self._finish(slot, self._stop_on_text(run, int(out.reason[i]))))
        stopped = []  # slots a stop string ended while the device decodes them
        for i, slot in enumerate(rows.tolist()):  # chunk row i is slot rows[i]
            run = self._slots[slot]
            if run is None:
                continue
            e = int(chunk_h.emitted[i])
            run.tokens.extend(chunk_h.tokens[i, :e].tolist())
            run.logp.extend(chunk_h.logp[i, :e].tolist())
            run.slogp.extend(chunk_h.sampling_logp[i, :e].tolist())
            if chunk_h.routes is not None:
                run.routes.append(chunk_h.routes[i, :e])
            if chunk_h.top_ids is not None:
                run.top_ids.append(chunk_h.top_ids[i, :e])
                run.top_logp.append(chunk_h.top_logp[i, :e])
            # Weights change only between round trips: this chunk ran on one version.
            run.versions.extend([self.version_of(run.request.adapter)] * e)
            emitted += e
            code = self._stop_on_text(run, int(chunk_h.reason[i]))
            if code and not chunk_h.reason[i]:
                stopped.append(slot)
            if code:
                done.append(self._finish(slot, code))
        if stopped:
            mask = np.zeros((self.cfg.num_slots,), bool)
            mask[stopped] = True
            self._state = self._stop(self._state, jax.device_put(mask, self._repl))
        for run, had in watched:  # after a stop string's cut: never the discarded tokens
            self._report_tokens(run, had)
        t1 = time.time()
        m = self._metrics
        m["tokens"] += emitted
        m["busy_s"] += t1 - t0
        m["chunks"] += 1
        m["timeline"].append((t1, self.num_running + len(done), len(self._queue), emitted))
        if self._on_chunk is not None:
            self._on_chunk(
                ChunkReport(
                    instance=str(self.instance_id),
                    t0=t0,
                    t1=t1,
                    tokens=emitted,
                    running=self.num_running + len(done),
                    steps=int(chunk_h.emitted.max(initial=0)),
                    prefilled=m["prefill_rows"] - before["prefill_rows"],
                    extended=m["extended"] - before["extended"],
                    reprefilled=m["reprefilled"] - before["reprefilled"],
                )
            )
        return done

    def _report_tokens(self, run: _Running, had: int) -> None:
        """The tokens `run` gained since it held `had`, to its request's observer."""
        n = len(run.tokens)
        if n == had:
            return
        top_ids = top_logp = None
        if run.top_ids:
            top_ids = np.concatenate(run.top_ids)[had:n]
            top_logp = np.concatenate(run.top_logp)[had:n]
        run.request.on_tokens(
            TokenDelta(
                request_id=run.request.request_id,
                start=had,
                tokens=np.asarray(run.tokens[had:], np.int32),
                logprobs=np.asarray(run.logp[had:], np.float32),
                versions=np.asarray(run.versions[had:], np.int32),
                top_ids=top_ids,
                top_logprobs=top_logp,
            )
        )

    def _admitted_routes(
        self, slot: int, run: _Running, admitted: _Admitted, routes: np.ndarray | None, i: int
    ) -> None:
        """The routes of the positions an admission fed, as `run`'s record so far: a
        prefill's from its output, an extension's the continuation's kept ones then its
        output's, a fork's its source's prompt record."""
        req = run.request
        fed = len(req.prompt) + req.history  # positions the slot's KV holds now
        if admitted.sources is not None:
            record = self._prompt_routes[admitted.sources[i]]
        elif admitted.starts is not None:
            start = admitted.starts[i]
            kept = req.continuation.routes
            if kept is None or len(kept) < start:  # none recorded for the kept positions
                kept = routes_lib.Spec.of(self.model_cfg).empty(start)
            record = np.concatenate([kept[:start], routes[i, : fed - start]])
        else:
            record = routes[i, :fed]
        if req.continuation is None:
            self._prompt_routes[slot] = record
        run.routes = [record]

    def _stop_on_text(self, run: _Running, code: int) -> int:
        """The finish code of `run` after this round trip's tokens: STOP, its response cut
        after the token that completed a stop string (`SamplingParams.stop_texts`), or
        `code` (the device's; 0: running)."""
        req = run.request
        texts = req.sampling.stop_texts
        if not texts or req.forced_length is not None:
            return code
        own = run.tokens[req.history :]  # what this request sampled (its turn)
        j = stop_texts.first_stop(self._detokenize, own, run.checked, texts)
        run.checked = len(own)
        if j is None:
            return code
        n = req.history + j + 1
        self._metrics["stopped_on_text"] += 1
        self._metrics["discarded_tokens"] += len(run.tokens) - n
        run.cut(n)
        return slots_lib.STOP

    def _finish(self, slot: int, code: int) -> Sample:
        run = self._slots[slot]
        self._slots[slot] = None
        r = run.request
        if r.keep_kv and code in (slots_lib.STOP, slots_lib.LENGTH, slots_lib.FORCED):
            # The KV holds every token but the last sampled one (never fed back).
            self._kept.keep(r.request_id, slot, [*map(int, r.prompt), *run.tokens[:-1]])
        mask = run.mask
        if mask is not None:  # then the policy's tokens sampled here
            mask = np.concatenate([mask, np.ones(len(run.tokens) - len(mask), bool)])
        routes = np.concatenate(run.routes) if run.routes else None
        top = self.cfg.top_logprobs > 0
        return Sample(
            request_id=r.request_id,
            prompt=np.asarray(r.prompt, np.int32),
            response=np.asarray(run.tokens, np.int32),
            logprobs=np.asarray(run.logp, np.float32),
            sampling_logprobs=np.asarray(run.slogp, np.float32),
            finish_reason=FINISH_REASONS[code - 1],
            policy_version=run.version,
            last_policy_version=self.version_of(r.adapter),
            instance_id=self.instance_id,
            timings=Timings(enqueue=run.enqueue, admit=run.admit, finish=time.time()),
            tag=r.tag,
            metadata=dict(r.metadata),
            token_versions=np.asarray(run.versions, np.int32),
            policy_mask=mask,
            sampling=r.sampling,
            seed=int(r.seed),
            routes=routes,
            adapter=int(r.adapter),
            top_ids=np.concatenate(run.top_ids) if top else None,
            top_logprobs=np.concatenate(run.top_logp) if top else None,
        )

    def run(self, requests: Sequence[GenerationRequest] = ()) -> list[Sample]:
        """Submits `requests` and steps until idle; samples in completion order."""
        self.submit(requests)
        out: list[Sample] = []
        while self.has_work():
            out.extend(self.step())
        return out

    def metrics(self) -> dict[str, Any]:
        """Tokens, busy time, tokens/s and the (time, running, queued, tokens) timeline of
        the last `TIMELINE_CHUNKS` chunks (`chunks` counts them all)."""
        m = dict(self._metrics)
        m["timeline"] = list(m["timeline"])
        m["tokens_per_s"] = m["tokens"] / m["busy_s"] if m["busy_s"] else 0.0
        occ = [row[1] for row in m["timeline"]]
        m["mean_occupancy"] = float(np.mean(occ)) / self.cfg.num_slots if occ else 0.0
        return m


def validate_request(
    cfg: EngineConfig, vocab: int, req: GenerationRequest, *, reads_text: bool
) -> None:
    """Raises ValueError naming the field of `req` that an engine with `cfg` and a
    vocabulary of `vocab` tokens cannot serve (`reads_text`: it has a detokenizer, for
    stop strings)."""
    n = len(req.prompt)
    if n == 0:
        raise ValueError(f"request {req.request_id!r}: prompt is empty")
    if n > cfg.max_prompt_length:
        raise ValueError(
            f"request {req.request_id!r}: prompt length {n} exceeds "
            f"max_prompt_length {cfg.max_prompt_length}"
        )
    ids = np.asarray(req.prompt)
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"request {req.request_id!r}: prompt has ids outside [0, {vocab})")
    if not isinstance(req.max_new_tokens, int | np.integer) or req.max_new_tokens < 1:
        raise ValueError(
            f"request {req.request_id!r}: max_new_tokens must be an int >= 1, "
            f"got {req.max_new_tokens!r}"
        )
    if req.forced_length is not None and (
        not isinstance(req.forced_length, int | np.integer)
        or req.forced_length < 1
        or n + req.forced_length > cfg.max_total_length
    ):
        raise ValueError(
            f"request {req.request_id!r}: forced_length {req.forced_length!r} must be >= 1 "
            f"with prompt + forced_length <= max_total_length {cfg.max_total_length}"
        )
    if not isinstance(req.seed, int | np.integer):
        raise ValueError(f"request {req.request_id!r}: seed must be an int")
    if not math.isfinite(req.priority):
        raise ValueError(f"request {req.request_id!r}: priority must be finite")
    if req.segment_tokens is not None and (
        not isinstance(req.segment_tokens, int | np.integer) or req.segment_tokens < 1
    ):
        raise ValueError(
            f"request {req.request_id!r}: segment_tokens must be None or an int >= 1, "
            f"got {req.segment_tokens!r}"
        )
    c = req.continuation
    if c is not None:
        k = len(c.tokens)
        limit = req.forced_length if req.forced_length is not None else req.max_new_tokens
        arrays = (c.logprobs, c.sampling_logprobs, c.versions)
        if c.policy_mask is not None:
            arrays += (c.policy_mask,)
        if k < 1 or any(len(a) != k for a in arrays):
            raise ValueError(
                f"request {req.request_id!r}: continuation needs >= 1 token and one "
                "log-prob, sampling log-prob, version (and policy mask entry) per token"
            )
        if c.policy_tokens >= limit or n + k >= cfg.max_total_length:
            raise ValueError(
                f"request {req.request_id!r}: continuation of {k} tokens "
                f"({c.policy_tokens} the policy's) leaves nothing to generate (limit "
                f"{limit}, prompt {n}, context {cfg.max_total_length})"
            )
        tokens = np.asarray(c.tokens)
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(
                f"request {req.request_id!r}: continuation has ids outside [0, {vocab})"
            )
    if not isinstance(req.adapter, int | np.integer) or not (
        -1 <= req.adapter < cfg.adapters if cfg.adapters else req.adapter == 0
    ):
        held = f"[-1, {cfg.adapters})" if cfg.adapters else "0 (the engine has no adapter slots)"
        raise ValueError(f"request {req.request_id!r}: adapter {req.adapter!r}; expected {held}")
    if req.on_tokens is not None and not callable(req.on_tokens):
        raise ValueError(f"request {req.request_id!r}: on_tokens must be callable or None")
    try:
        req.sampling.validate(vocab, cfg.max_stop_ids)
    except ValueError as e:
        raise ValueError(f"request {req.request_id!r}: {e}") from None
    if req.sampling.stop_texts and not reads_text:
        raise ValueError(
            f"request {req.request_id!r}: sampling.stop_texts needs an engine built with a "
            "detokenizer (Engine(detokenize=...)); this one has none"
        )
