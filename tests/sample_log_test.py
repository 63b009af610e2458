"""Tests of the per-sample JSONL log (scheduling/sample_log.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streamrl_jax.generation.types import Sample, Timings
from streamrl_jax.scheduling.sample_log import (
    LoggedSample,
    SampleLog,
    group_by_prompt,
    read_sample_log,
)


def make_sample(i: int, n_tokens: int, **meta) -> Sample:
    return Sample(
        request_id=f"train/0/{i}/0",
        prompt=np.arange(1, 4 + i, dtype=np.int32),
        response=np.zeros(n_tokens, np.int32),
        logprobs=np.zeros(n_tokens, np.float32),
        sampling_logprobs=np.zeros(n_tokens, np.float32),
        finish_reason="stop",
        policy_version=2,
        last_policy_version=2,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
        metadata=meta,
    )


def test_round_trip(tmp_path):
    path = str(tmp_path / "sub" / "samples.jsonl")
    with SampleLog(path, flush_every=2) as log:
        log.write(make_sample(0, 5, prompt_id="p0", task="chain_sum"), step=3)
        log.write(make_sample(1, 7), step=4)
    recs = read_sample_log(path)
    assert [r.output_length for r in recs] == [5, 7]
    assert recs[0].prompt_id == "p0" and recs[0].task == "chain_sum" and recs[0].step == 3
    assert recs[1].prompt_id == "train/0/1/0" and recs[1].task is None
    assert recs[1].prompt_tokens == (1, 2, 3, 4)
    assert recs[0].policy_version == 2
    with SampleLog(path) as log:  # a resumed run appends
        log.write(make_sample(2, 1), step=5)
    assert len(read_sample_log(path)) == 3


def test_torn_last_line_is_skipped_other_bad_lines_named(tmp_path):
    path = tmp_path / "s.jsonl"
    good = json.dumps({"prompt_id": "a", "step": 0, "prompt_tokens": [1], "output_length": 2})
    path.write_text(good + "\n" + good[:10])
    assert len(read_sample_log(str(path))) == 1
    path.write_text(good[:10] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"s.jsonl:1: not a JSON"):
        read_sample_log(str(path))
    path.write_text(json.dumps({"prompt_id": "a", "step": 0, "prompt_tokens": [1]}) + "\n")
    with pytest.raises(ValueError, match="s.jsonl:1: missing field 'output_length'"):
        read_sample_log(str(path))


def test_write_after_close_raises(tmp_path):
    log = SampleLog(str(tmp_path / "s.jsonl"))
    log.close()
    with pytest.raises(ValueError, match="after close"):
        log.write(make_sample(0, 1), step=0)


def test_group_by_prompt_keeps_request_order_not_completion_order():
    # Completion order: the short sample of each prompt is logged first.
    recs = [
        LoggedSample("a", 0, (1,), 5, request_id="train/0/0/10"),
        LoggedSample("b", 0, (2,), 3, request_id="train/0/1/0"),
        LoggedSample("a", 0, (1,), 9, request_id="train/0/0/9"),
        LoggedSample("a", 0, (1,), 128, request_id="train/0/0/2"),
    ]
    groups = group_by_prompt(recs)
    assert list(groups) == ["a", "b"]
    assert [r.output_length for r in groups["a"]] == [128, 9, 5]  # requests 2, 9, 10
