"""Model properties: causality, padding side, bf16, remat, packed shared-prompt rows ==
separate sequences, response-only log-probs == full. (The engine's prefill+decode ==
this full forward: tests/decoder_test.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.model import config, layers, llama
from streamrl_jax.model.segments import Segments

_CFG = config.tiny(qkv_bias=True)  # biases on, so every parameter kind is exercised
# One token shape for the tests' forwards, so their programs compile once and are reused.
_B, _T = 2, 12


def _init(cfg, seed=0):
    """(graphdef, params) of a fresh model, its initialisation one jitted program."""
    graphdef = _graphdef(cfg)
    return graphdef, jax.jit(lambda: nnx.split(llama.create(cfg, seed=seed))[1])()


@pytest.fixture(scope="module")
def split():
    graphdef, state = _init(_CFG)
    # Random (not zero/one) biases and norm scales, so they matter in every comparison.
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda x: jnp.asarray(x + 0.05 * rng.standard_normal(x.shape)), state)
    return graphdef, state


def _graphdef(cfg):
    """The graphdef of a model variant (dtype/remat) whose params have the same shapes."""
    return nnx.split(nnx.eval_shape(lambda: llama.create(cfg)))[0]


@jax.jit(static_argnums=0)
def _forward(graphdef, params, tokens_BxT, mask_BxT):
    model = nnx.merge(graphdef, params)
    return model.logits(model.hidden_states(tokens_BxT, mask_BxT))


def _tokens(b=_B, t=_T, seed=0):
    return np.random.default_rng(seed).integers(0, _CFG.vocab_size, (b, t)).astype(np.int32)


_ONES = np.ones((_B, _T), bool)


@jax.jit(static_argnums=0)
def _logprobs(graphdef, params, tokens, targets, columns=None):
    return nnx.merge(graphdef, params).token_logprobs(
        tokens, targets, jnp.ones_like(tokens), chunk=5, columns_BxL=columns
    )


def test_future_tokens_do_not_change_past_logits(split):
    graphdef, params = split
    tokens = _tokens()
    changed = tokens.copy()
    changed[:, 6:] = (tokens[:, 6:] + 1) % _CFG.vocab_size
    a = np.asarray(_forward(graphdef, params, tokens, _ONES))
    b = np.asarray(_forward(graphdef, params, changed, _ONES))
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3  # and the change does reach the future


def test_left_and_right_padding_agree(split):
    # one batch: row 0 the sequence right-padded, row 1 the same sequence left-padded
    graphdef, params = split
    seq = _tokens()[0, :7]
    tokens = np.zeros((_B, _T), np.int32)
    tokens[0, :7], tokens[1, 5:] = seq, seq
    mask = np.stack([np.arange(_T) < 7, np.arange(_T) >= 5])
    out = np.asarray(_forward(graphdef, params, tokens, mask))
    np.testing.assert_allclose(out[1, 5:], out[0, :7], atol=1e-5)


def test_token_logprobs_match_log_softmax(split):
    graphdef, params = split
    tokens = _tokens()  # 12 positions in chunks of 5: the last padded
    targets = np.roll(tokens, -1, axis=1)
    logp, ent = _logprobs(graphdef, params, tokens, targets)
    logits = _forward(graphdef, params, tokens, _ONES)
    ref = jax.nn.log_softmax(logits, axis=-1)
    expected = jnp.take_along_axis(ref, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(logp, expected, atol=1e-5)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(ref) * ref, axis=-1), atol=1e-5)


def test_bf16_compute_close_to_fp32(split):
    graphdef, params = split
    tokens = _tokens()
    ref = np.asarray(_forward(graphdef, params, tokens, _ONES))
    bf16 = _forward(_graphdef(_CFG.replace(dtype="bfloat16")), params, tokens, _ONES)
    assert bf16.dtype == jnp.float32  # logits stay float32
    err = np.abs(np.asarray(bf16) - ref).max()
    assert 0 < err < 0.05 * np.abs(ref).max() + 1e-2


def test_unrolled_blocks_give_the_scanned_blocks_logits(split):
    # scan_layers=False is for cost analysis (the pod planner, streamrl_podplan); it computes
    # the same model
    graphdef, params = split
    tokens = _tokens()
    scanned = np.asarray(_forward(graphdef, params, tokens, _ONES))
    unrolled = _forward(_graphdef(_CFG.replace(scan_layers=False)), params, tokens, _ONES)
    np.testing.assert_allclose(np.asarray(unrolled), scanned, atol=1e-5)


@jax.jit(static_argnums=0)
def _grads(gdef, params, tokens, targets):
    def loss(p):
        logp, _ = nnx.merge(gdef, p).token_logprobs(tokens, targets, jnp.ones_like(tokens))
        return -jnp.mean(logp)

    return jax.grad(loss)(params)


@pytest.mark.parametrize(
    "policy",
    # "full" (every activation recomputed: the farthest from the default's saved dots)
    # by default; the other jax.checkpoint policies with -m extended (the suite's budget:
    # each compiles its own backward)
    ["full", *(pytest.param(p, marks=pytest.mark.extended) for p in ("minimal", "none"))],
)
def test_every_remat_policy_gives_the_defaults_gradients(split, policy):
    # what the backward keeps moves memory and time, never a gradient (beyond rounding)
    graphdef, params = split
    tokens = _tokens()
    targets = np.roll(tokens, -1, axis=1)
    assert _CFG.remat == "dots_attention"
    plain = _grads(graphdef, params, tokens, targets)  # compiled once for the three
    remat = _grads(_graphdef(_CFG.replace(remat=policy)), params, tokens, targets)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(plain)) > 0


@pytest.mark.parametrize("tied", [True, False])
def test_blocked_head_equals_the_dense_head(tied):
    """`blocked_head` (model/vocab_head.py) changes how the trainer's log-probs are
    computed, not what: values and every parameter's gradient equal the dense head's
    (the tiny model's 256-entry vocabulary in tiles of 2048: one padded tile; chunks
    of 5 over 12 positions: the last padded)."""
    cfg = _CFG.replace(tie_embeddings=tied)
    _, params = _init(cfg.replace(blocked_head=False))
    tokens = _tokens(seed=4)
    targets = np.roll(tokens, -1, axis=1)

    def run(gdef, params):
        logp, ent = nnx.merge(gdef, params).token_logprobs(
            tokens, targets, jnp.ones_like(tokens), chunk=5
        )
        return jnp.sum(logp) + 0.1 * jnp.sum(ent), (logp, ent)

    outs = {}
    for blocked in (False, True):
        gdef = _graphdef(cfg.replace(blocked_head=blocked))
        outs[blocked] = jax.jit(jax.grad(run, argnums=1, has_aux=True), static_argnums=0)(
            gdef, params
        )
    (g_dense, (lp_dense, ent_dense)), (g_blocked, (lp_blocked, ent_blocked)) = (
        outs[False],
        outs[True],
    )
    np.testing.assert_allclose(lp_blocked, lp_dense, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(ent_blocked, ent_dense, rtol=1e-6, atol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_dense))
    assert scale > 0
    for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


def test_blocked_head_default_follows_the_width():
    assert config.tiny().uses_blocked_head  # width 64
    assert not config.tiny(
        hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64
    ).uses_blocked_head
    assert config.tiny(
        hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, blocked_head=True
    ).uses_blocked_head


def _packed_row():
    """One row: unit 0 = prompt A (4 tokens) with responses r1 (3), r2 (2); unit 1 =
    prompt B (2) with response r3 (3); 2 padding columns. Returns the row's arrays and,
    per response, (the plain sequence prompt + response, the row's columns of it)."""
    rng = np.random.default_rng(5)
    pa, pb = rng.integers(0, 256, 4), rng.integers(0, 256, 2)
    r1, r2, r3 = (rng.integers(0, 256, n) for n in (3, 2, 3))
    # pA[:3] | pA[3] r1 | pA[3] r2 | pB[:1] | pB[1] r3 | pad pad
    tokens = np.concatenate([pa[:3], pa[3:], r1, pa[3:], r2, pb[:1], pb[1:], r3, [0, 0]])
    positions = [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 0, 1, 2, 3, 4, 0, 0]
    prefix = [0] * 10 + [1] * 5 + [-1] * 2
    segment = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 0, 3, 3, 3, 3, 0, 0]
    row = [jnp.asarray(np.asarray(x, np.int32)[None]) for x in (tokens, positions, prefix, segment)]
    pieces = [
        (np.concatenate([pa, r1]), np.r_[0:3, 3:7]),
        (np.concatenate([pa, r2]), np.r_[0:3, 7:10]),
        (np.concatenate([pb, r3]), np.r_[10:11, 11:15]),
    ]
    return row, pieces


def test_shared_prompt_rows_equal_separate_sequences(split):
    """Each response of a packed row sees its prompt and itself only, at positions as if it
    followed the prompt directly: its logits equal a plain forward of prompt + response."""
    graphdef, params = split
    (tokens, positions, prefix, segment), pieces = _packed_row()
    segments = Segments(positions=positions, prefix_ids=prefix, segment_ids=segment)

    @jax.jit
    def packed(params, tokens):
        model = nnx.merge(graphdef, params)
        return model.logits(model.hidden_states(tokens, prefix >= 0, segments=segments))

    got = np.asarray(packed(params, tokens))[0]
    # the plain sequences right-padded into the tests' shared [2, 12] forward
    plain = np.zeros((4, _T), np.int32)
    for i, (seq, _) in enumerate(pieces):
        plain[i, : len(seq)] = seq
    want = np.concatenate([np.asarray(_forward(graphdef, params, plain[i : i + 2], _ONES))
                           for i in (0, 2)])  # fmt: skip
    for i, (seq, cols) in enumerate(pieces):
        np.testing.assert_allclose(got[cols], want[i, : len(seq)], atol=1e-5)
    # Another response's tokens change nothing here (r2 and unit 1 rewritten).
    other = np.array(tokens)
    other[0, 7:] = (other[0, 7:] + 1) % _CFG.vocab_size
    again = np.asarray(packed(params, other))[0]
    np.testing.assert_array_equal(again[:7], got[:7])


@jax.jit(static_argnums=0)
def _objective_grads(graphdef, params, tokens, targets, loss_BxT, columns):
    def objective(params):
        logp, ent = _logprobs(graphdef, params, tokens, targets, columns)
        return jnp.sum(jnp.where(loss_BxT, logp + 0.1 * ent, 0.0))

    return jax.grad(objective)(params)


@pytest.mark.parametrize("marked", [[[1, 5, 6], [8, 9, 10, 11]], [[0, 2, 3, 4, 7, 8], [11]]])
def test_response_only_logprobs_equal_the_full_computation(split, marked):
    """With `columns_BxL` only the listed positions are projected (gathered first, chunked
    over L, padding entries >= T dropped): log-probs, entropies and gradients equal the
    full computation there, and the rest is 0."""
    graphdef, params = split
    tokens = _tokens(seed=3)
    targets = np.roll(tokens, -1, axis=1)
    width = 8  # > the longest row's count: padded with T = 12
    columns = np.full((_B, width), _T, np.int32)
    loss_BxT = np.zeros((_B, _T), bool)
    for row, cols in enumerate(marked):
        loss_BxT[row, cols] = True
        columns[row, : len(cols)] = cols

    logp, ent = _logprobs(graphdef, params, tokens, targets, columns)
    logp_full, ent_full = _logprobs(graphdef, params, tokens, targets)
    np.testing.assert_allclose(logp[loss_BxT], logp_full[loss_BxT], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent[loss_BxT], ent_full[loss_BxT], rtol=1e-6, atol=1e-6)
    assert not np.asarray(logp)[~loss_BxT].any() and not np.asarray(ent)[~loss_BxT].any()
    g_only = _objective_grads(graphdef, params, tokens, targets, loss_BxT, columns)
    g_full = _objective_grads(graphdef, params, tokens, targets, loss_BxT, None)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_full))
    assert scale > 0
    for a, b in zip(jax.tree.leaves(g_only), jax.tree.leaves(g_full), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * scale)


def _assert_vjp_matches(fn, plain, args, cotangent, dtype):
    """`fn`'s value and hand-written VJP equal JAX's differentiation of `plain`: 1e-5 in
    float32, 3e-2 in bfloat16, each gradient relative to its largest entry."""

    @jax.jit
    def both(args, cotangent):  # one program, not an eager op at a time
        y, vjp = jax.vjp(fn, *args)
        y_ref, vjp_ref = jax.vjp(plain, *args)
        return y, y_ref, vjp(cotangent), vjp_ref(cotangent)

    y, y_ref, grads, grads_ref = both(args, cotangent)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=tol, atol=tol)
    for got, want in zip(grads, grads_ref, strict=True):
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        assert scale > 0
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_backward_equals_autodiff(dtype):
    rng = np.random.default_rng(3)
    h, gate, up, down, dy = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((6, 8), (8, 12), (8, 12), (12, 8), (6, 8))
    )

    def plain(*args):
        h, gate, up, down = args
        return (jax.nn.silu(h @ gate) * (h @ up)) @ down

    _assert_vjp_matches(layers.swiglu, plain, (h, gate, up, down), dy, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_backward_equals_autodiff(dtype):
    rng = np.random.default_rng(4)
    q, k, v, dout = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((2, 5, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8), (2, 5, 4, 8))
    )
    mask = (
        jnp.tril(jnp.ones((5, 5), bool))[None]
        & jnp.asarray([[1] * 5, [0, 1, 1, 1, 1]], bool)[:, None, :]
    )

    def plain(q, k, v):  # the same attention, differentiated by JAX
        b, t, h, d = q.shape
        q5 = q.reshape(b, t, 2, h // 2, d)
        s = jnp.einsum("btkgd,bskd->bkgts", q5, k).astype(jnp.float32) / np.sqrt(d)
        s = jnp.where(mask[:, None, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1) * jnp.any(mask, -1)[:, None, None, :, None]
        p = p.astype(v.dtype)  # batch 1's first query sees no key: it gets 0
        return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, h, d)

    _assert_vjp_matches(lambda *a: layers.attention(*a, mask), plain, (q, k, v), dout, dtype)


@pytest.mark.parametrize(
    "rows,dtype",
    [
        (rows, dtype)
        if (rows, dtype) in ((1, jnp.float32), (3, jnp.float32), (4, jnp.bfloat16))
        # the suite's budget: by default one block a row, a ragged last block (3: 3+3+1)
        # in float32 and one in bfloat16 (4: 4+3); the other splits with -m extended
        else pytest.param(rows, dtype, marks=pytest.mark.extended)
        for dtype in (jnp.float32, jnp.bfloat16)
        for rows in (1, 3, 4, 6)
    ],
)
def test_causal_blocks_equal_the_whole_square(rows, dtype):
    # Query blocks against the keys up to their last row (the upper triangle skipped)
    # give the masked whole square's values and gradients: a causal mask with left
    # padding in one row and two packed segments in the other, T = 7 (the last block
    # shorter when `rows` does not divide it).
    rng = np.random.default_rng(5)
    t = 7
    q, k, v, dout = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((2, t, 4, 8), (2, t, 2, 8), (2, t, 2, 8), (2, t, 4, 8))
    )
    segment = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2, 2]])
    mask = (
        jnp.tril(jnp.ones((t, t), bool))[None]
        & (segment[:, :, None] == segment[:, None, :])
        & (segment > 0)[:, None, :]
    )
    whole = lambda *a: layers.attention(*a, mask)  # noqa: E731
    blocked = lambda *a: layers.attention(*a, mask, causal_block=rows)  # noqa: E731
    _assert_vjp_matches(blocked, whole, (q, k, v), dout, dtype)


def test_causal_blocks_need_a_square():
    q = jnp.zeros((1, 4, 2, 8))
    kv = jnp.zeros((1, 6, 1, 8))
    mask = jnp.ones((1, 4, 6), bool)
    with pytest.raises(ValueError, match="as many keys as queries, got 6 and 4"):
        layers.attention(q, kv, kv, mask, causal_block=2)


def test_remat_is_a_named_policy_and_the_old_switch_reads_as_one():
    from support import tiny_config

    from streamrl_jax import config as config_lib
    from streamrl_jax.model import config as model_config

    assert config_lib.REMAT_POLICIES == model_config.REMAT_POLICIES  # two layers, one list
    assert _CFG.replace(remat=True).remat == "full"
    assert _CFG.replace(remat=False).remat == "dots_attention"
    with pytest.raises(ValueError, match=r"ModelConfig.remat='some'; expected one of"):
        _CFG.replace(remat="some")
    with pytest.raises(config_lib.ConfigError, match=r"model.remat"):
        tiny_config(model__remat="some")
    assert tiny_config(model__remat="minimal").model.remat == "minimal"
