"""Tests of the shipped real-length dataset and its reader (scheduling/length_data.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from streamrl_jax.scheduling import length_data
from streamrl_jax.scheduling.sample_log import group_by_prompt


def prompt(pid: str, split: str, order: int, lengths=(5, 9, 7), tokens=(1, 2, 3)):
    return length_data.PromptLengths(
        prompt_id=pid,
        split=split,
        order=order,
        task="chain_sum",
        question=f"question {pid}",
        prompt_tokens=tokens,
        lengths=tuple(lengths),
        finish_reasons=tuple("length" if n >= 9 else "stop" for n in lengths),
    )


@pytest.mark.parametrize("name", ["d.jsonl.gz", "d.jsonl"])
def test_round_trip(tmp_path, name):
    rows = [prompt("m/5/0", "heldout", 0), prompt("m/6/3", "train", 3, (4,), (7, 8))]
    path = str(tmp_path / name)
    length_data.write_length_dataset(path, rows)
    assert length_data.read_length_dataset(path) == rows
    assert length_data.split(rows, "train") == rows[1:]
    with pytest.raises(ValueError, match="split 'test'"):
        length_data.split(rows, "test")


def test_logged_samples_keep_request_order():
    # Logged out of order (completion order); group_by_prompt restores the request order.
    rows = [prompt("m/5/0", "heldout", 0, (12, 3, 7, 5)), prompt("m/5/1", "heldout", 1, (2,))]
    records = length_data.logged_samples(rows)
    groups = group_by_prompt(sorted(records, key=lambda r: r.output_length))
    assert [r.output_length for r in groups["m/5/0"]] == [12, 3, 7, 5]
    assert [r.finish_reason for r in groups["m/5/0"]] == ["length", "stop", "stop", "stop"]
    assert groups["m/5/1"][0].prompt_tokens == (1, 2, 3)


def _write_lines(path, recs):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in recs:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lengths": "12"}, r":1: field 'lengths' missing or not a list"),
        ({"prompt_tokens": [1, "a"]}, r":1: field 'prompt_tokens' must be a list of integers"),
        ({"split": "dev"}, r":1: prompt m/5/0: split 'dev'"),
        ({"finish_reasons": ["stop"]}, r":1: prompt m/5/0: 1 finish_reasons for 3 lengths"),
        ({"finish_reasons": ["stop", "x", "stop"]}, r"unknown finish_reasons \['x'\]"),
        ({"lengths": [3, -1, 2]}, "negative output length"),
        ({"order": None}, r"field 'order' missing"),
    ],
)
def test_bad_lines_are_named(tmp_path, change, message):
    rec = prompt("m/5/0", "heldout", 0).to_json() | change
    path = str(tmp_path / "bad.jsonl.gz")
    _write_lines(path, [rec])
    with pytest.raises(ValueError, match=message):
        length_data.read_length_dataset(path)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        length_data.read_length_dataset(str(tmp_path / "none.jsonl.gz"))
    path = str(tmp_path / "d.jsonl.gz")
    rec = prompt("m/5/0", "heldout", 0).to_json()
    _write_lines(path, [rec, rec])
    with pytest.raises(ValueError, match=r":2: prompt id 'm/5/0' repeated"):
        length_data.read_length_dataset(path)
    _write_lines(path, [rec, "{not json"])
    with pytest.raises(ValueError, match=r":2: not a JSON object"):
        length_data.read_length_dataset(path)
    _write_lines(path, [])
    with pytest.raises(ValueError, match="has no prompts"):
        length_data.read_length_dataset(path)


def test_shipped_dataset():
    """The committed file: both splits, several samples per held-out prompt, and no
    held-out prompt (by its tokens) among the training prompts."""
    rows = length_data.read_length_dataset()
    heldout, train = length_data.split(rows, "heldout"), length_data.split(rows, "train")
    assert len(heldout) >= 100 and len(train) >= 100
    assert min(len(p.lengths) for p in heldout) >= 4
    assert not {p.prompt_tokens for p in heldout} & {p.prompt_tokens for p in train}
    assert all(0 < n <= 128 for p in rows for n in p.lengths)
    assert {p.task for p in rows} >= {"chain_sum", "countdown", "word_sorting"}
