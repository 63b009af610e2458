"""Several training processes (pipeline/shards.py): group ownership and padding.

The collectives themselves run across real processes in tests/multicontroller_test.py.
"""

import numpy as np
import pytest

from streamrl_jax.pipeline.shards import Ownership, pad_batch
from streamrl_jax.trainer.batch import make_batch


@pytest.mark.parametrize("count, per_mini, micro", [(2, 4, 2), (2, 8, 4), (2, 6, 4), (4, 8, 4)])
def test_each_micro_batch_is_the_one_process_groups_split_in_order(count, per_mini, micro):
    own = Ownership(count, per_mini, micro)
    for mini in range(2):
        first = mini * per_mini
        for j in range(own.micro_batches()):
            parts = [own.local_groups(mini, j, t) for t in range(count)]
            # Concatenated in process order: one process's micro-batch j, in order.
            want = list(range(first + j * micro, first + min((j + 1) * micro, per_mini)))
            assert sum(parts, []) == want
            assert len({len(p) for p in parts}) == 1  # the same shape on every process
            for t, part in enumerate(parts):
                assert all(own.owner(g) == t for g in part)


def test_a_split_that_is_not_even_is_refused():
    with pytest.raises(ValueError, match="3 training processes must divide"):
        Ownership(3, 4, 2)
    with pytest.raises(ValueError, match="groups per mini-batch"):
        Ownership(2, 3, 2)


def test_pad_batch_keeps_rows_and_masks_the_padding():
    batch = make_batch(
        [[5, 6], [7]],
        [[1, 2, 3], [4]],
        behaviour_logp=[[-0.1, -0.2, -0.3], [-0.4]],
        advantages=[1.0, -1.0],
        rewards=[1.0, 0.0],
        seq_buckets=(8, 16),
        batch_buckets=(4, 8),
        pad_id=0,
        loss_chunk=3,
    )
    padded = pad_batch(batch, rows=2, seq=16, pad_id=0, width=5)  # cut padding rows, widen
    assert padded.tokens.shape == (2, 16) and padded.rewards.shape == (2, 16)
    np.testing.assert_array_equal(padded.tokens[:, :8], batch.tokens[:2])
    assert not padded.attention_mask[:, 8:].any() and not padded.loss_mask[:, 8:].any()
    assert (padded.prefix_ids[:, 8:] == -1).all() and (padded.group_ids[:, 8:] == -1).all()
    np.testing.assert_array_equal(padded.positions[:, :8], batch.positions[:2])
    # Loss columns keep their places; every padding entry points past the new row end.
    np.testing.assert_array_equal(batch.loss_columns[:2], [[1, 2, 3], [0, 8, 8]])
    np.testing.assert_array_equal(padded.loss_columns, [[1, 2, 3, 16, 16], [0, 16, 16, 16, 16]])
    np.testing.assert_array_equal(padded.advantages[:, :8], batch.advantages[:2])
    empty = pad_batch(None, rows=2, seq=8, pad_id=3)
    assert (empty.tokens == 3).all() and not empty.loss_mask.any()
    assert not empty.attention_mask.any() and (empty.rewards == 0).all()
    assert (empty.prefix_ids == -1).all() and not empty.segment_ids.any()
    assert empty.loss_columns.shape == (2, 1) and (empty.loss_columns == 8).all()
