"""The engine's own forward pass: per-layer fused weights, per-layer KV cache, an unrolled loop.

The training model (`model/llama.py`) stacks every block parameter along a
`layers` axis and runs the blocks under one `lax.scan`: compile time does not
grow with depth, which suits training. In a decode step on XLA:CPU the same
layout costs the engine its roofline: each scan iteration materialises the
layer's slice of every stacked weight (a dynamic-slice copy, then the matmul
reads the copy), so the weights cross memory about three times per token
instead of once (profile in docs/generation.md, "Decode step"). The
generation copy of the weights is made anyway (the weight sync places them on
the instance), so the engine keeps its own layout:

* one array per layer (a tuple of L dicts), applied by a Python loop inside
  the jitted step: each matmul reads its weight in place;
* q, k and v fused into one matrix `qkv` [E, K, G + 2, D] (per kv head: its G
  query heads, then its key and its value), so one GEMV per layer reads them,
  and tensor parallelism still shards the `kv_heads` axis;
* gate and up fused as `gate_up` [E, 2, M] (on CPU; [2, E, M] with
  `gate_up_parts_major`, which XLA:TPU reads without a relayout); `o` as [K, G, D, E], the order
  the attention produces, contracted as one [K*G*D, E] matrix;
* the vocabulary projection `lm_head` as [E, V]; with tied embeddings it is
  the only copy, and the embedding lookup takes its columns;
* matrices cast to the compute dtype once here, not per step;
* the KV cache one array per layer for keys and one for values (`LayerCache`):
  values [B, K, S, D], keys [B, K, D, S] (positions minor), so that both of a
  decode step's attention products reduce over a major axis with a contiguous,
  vectorised minor one (scores: over D, S minor; output: over S, D minor);
* attention (`attention="elementwise"`, the default on CPU) as broadcast
  products and sums, which XLA fuses into loops: XLA:CPU runs a batched
  `dot_general` of (slot, kv head) pairs of [G, D] x [D, S] as that many tiny
  matmuls (BENCHMARKS.md "Decode step vs roofline"). "dot" keeps
  the two `einsum`s (what a TPU or GPU wants);
* with `weight_dtype="int8"` every matrix a `quant.QArray` (per-channel int8 +
  f32 scales) and every matmul `quant.einsum` (W8A8), `generation/quant.py`.

`GenModel(weights, cfg)` has `prefill` (prompts into KV-cache slots) and
`decode` (one token for every slot), and computes the training model's function:
tests compare its prefill and decode logits with `Llama`'s full-sequence forward
within float32 rounding (`tests/decoder_test.py`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from streamrl_jax.generation import adapters as adapters_lib
from streamrl_jax.generation import quant
from streamrl_jax.model import layers
from streamrl_jax.model import routes as routes_lib
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.sharding import GENERATE_RULES, logical_to_spec

# The generation layout's axes; `parts` (q heads + k + v, or gate + up) is never sharded.
_RULES = {**GENERATE_RULES, "parts": None, **adapters_lib.RULES}
_LAYER_AXES = {
    "attn_norm": ("norm",),
    "qkv": ("embed", "kv_heads", "parts", "head_dim"),
    "qkv_bias": ("kv_heads", "parts", "head_dim"),
    "q_norm": ("norm",),
    "k_norm": ("norm",),
    "post_attn_norm": ("norm",),
    "post_mlp_norm": ("norm",),
    "router": ("embed", "expert"),
    "experts_gate": ("expert", "embed", "mlp"),
    "experts_up": ("expert", "embed", "mlp"),
    "experts_down": ("expert", "mlp", "embed"),
    "o": ("kv_heads", "parts", "head_dim", "embed"),
    "mlp_norm": ("norm",),
    "gate_up": ("embed", "parts", "mlp"),
    "down": ("mlp", "embed"),
    **adapters_lib.AXES,  # unmerged LoRA adapter slots (`EngineConfig.adapters`)
}
_TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}
CACHE_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")  # values (and keys)
K_CACHE_AXES = ("cache_batch", "kv_heads", "head_dim", "cache_seq")  # keys, positions minor
ATTENTION = ("elementwise", "dot")
_MASK_VALUE = -1e30  # as model.layers: finite, so a fully masked row gives no NaN


@struct.dataclass
class LayerCache:
    """Per-slot keys and values, one array per layer.

    Attributes:
      k: L arrays in the compute dtype (B slots, S max length): [B, K, D, S] keys with
        the positions minor (`K_CACHE_AXES`) when `keys_positions_minor`, else
        [B, K, S, D] as the values.
      v: L arrays [B, K, S, D] (`CACHE_AXES`).
      lengths: i32[B], tokens stored in each slot = position of its next token.
      keys_positions_minor: the keys' layout (static), `EngineConfig.key_layout`:
        positions minor for XLA:CPU's fused decode attention; head dims minor where a
        decode step's one-position write must stay in place (XLA:TPU copies a cache
        whose minor axis is scattered into: docs/generation.md, "Key layout on TPU").
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    keys_positions_minor: bool = struct.field(pytree_node=False, default=True)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_length(self) -> int:
        return self.v[0].shape[2]

    @property
    def k_seq_axis(self) -> int:
        """The position axis of a key array (a value array's is 2)."""
        return 3 if self.keys_positions_minor else 2


def _cache_shapes(cfg: ModelConfig, num_slots: int, max_length: int, positions_minor: bool):
    """A layer's key ([B, K, D, S], or [B, K, S, D] if not `positions_minor`) and value
    ([B, K, S, D]) array shapes."""
    k, d = cfg.num_kv_heads, cfg.head_dim
    v_shape = (num_slots, k, max_length, d)
    return ((num_slots, k, d, max_length) if positions_minor else v_shape), v_shape


def init_cache(
    cfg: ModelConfig, num_slots: int, max_length: int, keys_positions_minor: bool = True
) -> LayerCache:
    """An all-zero cache; call under `jax.jit(..., out_shardings=...)` to place it."""
    if max_length > cfg.max_position_embeddings:
        raise ValueError(
            f"KV cache max_length {max_length} exceeds the model's context "
            f"(max_position_embeddings={cfg.max_position_embeddings})"
        )
    k_shape, v_shape = _cache_shapes(cfg, num_slots, max_length, keys_positions_minor)
    # Distinct buffers: each is donated and updated in place on its own.
    zeros = lambda shape: tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
    return LayerCache(
        k=zeros(k_shape),
        v=zeros(v_shape),
        lengths=jnp.zeros((num_slots,), jnp.int32),
        keys_positions_minor=keys_positions_minor,
    )


def cache_sharding(
    cfg: ModelConfig,
    num_slots: int,
    max_length: int,
    mesh: Mesh,
    keys_positions_minor: bool = True,
) -> tuple[NamedSharding, NamedSharding]:
    """NamedShardings of `init_cache`'s (k, v) arrays (kv heads over "tp")."""
    k_shape, v_shape = _cache_shapes(cfg, num_slots, max_length, keys_positions_minor)
    spec = lambda axes, shape: logical_to_spec(axes, shape, _RULES, mesh, "kv_cache")
    k_axes = K_CACHE_AXES if keys_positions_minor else CACHE_AXES
    return NamedSharding(mesh, spec(k_axes, k_shape)), NamedSharding(
        mesh, spec(CACHE_AXES, v_shape)
    )


def cache_prefix(x: jax.Array, seq_axis: int, n: int) -> jax.Array:
    """The first `n` positions of a layer's key or value cache array whose positions are
    axis `seq_axis` (`LayerCache.k_seq_axis`; 2 for values)."""
    return x[..., :n] if seq_axis == 3 else x[:, :, :n]


def set_cache_prefix(dst: jax.Array, rows: jax.Array, src: jax.Array, seq_axis: int, **kw):
    """`dst` with rows `rows`' first `src`-length positions set to `src` (a key or value
    cache array's rows, as `cache_prefix` takes them); `kw` go to `.set`."""
    if seq_axis == 3:
        return dst.at[rows, :, :, : src.shape[3]].set(src, **kw)
    return dst.at[rows, :, : src.shape[2]].set(src, **kw)


def from_training_layout(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cfg: ModelConfig,
    weight_dtype: str = "auto",
    adapter_slots: int = 0,
    gate_up_parts_major: bool = False,
) -> dict:
    """The generation weights of a (graphdef, params) split of `Llama` (jit it).

    Args:
      weight_dtype: "auto" (matrices in the compute dtype) or "int8" (every matrix a
        `quant.QArray`, quantised per output channel: `generation/quant.py`).
      adapter_slots: 0: a LoRA model's adapters merged into the matrices; N > 0: the base
        unmerged and each layer's table of N adapter slots, the model's adapter in slot 0
        (`generation/adapters.py`).
      gate_up_parts_major: `gate_up` as [2, E, M] instead of [E, 2, M]
        (`EngineConfig.gate_up_layout`).

    Returns:
      {["embed"], "final_norm", "lm_head", "layers": tuple of L per-layer dicts}:
      `lm_head` is [E, V]; `embed` [V, E] only when the embeddings are untied.
    """
    if weight_dtype not in quant.WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype={weight_dtype!r}; expected one of {quant.WEIGHT_DTYPES}")
    model = nnx.merge(graphdef, params)
    if adapter_slots:
        stacked, trained = model.layers.arrays(), model.layers.adapters()
    else:
        stacked = model.layers.merged_arrays(cfg.lora_scale)  # LoRA merged (else the weights)
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g, dt = h // k, cfg.jnp_dtype

    def one(i: int) -> dict[str, jax.Array]:
        p = {name: a[i] for name, a in stacked.items()}
        qkv = [p["q"].reshape(e, k, g, d), p["k"][:, :, None], p["v"][:, :, None]]
        out = {
            "attn_norm": p["attn_norm"],
            "qkv": jnp.concatenate(qkv, axis=2).astype(dt),
            "o": p["o"].reshape(k, g, d, e).astype(dt),
            "mlp_norm": p["mlp_norm"],
        }
        if cfg.num_experts:  # the experts stacked, each token's k run as grouped matmuls
            for name in ("router", "experts_gate", "experts_up", "experts_down"):
                out[name] = p[name].astype(dt)
        else:
            parts = 0 if gate_up_parts_major else 1
            out["gate_up"] = jnp.stack([p["gate"], p["up"]], axis=parts).astype(dt)
            out["down"] = p["down"].astype(dt)
        if cfg.qkv_bias:
            bias = [p["q_bias"].reshape(k, g, d), p["k_bias"][:, None], p["v_bias"][:, None]]
            out["qkv_bias"] = jnp.concatenate(bias, axis=1).astype(dt)
        if cfg.qk_norm:
            out["q_norm"], out["k_norm"] = p["q_norm"], p["k_norm"]
        if cfg.sandwich_norms:
            out["post_attn_norm"], out["post_mlp_norm"] = p["post_attn_norm"], p["post_mlp_norm"]
        if adapter_slots:
            one_adapter = adapters_lib.layer_entries(trained, cfg, i, dt)
            out.update(adapters_lib.tables(one_adapter, adapter_slots))
        return out

    weights = {
        "final_norm": model.final_norm[...],
        "layers": tuple(one(i) for i in range(cfg.num_layers)),
    }
    if cfg.tie_embeddings:
        # One copy, [E, V]: the vocabulary projection reads it in place (a [V, E]
        # operand measured slower in XLA:CPU's dot: docs/generation.md, "Second pass
        # (issue 16)"), the embedding takes columns.
        weights["lm_head"] = model.embed[...].T.astype(dt)
    else:
        weights["embed"] = model.embed[...].astype(dt)
        weights["lm_head"] = model.lm_head[...].astype(dt)
    if weight_dtype == "int8":
        return quant.quantize_weights(weights, gate_up_parts_major)
    return weights


def weight_shardings(weights_shape: Any, mesh: Mesh, gate_up_parts_major: bool = False) -> Any:
    """NamedShardings with the structure of `from_training_layout`'s output (made with
    the same `gate_up_parts_major`)."""
    layer_axes = dict(_LAYER_AXES)
    if gate_up_parts_major:
        layer_axes["gate_up"] = ("parts", "embed", "mlp")
    contracted = quant.contracted(gate_up_parts_major)

    def place(axes, shape, name):
        return NamedSharding(mesh, logical_to_spec(axes, shape, _RULES, mesh, f"generation/{name}"))

    def one(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        axes = layer_axes.get(name) or _TOP_AXES[name]
        if not isinstance(x, quant.QArray):
            return place(axes, tuple(x.shape), name)
        kept = tuple(a for i, a in enumerate(axes) if i not in contracted[name])
        return quant.QArray(
            q=place(axes, tuple(x.q.shape), name),
            scale=place(kept, tuple(x.scale.shape), f"{name}.scale"),
        )

    is_q = lambda x: isinstance(x, quant.QArray)
    return jax.tree_util.tree_map_with_path(one, weights_shape, is_leaf=is_q)


def _columns(head_ExV: jax.Array | quant.QArray, tokens: jax.Array, dtype) -> jax.Array:
    """Embeddings of `tokens` (any shape) as columns of a tied [E, V] head: [..., E]."""
    if isinstance(head_ExV, quant.QArray):
        cols = jnp.take(head_ExV.q, tokens, axis=1).astype(jnp.float32)
        cols = cols * jnp.take(head_ExV.scale, tokens)[None]
    else:
        cols = jnp.take(head_ExV, tokens, axis=1)
    return jnp.moveaxis(cols, 0, -1).astype(dtype)


def _in_window(visible: jax.Array, behind: jax.Array, window: int) -> jax.Array:
    """`visible` narrowed to the keys less than `window` positions behind the query
    (`behind`: query position - key position); a global layer's (0) unchanged."""
    return visible & (behind < window) if window else visible


class GenModel:
    """The engine's forward over generation weights: `prefill`, `extend` and `decode`.

    Each returns the logits, the updated cache and, with `record_routes` (a mixture of
    experts), the experts every fed token went to in every layer (`model/routes.py`):
    [N, P, L, k] from `prefill` and `extend`, [B, L, k] from `decode`; None otherwise.
    """

    def __init__(
        self,
        weights: dict,
        cfg: ModelConfig,
        attention: str = "dot",
        record_routes: bool = False,
        gate_up_parts_major: bool = False,
    ):
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}; expected one of {ATTENTION}")
        if record_routes and not cfg.num_experts:
            raise ValueError("record_routes: the model has no experts")
        self.w, self.cfg, self.attention, self.record = weights, cfg, attention, record_routes
        # `gate_up`'s layout (`from_training_layout`): the MLP's first matmul reads it as is
        self._gate_up = "nte,pem->ntpm" if gate_up_parts_major else "nte,epm->ntpm"

    def _routes(self, per_layer: list[jax.Array]) -> jax.Array | None:
        """The layers' expert choices [..., k] stacked as [..., L, k] (None: not recorded)."""
        if not self.record:
            return None
        return jnp.stack(per_layer, axis=-2).astype(routes_lib.Spec.of(self.cfg).dtype)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = self._embed_rows(tokens)
        if self.cfg.embed_scale:  # Gemma: times sqrt(E)
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x

    def _embed_rows(self, tokens: jax.Array) -> jax.Array:
        if "embed" not in self.w:  # tied: columns of the [E, V] head
            return _columns(self.w["lm_head"], tokens, self.cfg.jnp_dtype)
        e = self.w["embed"]
        if isinstance(e, quant.QArray):
            rows = jnp.take(e.q, tokens, axis=0).astype(jnp.float32)
            return (rows * jnp.take(e.scale, tokens)[..., None]).astype(self.cfg.jnp_dtype)
        return jnp.take(e, tokens, axis=0)

    def _windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: global)."""
        return self.cfg.layer_windows or (0,) * self.cfg.num_layers

    def _ropes(self, positions: jax.Array) -> dict[bool, tuple[jax.Array, jax.Array]]:
        """{local: (cos, sin)} at `positions`: the global layers' and, when there are
        sliding-window layers, theirs."""
        out = {False: layers.rope_tables(positions, layers.rope_inv_freq(self.cfg))}
        if any(self._windows()):
            out[True] = layers.rope_tables(positions, layers.rope_inv_freq(self.cfg, True))
        return out

    def _logits(self, x_NxE: jax.Array) -> jax.Array:
        h = layers.rms_norm(x_NxE, self.w["final_norm"], self.cfg.rms_norm_eps)
        return quant.einsum("ne,ev->nv", h, self.w["lm_head"]).astype(jnp.float32)

    def _selector(self, adapter_N: jax.Array | None) -> jax.Array | None:
        """Rows' one-hot adapter selector [N, slots] when the weights hold adapter
        slots (`generation/adapters.py`; None: no slots, or no row ids given: slot 0)."""
        table = next((x for n, x in self.w["layers"][0].items() if n.endswith("_lora_a")), None)
        if table is None:
            return None
        if adapter_N is None:
            raise ValueError("GenModel: weights with adapter slots need each row's adapter")
        return adapters_lib.selector(adapter_N, table.shape[0], self.cfg.jnp_dtype)

    def _mm(self, spec: str, x, p, name: str, sel):
        """x times fused matrix `name`, plus the rows' adapters when it has a table."""
        w = p[name] if name != "o" else quant.reshape_rows(p["o"], self.cfg.hidden_size)
        y = quant.einsum(spec, x, w)
        if sel is not None:
            d = adapters_lib.delta(x, p, name, sel)
            if d is not None:
                y = y + d.astype(y.dtype)
        return y

    def _qkv(self, x_NxTxE, p, cos, sin, sel=None):
        """q [N, T, K, G, D] and k, v [N, T, K, D], RoPE applied to q and k."""
        n, t, _ = x_NxTxE.shape
        cfg = self.cfg
        k_heads, g, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        h = layers.rms_norm(x_NxTxE, p["attn_norm"], self.cfg.rms_norm_eps)
        qkv = self._mm("nte,ekpd->ntkpd", h, p, "qkv", sel)
        if "qkv_bias" in p:
            qkv = qkv + p["qkv_bias"][None, None]
        q, k = qkv[:, :, :, :g].reshape(n, t, k_heads * g, d), qkv[:, :, :, g]
        if "q_norm" in p:  # Qwen3: each head's query and key normalised before RoPE
            q = layers.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = layers.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
        if cfg.q_prescale is not None:  # attention scale other than 1/sqrt(D) (Gemma 3)
            q = q * jnp.asarray(cfg.q_prescale, q.dtype)
        return q.reshape(n, t, k_heads, g, d), k, qkv[:, :, :, g + 1]

    def _out_and_mlp(self, x_NxTxE, attn_NxTxKxGxD, p, sel=None):
        # [K, G, D, E] read as [K*G*D, E] (a bitcast): contracting the four-axis form
        # made XLA:CPU transpose and copy `o` every layer, every step (docs/generation.md).
        n, t, e = x_NxTxE.shape
        attn_NxTxF = attn_NxTxKxGxD.reshape(n, t, -1)
        eps = self.cfg.rms_norm_eps
        a = self._mm("ntf,fe->nte", attn_NxTxF, p, "o", sel)
        if "post_attn_norm" in p:  # Gemma 3's norms after attention and the MLP
            a = layers.rms_norm(a, p["post_attn_norm"], eps)
        x = x_NxTxE + a
        h = layers.rms_norm(x, p["mlp_norm"], eps)
        experts = None
        if "router" in p:  # mixture of experts (Qwen3-MoE, Mixtral)
            y, routing = layers.moe_mlp(h.reshape(n * t, e), p, self.cfg)
            y, experts = y.reshape(n, t, e), routing.experts.reshape(n, t, -1)
        else:
            gu = self._mm(self._gate_up, h, p, "gate_up", sel)
            act = layers.gate_activation(gu[:, :, 0], self.cfg.mlp_act)
            y = self._mm("ntm,me->nte", act * gu[:, :, 1], p, "down", sel)
        if "post_mlp_norm" in p:
            y = layers.rms_norm(y, p["post_mlp_norm"], eps)
        return x + y, experts

    def prefill(
        self,
        tokens_NxP: jax.Array,
        lengths_N: jax.Array,
        cache: LayerCache,
        slots_N: jax.Array,
        adapter_N: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
        """Writes N right-padded prompts into cache slots; returns next-token logits.

        Args:
          tokens_NxP: i32 prompts, right-padded to a bucket length P <= cache length.
          lengths_N: i32 true prompt lengths (>= 1).
          cache: the engine's cache; slots not in `slots_N` are untouched.
          slots_N: i32 destination slots. An index >= num_slots drops that row
            (used to pad the prefill batch to a fixed size).
          adapter_N: i32 each row's adapter slot (-1: none), needed when the weights
            hold adapter slots (`generation/adapters.py`).

        Returns:
          (f32[N, V] logits at each prompt's last token, updated cache, the routes of
          every position [N, P, L, k] or None: `GenModel`).
        """
        n, p = tokens_NxP.shape
        valid = jnp.arange(p)[None, :] < lengths_N[:, None]
        positions = jnp.broadcast_to(jnp.arange(p)[None, :], (n, p))
        mask = jnp.tril(jnp.ones((p, p), bool))[None] & valid[:, None, :]
        behind = jnp.arange(p)[:, None] - jnp.arange(p)[None, :]  # query - key position
        ropes = self._ropes(positions)
        x = self._embed(tokens_NxP)
        sel = self._selector(adapter_N)
        ks, vs, routes, ka = [], [], [], cache.k_seq_axis
        for w, ck, cv, win in zip(self.w["layers"], cache.k, cache.v, self._windows(), strict=True):
            q, k, v = self._qkv(x, w, *ropes[win > 0], sel)
            m = _in_window(mask, behind[None], win)
            attn = layers.attention(q.reshape(n, p, -1, q.shape[-1]), k, v, m)
            x, experts = self._out_and_mlp(x, attn.reshape(q.shape), w, sel)
            routes.append(experts)
            k = k.transpose(0, 2, 3, 1) if ka == 3 else k.transpose(0, 2, 1, 3)
            ks.append(set_cache_prefix(ck, slots_N, k, ka, mode="drop"))
            vs.append(set_cache_prefix(cv, slots_N, v.transpose(0, 2, 1, 3), 2, mode="drop"))
        last = jnp.take_along_axis(x, (lengths_N - 1)[:, None, None], axis=1)[:, 0]
        lengths = cache.lengths.at[slots_N].set(lengths_N, mode="drop")
        cache = cache.replace(k=tuple(ks), v=tuple(vs), lengths=lengths)
        return self._logits(last), cache, self._routes(routes)

    def extend(
        self,
        tokens_NxP: jax.Array,
        counts_N: jax.Array,
        starts_N: jax.Array,
        cache: LayerCache,
        slots_N: jax.Array,
        adapter_N: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
        """Appends N right-padded token runs to the KV their slots already hold (an
        episode's next turn: prefill in place); returns next-token logits.

        Row n's tokens take positions starts_N[n] .. starts_N[n] + counts_N[n] - 1 of
        slot slots_N[n] and attend to everything before them in that slot (its earlier
        turns) and causally to each other: the function of `prefill` over the whole
        sequence, without recomputing the prefix.

        Args:
          tokens_NxP: i32 new tokens, right-padded to a bucket length P.
          counts_N: i32 how many of each row's tokens are real (>= 1).
          starts_N: i32 the slot's filled positions (= its `lengths`) before the row.
          cache: the engine's cache; slots not in `slots_N` are untouched.
          slots_N: i32 destination slots; an index >= num_slots drops the row (padding).
          adapter_N: i32 each row's adapter slot (as `prefill`).

        Returns:
          (f32[N, V] logits after each row's last token, updated cache, the routes of
          the new tokens [N, P, L, k] or None: `GenModel`).
        """
        n, p = tokens_NxP.shape
        b, s = cache.num_slots, cache.max_length
        positions_NxP = starts_N[:, None] + jnp.arange(p)[None, :]
        valid_NxP = jnp.arange(p)[None, :] < counts_N[:, None]
        # Padding columns write nowhere (position s: dropped); padding rows read a real
        # slot (clipped) and write nowhere either (their slot index is dropped).
        write_NxP = jnp.where(valid_NxP, positions_NxP, s)
        rows_N = jnp.minimum(slots_N, b - 1)
        behind_NxPxS = positions_NxP[:, :, None] - jnp.arange(s)[None, None, :]
        visible_NxPxS = behind_NxPxS >= 0
        ropes = self._ropes(positions_NxP)
        x = self._embed(tokens_NxP)
        sel = self._selector(adapter_N)
        n_idx = jnp.arange(n)[:, None]
        f32, root_d = jnp.float32, math.sqrt(self.cfg.head_dim)
        ks, vs, routes = [], [], []
        if cache.keys_positions_minor:  # [N, K, D, S]
            k_at, k_form = (lambda a: a.at[n_idx, :, :, write_NxP]), "nkds"
        else:  # [N, K, S, D], as the values
            k_at, k_form = (lambda a: a.at[n_idx, :, write_NxP]), "nksd"
        for w, ck, cv, win in zip(self.w["layers"], cache.k, cache.v, self._windows(), strict=True):
            q, k, v = self._qkv(x, w, *ropes[win > 0], sel)  # q [N, P, K, G, D]; k, v [N, P, K, D]
            k_NxKx_ = k_at(ck[rows_N]).set(k, mode="drop")  # [N, K, D, S] or [N, K, S, D]
            v_NxKxSxD = cv[rows_N].at[n_idx, :, write_NxP].set(v, mode="drop")
            seen = _in_window(visible_NxPxS, behind_NxPxS, win)
            scores = jnp.einsum(f"npkgd,{k_form}->nkgps", q, k_NxKx_).astype(f32) / root_d
            scores = jnp.where(seen[:, None, None], scores, _MASK_VALUE)
            probs = jax.nn.softmax(scores, axis=-1).astype(v_NxKxSxD.dtype)
            attn = jnp.einsum("nkgps,nksd->npkgd", probs, v_NxKxSxD)
            x, experts = self._out_and_mlp(x, attn, w, sel)
            routes.append(experts)
            ks.append(ck.at[slots_N].set(k_NxKx_, mode="drop"))
            vs.append(cv.at[slots_N].set(v_NxKxSxD, mode="drop"))
        last = jnp.take_along_axis(x, (counts_N - 1)[:, None, None], axis=1)[:, 0]
        lengths = cache.lengths.at[slots_N].set(starts_N + counts_N, mode="drop")
        cache = cache.replace(k=tuple(ks), v=tuple(vs), lengths=lengths)
        return self._logits(last), cache, self._routes(routes)

    def decode(
        self,
        tokens_B: jax.Array,
        cache: LayerCache,
        active_B: jax.Array,
        adapter_B: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache, jax.Array | None]:
        """Appends one token to every slot and returns the logits after it.

        Args:
          tokens_B: i32 the last sampled token of each slot.
          cache: cache whose `lengths[b]` is the position of `tokens_B[b]`.
          active_B: bool; inactive slots compute but do not advance `lengths`.
          adapter_B: i32 each slot's adapter slot (as `prefill`).

        Returns:
          (f32[B, V] next-token logits, cache with the token's k/v written, the token's
          routes [B, L, k] or None: `GenModel`).
        """
        b, s = tokens_B.shape[0], cache.max_length
        pos_B = jnp.minimum(cache.lengths, s - 1)
        ropes = self._ropes(pos_B[:, None])
        behind_Bx1x1xS = (pos_B[:, None] - jnp.arange(s)[None, :])[:, None, None, :]
        visible_Bx1x1xS = behind_Bx1x1xS >= 0
        rows = jnp.arange(b)
        if cache.keys_positions_minor:  # XLA:CPU's layout, for its fused attention
            k_idx, v_idx = (rows, slice(None), slice(None), pos_B), (rows, slice(None), pos_B)
        else:  # every index explicit: XLA:TPU writes the rows in place (not with a sliced
            # kv-head axis, nor into a minor position axis: it copies the cache then)
            k_idx = v_idx = (rows[:, None], jnp.arange(self.cfg.num_kv_heads)[None], pos_B[:, None])
        x = self._embed(tokens_B[:, None])
        sel = self._selector(adapter_B)
        ks, vs, routes = [], [], []
        for w, ck, cv, win in zip(self.w["layers"], cache.k, cache.v, self._windows(), strict=True):
            q, k, v = self._qkv(x, w, *ropes[win > 0], sel)
            ck = ck.at[k_idx].set(k[:, 0])
            cv = cv.at[v_idx].set(v[:, 0])
            seen = _in_window(visible_Bx1x1xS, behind_Bx1x1xS, win)
            attn = self._attend(q[:, 0], ck, cv, seen, cache.keys_positions_minor)
            x, experts = self._out_and_mlp(x, attn[:, None], w, sel)
            routes.append(None if experts is None else experts[:, 0])
            ks.append(ck)
            vs.append(cv)
        lengths = jnp.where(active_B, jnp.minimum(cache.lengths + 1, s), cache.lengths)
        cache = cache.replace(k=tuple(ks), v=tuple(vs), lengths=lengths)
        return self._logits(x[:, 0]), cache, self._routes(routes)

    def _attend(self, q_BxKxGxD, k_BxKx_, v_BxKxSxD, visible_Bx1x1xS, positions_minor):
        """One query per slot against its cache (keys [B, K, D, S] if `positions_minor`,
        else [B, K, S, D]): [B, K, G, D]."""
        dt, f32 = v_BxKxSxD.dtype, jnp.float32
        if self.attention == "dot":
            form = "bkgd,bkds->bkgs" if positions_minor else "bkgd,bksd->bkgs"
            scores = jnp.einsum(form, q_BxKxGxD, k_BxKx_).astype(f32)
        elif positions_minor:  # products and sums in f32 (fused loops): over D, S minor
            q, k = q_BxKxGxD.astype(f32), k_BxKx_.astype(f32)
            scores = jnp.sum(q[..., None] * k[:, :, None], axis=3)
        else:
            q, k = q_BxKxGxD.astype(f32), k_BxKx_.astype(f32)
            scores = jnp.sum(q[:, :, :, None] * k[:, :, None], axis=4)
        scores = jnp.where(visible_Bx1x1xS, scores / math.sqrt(self.cfg.head_dim), _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1)
        if self.attention == "dot":
            return jnp.einsum("bkgs,bksd->bkgd", probs.astype(dt), v_BxKxSxD)
        v = v_BxKxSxD.astype(f32)
        return jnp.sum(probs[..., None] * v[:, :, None], axis=3).astype(dt)  # over S
