"""Llama-family decoder in Flax NNX: the training model's full-sequence forward.

`token_logprobs(tokens, targets, mask)` runs the full sequence and returns
per-token log-probs of the targets and the entropy, computed over sequence
chunks under `jax.checkpoint` so the full-vocabulary logits are never held twice
(nor kept for the backward pass); given the trained positions (`columns_BxL`)
it projects only those. Packed rows (several sequences, a prompt shared by
several responses) pass `segments` (`model.segments`): explicit positions and
the shared-prefix attention rule. Generation (prefill and decode against a KV
cache) runs on the engine's own layout of these weights
(`generation/decoder.py`), tested against this forward.

The decoder blocks' parameters are stacked along a leading `layers` axis and
applied with one `jax.lax.scan`, so compile time does not grow with depth.
Every parameter carries logical axis names in its `axes` metadata; the role
rule tables in `streamrl_jax.sharding` map them to mesh axes.

Call these methods inside `jax.jit` on a model rebuilt with `nnx.merge` from
a (graphdef, params) split; params are jit arguments, never closed over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from streamrl_jax.model import layers, lora, vocab_head
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.segments import Segments

# name -> (shape given (L, E, H, K, D, M), logical axes, initialiser kind)
_BLOCK_PARAMS: dict[str, tuple[Callable[..., tuple[int, ...]], tuple[str, ...], str]] = {
    "attn_norm": (lambda L, E, H, K, D, M: (L, E), ("layers", "norm"), "ones"),
    "q": (lambda L, E, H, K, D, M: (L, E, H, D), ("layers", "embed", "heads", "head_dim"), "n"),
    "k": (lambda L, E, H, K, D, M: (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "n"),
    "v": (lambda L, E, H, K, D, M: (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), "n"),
    "o": (lambda L, E, H, K, D, M: (L, H, D, E), ("layers", "heads", "head_dim", "embed"), "n"),
    "mlp_norm": (lambda L, E, H, K, D, M: (L, E), ("layers", "norm"), "ones"),
    "gate": (lambda L, E, H, K, D, M: (L, E, M), ("layers", "embed", "mlp"), "n"),
    "up": (lambda L, E, H, K, D, M: (L, E, M), ("layers", "embed", "mlp"), "n"),
    "down": (lambda L, E, H, K, D, M: (L, M, E), ("layers", "mlp", "embed"), "n"),
}
_BIAS_PARAMS = {
    "q_bias": (lambda L, E, H, K, D, M: (L, H, D), ("layers", "heads", "head_dim"), "zeros"),
    "k_bias": (lambda L, E, H, K, D, M: (L, K, D), ("layers", "kv_heads", "head_dim"), "zeros"),
    "v_bias": (lambda L, E, H, K, D, M: (L, K, D), ("layers", "kv_heads", "head_dim"), "zeros"),
}

_QK_NORM_PARAMS = {
    "q_norm": (lambda L, E, H, K, D, M: (L, D), ("layers", "norm"), "ones"),
    "k_norm": (lambda L, E, H, K, D, M: (L, D), ("layers", "norm"), "ones"),
}

_SANDWICH_PARAMS = {
    "post_attn_norm": (lambda L, E, H, K, D, M: (L, E), ("layers", "norm"), "ones"),
    "post_mlp_norm": (lambda L, E, H, K, D, M: (L, E), ("layers", "norm"), "ones"),
}


def _block_table(cfg: ModelConfig) -> dict:
    """The block parameters `cfg` has: the common ones, biases (Qwen2), q/k norms (Qwen3,
    Gemma 3), norms after attention and the MLP (Gemma 3)."""
    table = dict(
        _BLOCK_PARAMS,
        **(_BIAS_PARAMS if cfg.qkv_bias else {}),
        **(_QK_NORM_PARAMS if cfg.qk_norm else {}),
        **(_SANDWICH_PARAMS if cfg.sandwich_norms else {}),
    )
    if cfg.num_experts:  # the MLP is experts behind a router (Qwen3-MoE, Mixtral)
        for name in ("gate", "up", "down"):
            del table[name]
        x, i = cfg.num_experts, cfg.moe_intermediate_size
        gate_up = (lambda L, E, H, K, D, M: (L, x, E, i), ("layers", "expert", "embed", "mlp"), "n")
        table.update(
            router=(lambda L, E, H, K, D, M: (L, E, x), ("layers", "embed", "expert"), "n"),
            experts_gate=gate_up,
            experts_up=gate_up,
            experts_down=(
                lambda L, E, H, K, D, M: (L, x, i, E),
                ("layers", "expert", "mlp", "embed"),
                "n",
            ),
        )
    return table


def block_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shapes and logical axes of the stacked block parameters (used by loaders)."""
    dims = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    table = _block_table(cfg)
    return {name: (shape_fn(*dims), axes) for name, (shape_fn, axes, _) in table.items()}


def _init(kind: str, rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    return nnx.initializers.normal(0.02)(rngs.params(), shape, dtype)


class DecoderStack(nnx.Module):
    """The L decoder blocks, each parameter stacked along a leading `layers` axis; with
    `cfg.lora_rank`, LoRA adapters `<name>_lora_a` / `<name>_lora_b` (`nnx.LoRAParam`) of
    the targeted matrices (`model/lora.py`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        table = _block_table(cfg)
        specs = block_param_specs(cfg)
        for name, (shape, axes) in specs.items():
            value = _init(table[name][2], rngs, shape, cfg.jnp_param_dtype)
            setattr(self, name, nnx.Param(value, axes=axes))
        self.names = tuple(table)
        adapters = {}
        if cfg.lora_rank:
            adapters = lora.adapter_specs(specs, cfg.lora_targets, cfg.lora_rank, cfg.num_experts)
        for name, ((a_shape, a_axes), (b_shape, b_axes)) in adapters.items():
            # The adapters are what trains: float32 whatever the base's storage dtype
            # (`param_dtype="bfloat16"`: a frozen bf16 base, QLoRA-style memory).
            a = lora.init_a(rngs.params(), name, a_shape, jnp.float32)
            setattr(self, f"{name}_lora_a", nnx.LoRAParam(a, axes=a_axes))
            b = jnp.zeros(b_shape, jnp.float32)
            setattr(self, f"{name}_lora_b", nnx.LoRAParam(b, axes=b_axes))
        self.adapted = tuple(adapters)

    def arrays(self) -> dict[str, jax.Array]:
        """The base weights, stacked (without the adapters: `merged_arrays`)."""
        return {name: getattr(self, name)[...] for name in self.names}

    def adapters(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        """{adapted parameter: (A, B)}, stacked; empty without LoRA."""
        return {
            n: (getattr(self, f"{n}_lora_a")[...], getattr(self, f"{n}_lora_b")[...])
            for n in self.adapted
        }

    def merged_arrays(self, scale: float) -> dict[str, jax.Array]:
        """The weights the blocks compute with: each adapted W + scale * A B."""
        return lora.merged(self.arrays(), self.adapters(), scale)


def remat_policy(name: str) -> Callable[..., bool]:
    """The `jax.checkpoint` policy of `ModelConfig.remat`. The default keeps the matmuls'
    outputs and the attention probabilities and recomputes the elementwise work from
    them (`dots_saveable`: faster than saving everything on XLA:CPU, fewer per-layer
    buffers to allocate; docs/trainer.md, "Where the step goes")."""
    policies = jax.checkpoint_policies
    return {
        "dots_attention": policies.save_from_both_policies(
            policies.dots_saveable, policies.save_only_these_names("attention_probs")
        ),
        "minimal": policies.dots_with_no_batch_dims_saveable,
        "full": policies.nothing_saveable,
        "none": policies.everything_saveable,
    }[name]


class RouterReport(NamedTuple):
    """A mixture of experts' routing over a batch, summed over the layers.

    Attributes:
      load: f32[2, X] `layers.router_stats` (the load-balancing loss's statistics).
      routed: f32[] the routed tokens: real tokens times layers.
      flips: f32[B, T] with routing replay, the share of layers whose replayed experts
        differ from the trainer's own top k at each column; None without replay.
    """

    load: jax.Array
    routed: jax.Array
    flips: jax.Array | None


class Llama(nnx.Module):
    """Llama / Qwen2 / SmolLM2 decoder-only language model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.jnp_param_dtype
        v, e = cfg.vocab_size, cfg.hidden_size
        self.embed = nnx.Param(_init("n", rngs, (v, e), pd), axes=("vocab", "embed"))
        self.layers = DecoderStack(cfg, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((e,), pd), axes=("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_init("n", rngs, (e, v), pd), axes=("embed", "vocab"))

    # ---------------------------------------------------------------- shared pieces
    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Input embeddings of `tokens` (any shape): [..., E] in the compute dtype (times
        sqrt(E) with `embed_scale`, the factor in the embedding's dtype, as Gemma's)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x.astype(self.cfg.jnp_dtype)

    def logits(self, hidden_BxTxE: jax.Array) -> jax.Array:
        """Final norm and output projection; float32 logits [B, T, V]."""
        h = layers.rms_norm(hidden_BxTxE, self.final_norm[...], self.cfg.rms_norm_eps)
        if self.cfg.tie_embeddings:
            w = self.embed[...].astype(h.dtype)
            out = jnp.einsum("bte,ve->btv", h, w)
        else:
            out = jnp.einsum("bte,ev->btv", h, self.lm_head[...].astype(h.dtype))
        return out.astype(jnp.float32)

    def _run_blocks(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        *,
        collect: Callable[[layers.Routing], Any] | None = None,
        routes: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, Any]:
        """All blocks over full sequences; returns the last block's hidden states.

        Args:
          collect: a MoE's per-layer output of each layer's `layers.Routing`, stacked
            along a leading layers axis and returned after the hidden states.
          routes: routing replay: i32/u8[B, T, L, k] the experts each column's token
            went to in each layer where it was generated (`layers.route`).
        """
        cfg = self.cfg
        if (collect is not None or routes is not None) and not cfg.num_experts:
            raise ValueError("router outputs or routing replay of a model without experts")
        cos, sin = layers.rope_tables(positions, layers.rope_inv_freq(cfg))
        windows = jnp.asarray(cfg.layer_windows or (0,) * cfg.num_layers, jnp.int32)
        if cfg.layer_windows:  # sliding-window layers: their own mask (and Gemma 3's RoPE)
            cos_l, sin_l = layers.rope_tables(positions, layers.rope_inv_freq(cfg, local=True))
            behind = positions[:, :, None] - positions[:, None, :]  # [B, T, T] query - key
        replay = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [L, B, T, k]

        def body(x, per_layer):
            p, ad, w, r = per_layer
            p = lora.merge_layer(p, ad, cfg.lora_scale)  # each layer's own (no adapters: p)
            if cfg.layer_windows:
                local = w > 0
                m = mask & (~local | (behind < w))
                c, s = jnp.where(local, cos_l, cos), jnp.where(local, sin_l, sin)
            else:
                m, c, s = mask, cos, sin
            out, routing = layers.block(x, p, cfg, c, s, m, r)
            # the stream between blocks (`ModelConfig.sequence_parallel`)
            out = layers.sequence_parallel(out, cfg)
            return out, (None if collect is None else collect(routing))

        body = jax.checkpoint(body, policy=remat_policy(cfg.remat))
        xs = (self.layers.arrays(), self.layers.adapters(), windows, replay)
        unroll = cfg.scan_unroll if cfg.scan_layers else True
        x = layers.sequence_parallel(x, cfg)
        x, collected = jax.lax.scan(body, x, xs, unroll=unroll)
        x = layers.sequence_parallel(x, cfg, gather=True)  # the heads see whole sequences
        return x if collect is None else (x, collected)

    # ---------------------------------------------------------------- training
    def hidden_states(
        self,
        tokens_BxT: jax.Array,
        mask_BxT: jax.Array,
        *,
        segments: Segments | None = None,
        router_stats: bool = False,
        routes: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, RouterReport]:
        """Last-layer hidden states (before the final norm) of a padded batch.

        Args:
          tokens_BxT: i32 token ids; padding may be on either side.
          mask_BxT: bool/int, 1 on real tokens. Without `segments`, positions count
            real tokens only, so a left-padded and a right-padded copy of a sequence
            agree.
          segments: packed rows (several sequences, shared prefixes): explicit
            positions and the attention rule of `model.segments`; None = one
            sequence per row.
          router_stats: a MoE's `RouterReport` too.
          routes: routing replay, u8/i32[B, T, L, k] (`_run_blocks`; `model/routes.py`).
        """
        positions, attn_mask = self._structure(tokens_BxT, mask_BxT, segments)
        x = self.embed_tokens(tokens_BxT)
        if not router_stats:
            return self._run_blocks(x, positions, attn_mask, routes=routes)
        valid = jnp.diagonal(attn_mask, axis1=1, axis2=2)  # the real tokens

        def collect(r: layers.Routing):
            return layers.router_stats(r.experts, r.probs, valid), r.flipped

        h, (load, flipped) = self._run_blocks(
            x, positions, attn_mask, collect=collect, routes=routes
        )
        routed = self.cfg.num_layers * jnp.sum(valid.astype(jnp.float32))
        flips = None if flipped is None else jnp.mean(flipped.astype(jnp.float32), axis=0)
        return h, RouterReport(jnp.sum(load, axis=0), routed, flips)

    def expert_choices(
        self,
        tokens_BxT: jax.Array,
        mask_BxT: jax.Array,
        *,
        segments: Segments | None = None,
        routes: jax.Array | None = None,
    ) -> jax.Array:
        """The experts a MoE routes each column's token to in every layer (the training
        forward's own choice, or `routes` where replayed): i32[B, T, L, k]."""
        positions, attn_mask = self._structure(tokens_BxT, mask_BxT, segments)
        x = self.embed_tokens(tokens_BxT)
        collect = lambda r: r.experts
        _, experts = self._run_blocks(x, positions, attn_mask, collect=collect, routes=routes)
        return jnp.moveaxis(experts, 0, 2)

    @staticmethod
    def _structure(
        tokens_BxT: jax.Array, mask_BxT: jax.Array, segments: Segments | None
    ) -> tuple[jax.Array, jax.Array]:
        """(positions i32[B, T], attention mask bool[B, T, T]) of `hidden_states`' rows."""
        mask = mask_BxT.astype(bool)
        if segments is None:
            positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
            t = tokens_BxT.shape[1]
            causal = jnp.tril(jnp.ones((t, t), bool))
            return positions, causal[None] & mask[:, None, :]
        return segments.positions, segments.attention_mask() & mask[:, None, :]

    def token_logprobs(
        self,
        tokens_BxT: jax.Array,
        targets_BxT: jax.Array,
        mask_BxT: jax.Array,
        *,
        chunk: int = 128,
        segments: Segments | None = None,
        columns_BxL: jax.Array | None = None,
        router_stats: bool = False,
        routes: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """log p(targets[b, t] | the columns column t sees) and the entropy at each position.

        The vocabulary projection runs over `chunk`-long slices of the sequence,
        each under `jax.checkpoint`: peak memory holds one [B, chunk, V] block of
        logits, and the backward pass recomputes it instead of storing [B, T, V].
        With `cfg.uses_blocked_head` the slices are also tiled over the vocabulary with
        a streamed log-sum-exp, so no row of logits is held (model/vocab_head.py).

        With `columns_BxL` only those positions are projected: each row's hidden
        states at its L listed columns are gathered first, the projection, the
        log-softmax and the entropy run over [B, L], and the results are scattered
        back (0 at every other column). The cost then follows the trained tokens,
        not the prompt and padding. L is static (the array's shape), so there is no
        data-dependent control flow (a `lax.cond` around the projection would put
        the FSDP weight gathers inside a conditional, which XLA:CPU's in-process
        collectives can deadlock on).

        Args:
          tokens_BxT, mask_BxT, segments, routes: as in `hidden_states`.
          targets_BxT: i32 the token whose log-prob column t reports.
          chunk: positions per tile of the vocabulary projection.
          columns_BxL: i32 the columns wanted in each row; entries >= T are
            padding (dropped). None = every column.

        Returns:
          (logp f32[B, T], entropy f32[B, T]); values at positions outside
          `mask_BxT` (or `columns_BxL`) are meaningless (0 with `columns_BxL`) and
          must be masked by the caller. With `router_stats` (a MoE), also its
          `RouterReport`.
        """
        out = self.hidden_states(
            tokens_BxT, mask_BxT, segments=segments, router_stats=router_stats, routes=routes
        )
        hidden_BxTxE, *report = out if router_stats else (out,)
        return (*self._logprobs_at(hidden_BxTxE, targets_BxT, chunk, columns_BxL), *report)

    def _logprobs_at(
        self,
        hidden_BxTxE: jax.Array,
        targets_BxT: jax.Array,
        chunk: int,
        columns_BxL: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        """`token_logprobs` from the last hidden states."""
        if columns_BxL is None:
            return self._chunked_logprobs(hidden_BxTxE, targets_BxT, chunk)
        b, t = targets_BxT.shape
        cols_BxL = jnp.minimum(columns_BxL, t - 1)  # padding entries read column T-1 ...
        h_BxLxE = jnp.take_along_axis(hidden_BxTxE, cols_BxL[..., None], axis=1)
        tg_BxL = jnp.take_along_axis(targets_BxT, cols_BxL, axis=1)
        logp_BxL, ent_BxL = self._chunked_logprobs(h_BxLxE, tg_BxL, chunk)
        rows_Bx1 = jnp.arange(b)[:, None]
        zeros_BxT = jnp.zeros((b, t), jnp.float32)
        # ... and are dropped here (their index is >= T).
        logp_BxT = zeros_BxT.at[rows_Bx1, columns_BxL].set(logp_BxL, mode="drop")
        ent_BxT = zeros_BxT.at[rows_Bx1, columns_BxL].set(ent_BxL, mode="drop")
        return logp_BxT, ent_BxT

    def _chunked_logprobs(
        self, hidden_BxTxE: jax.Array, targets_BxT: jax.Array, chunk: int
    ) -> tuple[jax.Array, jax.Array]:
        """Log-probs and entropies of the targets, `chunk` positions at a time: blocked
        over the vocabulary (`cfg.uses_blocked_head`) or whole [chunk, V] logits."""
        if self.cfg.uses_blocked_head:
            return self._blocked_logprobs(hidden_BxTxE, targets_BxT, chunk)
        b, t, e = hidden_BxTxE.shape
        chunk = min(chunk, t)
        pad = (-t) % chunk
        hidden = jnp.pad(hidden_BxTxE, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
        n = (t + pad) // chunk
        h_NxBxCxE = hidden.reshape(b, n, chunk, e).transpose(1, 0, 2, 3)
        tg_NxBxC = targets.reshape(b, n, chunk).transpose(1, 0, 2)

        @jax.checkpoint
        def one_chunk(args):
            h, tg = args
            logits = self.logits(h)  # f32[B, C, V]
            lse = jax.nn.logsumexp(logits, axis=-1)
            target_logit = jnp.take_along_axis(logits, tg[..., None], axis=-1)[..., 0]
            probs = jnp.exp(logits - lse[..., None])
            entropy = lse - jnp.sum(probs * logits, axis=-1)
            return target_logit - lse, entropy

        logp, ent = jax.lax.map(one_chunk, (h_NxBxCxE, tg_NxBxC))
        logp = logp.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
        ent = ent.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
        return logp, ent

    def _blocked_logprobs(
        self, hidden_BxTxE: jax.Array, targets_BxT: jax.Array, chunk: int
    ) -> tuple[jax.Array, jax.Array]:
        """The final norm, then the projection in [chunk, vocabulary block] tiles that
        never hold a row of logits (`vocab_head.token_logprobs_entropy`)."""
        b, t, e = hidden_BxTxE.shape
        h = layers.rms_norm(hidden_BxTxE, self.final_norm[...], self.cfg.rms_norm_eps)
        if self.cfg.tie_embeddings:
            w_VxE = self.embed[...].astype(h.dtype)
        else:
            w_VxE = self.lm_head[...].astype(h.dtype).T
        logp, ent = vocab_head.token_logprobs_entropy(
            h.reshape(b * t, e), w_VxE, targets_BxT.reshape(b * t), chunk=chunk
        )
        return logp.reshape(b, t), ent.reshape(b, t)


def create(cfg: ModelConfig, seed: int = 0) -> Llama:
    """A randomly initialised model (unsharded; see `sharding.init_sharded`)."""
    return Llama(cfg, rngs=nnx.Rngs(params=seed))
