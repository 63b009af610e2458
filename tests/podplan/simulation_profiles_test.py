"""Tests for simulation/profiles.py: measured-profile JSON -> predicted samples/s."""

import json

import pytest

from streamrl_podplan.simulation import profiles


def _profile(**kw):
    p = {
        "global_batch": 4,
        "iterations": 3,
        "warmup": 1,
        "gen_instances": 1,
        "slots": 4,
        "decode": {"batch_sizes": [1, 4], "per_token_s": [0.01, 0.01]},
        "train": {"seconds_per_token": 1e-3, "optimizer_s": 0.0, "min_microbatch_tokens": 0},
        "weight_sync_s": 0.0,
        "switch_s": [0.0, 0.0],
        "lengths": {"prompt": [0, 0, 0, 0], "response": [100, 100, 100, 100]},
        "measured_samples_per_s": {"colocated": 2.0},
    }
    p.update(kw)
    return p


def test_fixed_lengths_closed_form(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile()))
    out = profiles.predict(profiles.load(str(path)))
    # Generation 100 steps x 10 ms = 1 s, training 400 tokens x 1 ms = 0.4 s, no overlap.
    assert out["predicted_samples_per_s"]["colocated"] == pytest.approx(4 / 1.4)
    assert out["predicted_samples_per_s"]["disaggregated_batch"] == pytest.approx(4 / 1.4)
    # Async overlaps them: the slower stage (generation) sets the pace.
    assert out["predicted_samples_per_s"]["stream_async"] == pytest.approx(4 / 1.0)
    assert out["rel_error"]["colocated"] == pytest.approx((4 / 1.4) / 2.0 - 1)


def test_colocated_scale_applies_only_to_colocated():
    out = profiles.predict(_profile(colocated_scale={"decode": 0.5, "train": 0.5}))
    assert out["predicted_samples_per_s"]["colocated"] == pytest.approx(4 / 0.7)
    assert out["predicted_samples_per_s"]["disaggregated_batch"] == pytest.approx(4 / 1.4)


def test_latency_table_interpolates_and_extrapolates():
    dec = profiles.TableDecode(
        batch_sizes=profiles.np.array([1.0, 3.0]), per_token_s=profiles.np.array([1.0, 2.0])
    )
    assert dec.ptl(2) == pytest.approx(1.5)
    assert dec.ptl(5) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"decode": {"batch_sizes": [1, 2], "per_token_s": [0.1]}}, "decode.batch_sizes"),
        ({"train": {}}, "train.seconds_per_token"),
        ({"slots": 0}, "slots"),
        ({"lengths": {"prompt": [1]}}, "lengths.response"),
    ],
)
def test_bad_profiles_name_the_field(patch, field):
    with pytest.raises(ValueError, match=field):
        profiles.predict(_profile(**patch))
