"""The ranker on disk (scheduling/ranker_file.py): arrays + JSON, checked before loading."""

import json
import re
import zipfile

import numpy as np
import pytest

from streamrl_jax.scheduling.ranker import Ranker, RankerConfig
from streamrl_jax.scheduling.ranker_file import FORMAT, load_ranker, save_ranker

CFG = RankerConfig(vocab_size=97, max_tokens=16, embed_dim=8, hidden_dim=8, seed=3)
PROMPTS = [list(range(i, i + 5)) for i in range(6)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ranker = Ranker(CFG)
    ranker.update([(tuple(p), 10 * i) for i, p in enumerate(PROMPTS)] * 20)
    path = str(tmp_path_factory.mktemp("ranker") / "ranker.npz")
    save_ranker(path, ranker, {"recall_at_20": 0.5})
    return ranker, path


def test_round_trip_restores_the_scores_without_pickle(saved):
    ranker, path = saved
    loaded = load_ranker(path)
    assert loaded.cfg == CFG and loaded.steps == ranker.steps > 0
    np.testing.assert_array_equal(loaded.score(PROMPTS), ranker.score(PROMPTS))
    with zipfile.ZipFile(path) as z:  # nothing in the file needs pickle to read
        for name in z.namelist():
            with z.open(name) as f:
                np.lib.format.read_array(f, allow_pickle=False)


def _rewrite(path, out, *, meta=None, arrays=None):
    """A copy of the ranker file `path` with its meta and/or arrays replaced."""
    with np.load(path, allow_pickle=False) as z:
        entries = {k: z[k] for k in z.files}
    if meta is not None:
        entries["__meta__"] = np.asarray(json.dumps(meta))
    entries |= arrays or {}
    with open(out, "wb") as f:
        np.savez(f, **entries)
    return str(out)


def _meta(path):
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["__meta__"]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m | {"format": "pickle"}, "not a ranker file of format"),
        (
            lambda m: m | {"config": m["config"] | {"vocab_size": 10**12}},
            "vocab_size=.* out of range",
        ),
        (lambda m: m | {"config": m["config"] | {"embed_dim": 8.5}}, "must be an integer"),
        (lambda m: m | {"config": m["config"] | {"layers": 3}}, "does not match RankerConfig"),
        (lambda m: m | {"config": m["config"] | {"hidden_dim": 16}}, "expected float32"),
    ],
)
def test_a_bad_meta_is_named(saved, tmp_path, change, message):
    _, path = saved
    bad = _rewrite(path, tmp_path / "bad.npz", meta=change(_meta(path)))
    with pytest.raises(ValueError, match=message):
        load_ranker(bad)


def test_a_wrong_array_is_refused_before_it_is_read(saved, tmp_path):
    _, path = saved
    with np.load(path, allow_pickle=False) as z:
        key = next(k for k in z.files if "embed" in k)
    huge = np.zeros((4, 4), np.float64)  # wrong shape and dtype
    bad = _rewrite(path, tmp_path / "bad.npz", arrays={key: huge})
    with pytest.raises(ValueError, match=re.escape(f"array {key} is float64[4, 4], expected")):
        load_ranker(bad)


def test_not_a_ranker_file_is_named(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"\x80\x04 not a zip")
    with pytest.raises(ValueError, match=f"ranker_path {junk}: not a readable ranker file"):
        load_ranker(str(junk))
    with pytest.raises(FileNotFoundError, match="ranker_path .* does not exist"):
        load_ranker(str(tmp_path / "missing.npz"))
    assert FORMAT.startswith("streamrl-ranker/")
