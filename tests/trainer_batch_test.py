"""make_batch layout, buckets and errors; the forward's target alignment against a plain
full-sequence forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.trainer import TrainerConfig, bucket, make_batch
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
    np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.0])
    assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == bool
    assert not batch.returns.any() and not batch.old_values.any()


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


def test_forward_logprobs_match_plain_full_forward():
    cfg = model_config.tiny()
    graphdef, params = nnx.split(llama.create(cfg, 0))
    cfg_chunk4 = TrainerConfig(logprob_chunk=4)
    forward = jax.jit(lambda p, b: policy_forward(nnx.merge(graphdef, p), cfg_chunk4, b))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (3, 1, 6)]
    responses = [rng.integers(0, 256, n) for n in (4, 7, 2)]
    host = make_batch(
        prompts,
        responses,
        behaviour_logp=[np.zeros(len(r)) for r in responses],
        seq_buckets=(16,),
        batch_buckets=(4,),
    )
    got = np.asarray(forward(params, jax.device_put(host)))

    @jax.jit
    def full_logp(params, tokens_BxT):
        # No attention mask, no shift, no chunking: causal attention alone keeps the
        # trailing padding invisible to every real position.
        model = nnx.merge(graphdef, params)
        logits = model.logits(model.hidden_states(tokens_BxT, jnp.ones_like(tokens_BxT)))
        return jax.nn.log_softmax(logits, axis=-1)

    logp_full = np.asarray(full_logp(params, jnp.asarray(host.tokens)))
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        # response token j (at column len(p) + j) is predicted at column len(p) + j - 1
        want = logp_full[i, np.arange(len(p) - 1, len(p) + len(r) - 1), r]
        np.testing.assert_allclose(got[i][host.loss_mask[i]], want, rtol=1e-5, atol=1e-5)
        assert not got[i][~host.loss_mask[i]].any()
