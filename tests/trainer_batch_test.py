"""make_batch layout, buckets and errors; the forward's target alignment against a plain
full-sequence forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.trainer import TrainerConfig, bucket, make_batch, packing
from streamrl_jax.trainer.policy import policy_forward

SEQ, BATCH = (8, 16), (2, 4)


def _three():
    prompts = [np.array([5, 6, 7]), np.array([1]), np.array([4, 4])]
    responses = [np.array([8, 9]), np.array([2, 3, 4]), np.array([], np.int32)]
    behaviour = [np.array([-1.0, -2.0]), np.array([-3.0, -4.0, -5.0]), np.zeros(0)]
    return prompts, responses, behaviour


def test_layout_alignment_and_padding_rows():
    prompts, responses, behaviour = _three()
    batch = make_batch(
        prompts,
        responses,
        behaviour_logp=behaviour,
        advantages=[0.5, [1.0, 2.0, 3.0], -1.0],  # per sequence or per token
        rewards=[1.0, 0.0, 0.5],
        ref_logp=[np.array([-0.5, -0.6]), np.zeros(3), np.zeros(0)],
        seq_buckets=SEQ,
        batch_buckets=BATCH,
        pad_id=0,
        loss_chunk=3,
    )
    assert batch.shape == (4, 8)  # 3 rows -> bucket 4; longest 5 tokens -> bucket 8
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch.tokens[1], [1, 2, 3, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.attention_mask.sum(axis=1), [5, 4, 2, 0])
    # Column t trains tokens[t + 1]: response of row 0 sits at columns 3, 4 -> loss at 2, 3.
    np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[0]), [2, 3])
    np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[1]), [0, 1, 2])
    assert not batch.loss_mask[2:].any()  # empty response and the padding row
    np.testing.assert_array_equal(batch.advantages[0, 2:4], [0.5, 0.5])
    np.testing.assert_array_equal(batch.advantages[1, :3], [1.0, 2.0, 3.0])
    assert batch.advantages[~batch.loss_mask].sum() == 0.0
    np.testing.assert_array_equal(batch.behaviour_logp[1, :3], [-3.0, -4.0, -5.0])
    np.testing.assert_array_equal(batch.old_logp, batch.behaviour_logp)  # behaviour-as-old
    np.testing.assert_array_equal(batch.ref_logp[0, 2:4], np.float32([-0.5, -0.6]))
    # The outcome reward sits on each sequence's last loss column (none for an empty one).
    assert batch.rewards.shape == (4, 8) and batch.rewards[0, 3] == batch.rewards.sum() == 1.0
    assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == bool
    assert not batch.returns.any() and not batch.old_values.any()
    # One sequence per row: positions count the row's tokens, the prompt's last token
    # opens the response's segment, padding is unit -1.
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.prefix_ids[0], [0, 0, 0, 0, 0, -1, -1, -1])
    np.testing.assert_array_equal(batch.group_ids[:, 0], [0, 1, 2, -1])  # 0..N-1 by default
    assert (batch.prefix_ids >= 0).tolist() == batch.attention_mask.tolist()
    # Each row's loss columns, padded with T; width: the longest row's 3 (one chunk).
    np.testing.assert_array_equal(batch.loss_columns, [[2, 3, 8], [0, 1, 2], [8] * 3, [8] * 3])


def test_errors_name_the_field():
    prompts, responses, behaviour = _three()
    kw = dict(seq_buckets=SEQ, batch_buckets=BATCH)
    with pytest.raises(ValueError, match="sequence length"):
        make_batch([np.arange(10)], [np.arange(10)], behaviour_logp=[np.zeros(10)], **kw)
    with pytest.raises(ValueError, match="micro-batch size"):
        make_batch([[1]] * 5, [[2]] * 5, behaviour_logp=[[0.0]] * 5, **kw)
    with pytest.raises(ValueError, match=r"behaviour_logp\[1\]"):
        make_batch(
            prompts, responses, behaviour_logp=[behaviour[0], np.zeros(2), np.zeros(0)], **kw
        )
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        make_batch([np.zeros(0)], [[1]], behaviour_logp=[[0.0]], **kw)
    with pytest.raises(ValueError, match="advantages"):
        make_batch(prompts, responses, behaviour_logp=behaviour, advantages=[1.0], **kw)
    assert bucket(5, (4, 8), "x") == 8
    with pytest.raises(ValueError, match="x: 9"):
        bucket(9, (4, 8), "x")


def test_shared_prompt_rows_and_packing():
    # Group 7: prompt (5, 6, 7), responses (8, 9), (10), (); group 9: prompt (1), (2, 3), (4).
    prompts = [[5, 6, 7]] * 3 + [[1]] * 2
    responses = [[8, 9], [10], [], [2, 3], [4]]
    kw = dict(
        behaviour_logp=[np.full(len(r), -1.0) for r in responses],
        advantages=[0.1, 0.2, 0.3, 0.4, 0.5],
        rewards=[1.0, 2.0, 3.0, 4.0, 5.0],
        group_ids=[7, 7, 7, 9, 9],
        batch_buckets=(2, 4),
        shared_prompt=True,
    )
    batch = make_batch(prompts, responses, seq_buckets=(8, 16), loss_chunk=2, **kw)
    # One row per group: the prompt's first P-1 tokens once, then per response a copy
    # of the prompt's last token (it predicts the response's first token) and the
    # response; RoPE positions restart at P-1 for every response.
    assert batch.shape == (2, 8)  # (3-1) + (2+1) + (1+1) + (0+1) = 8 columns
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 8, 9, 7, 10, 7])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 3, 4, 2, 3, 2])
    np.testing.assert_array_equal(batch.segment_ids[0], [0, 0, 1, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[0]), [2, 3, 5])
    np.testing.assert_array_equal(batch.advantages[0], np.float32([0, 0, 0.1, 0.1, 0, 0.2, 0, 0]))
    np.testing.assert_array_equal(batch.rewards[0], [0, 0, 0, 1.0, 0, 2.0, 0, 0])
    np.testing.assert_array_equal(batch.group_ids[0], [7] * 8)
    np.testing.assert_array_equal(batch.tokens[1, :5], [1, 2, 3, 1, 4])  # P = 1: no prefix
    np.testing.assert_array_equal(batch.positions[1, :5], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(batch.segment_ids[1, :5], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(np.flatnonzero(batch.loss_mask[1]), [0, 1, 3])
    np.testing.assert_array_equal(batch.prefix_ids[1], [0] * 5 + [-1] * 3)
    np.testing.assert_array_equal(batch.group_ids[1], [9] * 5 + [-1] * 3)
    np.testing.assert_array_equal(batch.loss_columns, [[2, 3, 5, 8], [0, 1, 3, 8]])  # 2 chunks

    # Packing: both groups in one 16-column row (longest first), ids go on in the row.
    packed = make_batch(prompts, responses, seq_buckets=(16,), pack=True, **kw)
    assert packed.shape == (2, 16) and not packed.attention_mask[1].any()
    np.testing.assert_array_equal(packed.tokens[0, :13], [*batch.tokens[0], 1, 2, 3, 1, 4])
    np.testing.assert_array_equal(packed.prefix_ids[0], [0] * 8 + [1] * 5 + [-1] * 3)
    np.testing.assert_array_equal(packed.segment_ids[0, 8:13], [4, 4, 4, 5, 5])
    np.testing.assert_array_equal(packed.positions[0, :13], [*batch.positions[0], 0, 1, 2, 0, 1])
    for name in ("loss_mask", "advantages", "rewards", "behaviour_logp", "group_ids"):
        got, want = getattr(packed, name)[0], getattr(batch, name)
        np.testing.assert_array_equal(got[:13], np.concatenate([want[0], want[1, :5]]), name)


def test_a_group_longer_than_a_row_is_split_and_a_long_sample_is_an_error():
    prompts, responses = [[1, 2, 3, 4]] * 3, [np.arange(10, 15)] * 3
    kw = dict(seq_buckets=(8, 16), batch_buckets=(4,), shared_prompt=True, pack=True)
    behaviour = [np.zeros(5)] * 3
    batch = make_batch(prompts, responses, behaviour_logp=behaviour, group_ids=[0, 0, 0], **kw)
    # 3 + 3 * 6 = 21 > 16 columns: responses 1-2 (15 columns) and 3 (9), each with the
    # prompt; they do not fit one row together.
    assert batch.shape == (4, 16)
    np.testing.assert_array_equal(batch.attention_mask.sum(axis=1), [15, 9, 0, 0])
    np.testing.assert_array_equal(batch.tokens[1, :4], [1, 2, 3, 4])
    assert batch.loss_mask.sum() == 15 and set(batch.segment_ids[1, 3:9]) == {1}
    with pytest.raises(ValueError, match="sequence length .prompt . response.: 20"):
        make_batch([np.arange(10)], [np.arange(10)], behaviour_logp=[np.zeros(10)], **kw)


@pytest.mark.parametrize("shared, pack", [(False, False), (True, False), (True, True)])
def test_packing_shape_is_the_shape_make_batch_packs(shared, pack):
    """`packing.shape` (pipeline.precompile plans the trainer's executables from it) gives
    make_batch's (B, T, loss_columns width) and its rows holding a unit, on random groups."""
    rng = np.random.default_rng(0)
    kw = dict(seq_buckets=(16, 24, 32, 48, 64), batch_buckets=(1, 2, 4, 8, 16), loss_chunk=8)
    for _ in range(60):
        groups = int(rng.integers(1, 5))
        size = int(rng.integers(1, 5))
        prompts, responses, group_ids = [], [], []
        for g in range(groups):
            prompt = rng.integers(1, 50, int(rng.integers(1, 12)))
            for _ in range(size):
                prompts.append(prompt)
                responses.append(rng.integers(1, 50, int(rng.integers(0, 20))))
                group_ids.append(g)
        batch = make_batch(
            prompts,
            responses,
            behaviour_logp=[np.zeros(len(r)) for r in responses],
            group_ids=group_ids,
            shared_prompt=shared,
            pack=pack,
            **kw,
        )
        b, t, width, rows = packing.shape(
            [len(p) for p in prompts],
            [len(r) for r in responses],
            group_ids,
            shared_prompt=shared,
            pack=pack,
            **kw,
        )
        assert (b, t, width) == (*batch.shape, batch.loss_columns.shape[1])
        assert rows == int(batch.attention_mask.any(axis=1).sum())


def _sequences(batch):
    """{response tokens: (row, loss columns)} of every trained sequence of a batch."""
    out = {}
    for row in range(batch.shape[0]):
        for k in set(batch.segment_ids[row][batch.loss_mask[row]]):
            cols = np.flatnonzero((batch.segment_ids[row] == k) & batch.loss_mask[row])
            out[tuple(batch.tokens[row, cols + 1])] = (row, cols)
    return out


@pytest.mark.parametrize("shared, pack", [(False, False), (True, False), (True, True)])
def test_forward_logprobs_match_plain_full_forward(shared, pack):
    """Response-only log-probs (the policy's forward projects the loss columns only) equal
    log_softmax of a plain full forward of each sample alone, in every layout."""
    cfg = model_config.tiny()
    graphdef, params = nnx.split(llama.create(cfg, 0))
    cfg_chunk4 = TrainerConfig(logprob_chunk=4)
    forward = jax.jit(lambda p, b: policy_forward(nnx.merge(graphdef, p), cfg_chunk4, b))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (3, 3, 3, 1, 6)]
    prompts[1] = prompts[2] = prompts[0]  # samples 0-2: one group
    responses = [rng.integers(0, 256, n) for n in (4, 7, 2, 7, 2)]
    host = make_batch(
        prompts,
        responses,
        behaviour_logp=[np.zeros(len(r)) for r in responses],
        group_ids=[0, 0, 0, 1, 2],
        seq_buckets=(16, 32),
        batch_buckets=(2, 4, 8),
        shared_prompt=shared,
        pack=pack,
    )
    got = np.asarray(forward(params, jax.device_put(host)))

    @jax.jit
    def full_logp(params, tokens_BxT):
        # No attention mask, no shift, no chunking: causal attention alone keeps the
        # trailing padding invisible to every real position.
        model = nnx.merge(graphdef, params)
        logits = model.logits(model.hidden_states(tokens_BxT, jnp.ones_like(tokens_BxT)))
        return jax.nn.log_softmax(logits, axis=-1)

    plain = np.zeros((len(prompts), 16), np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        plain[i, : len(p) + len(r)] = np.concatenate([p, r])
    logp_full = np.asarray(full_logp(params, jnp.asarray(plain)))
    sequences = _sequences(host)
    assert len(sequences) == len(prompts)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        # response token j (at column len(p) + j) is predicted at column len(p) + j - 1
        want = logp_full[i, np.arange(len(p) - 1, len(p) + len(r) - 1), r]
        row, cols = sequences[tuple(r)]
        np.testing.assert_allclose(got[row, cols], want, rtol=1e-5, atol=1e-5)
    assert not got[~host.loss_mask].any()  # only loss positions are computed
