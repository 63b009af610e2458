"""Per-sample JSONL log of completed generations: what the ranker trains on.

One line per completed sample, appended as it arrives (the pipeline's collector
calls `SampleLog.write(sample, step)`):

    {"prompt_id": "mixture/0/17",   # tag.prompt_id, else metadata["prompt_id"], else request_id
     "request_id": "train/3/5/0",   # str(Sample.request_id)
     "step": 3,                     # training step (global batch) the sample belongs to
     "task": "chain_sum",           # metadata["task"] when present, else null
     "prompt_tokens": [1, 9690, ...],  # the prompt's token ids (what the ranker reads)
     "output_length": 87,           # response tokens (the ranker's target)
     "finish_reason": "stop",       # "stop" | "length" | "context" | "forced"
     "policy_version": 3}

Only the ranker's inputs and target are stored (not the response text), so a
line is a few KB. `read_sample_log` reads the file back, skipping a torn last
line (a run killed mid-write) and naming the file and line of any other bad
line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from streamrl_jax.generation.types import Sample

_FIELDS = ("prompt_id", "step", "prompt_tokens", "output_length")


@dataclasses.dataclass(frozen=True)
class LoggedSample:
    """One line of a sample log.

    Attributes:
      prompt_id: stable id of the prompt (several samples of a GRPO group share it).
      step: training step the sample was generated for.
      prompt_tokens: the prompt's token ids.
      output_length: response length in tokens.
      task: reasoning-gym task name, or None.
      finish_reason: why the response ended.
      request_id: the request's id as a string.
      policy_version: weights version that generated it.
    """

    prompt_id: str
    step: int
    prompt_tokens: tuple[int, ...]
    output_length: int
    task: str | None = None
    finish_reason: str = "stop"
    request_id: str = ""
    policy_version: int = 0


def sample_record(sample: Sample, step: int) -> dict[str, Any]:
    """The JSON object written for `sample` (see the module docstring)."""
    meta = sample.metadata or {}
    return {
        "prompt_id": str(sample.tag.prompt_id or meta.get("prompt_id", sample.request_id)),
        "request_id": str(sample.request_id),
        "step": int(step),
        "task": meta.get("task"),
        "prompt_tokens": np.asarray(sample.prompt).astype(int).tolist(),
        "output_length": int(sample.num_tokens),
        "finish_reason": str(sample.finish_reason),
        "policy_version": int(sample.policy_version),
    }


class SampleLog:
    """Append-only JSONL writer, safe to call from several threads.

    Args:
      path: the JSONL file; its directory is created; an existing file is appended to
        (a resumed run continues its log).
      flush_every: lines between flushes (1 = every line reaches the OS at once).
    """

    def __init__(self, path: str, *, flush_every: int = 16):
        if flush_every < 1:
            raise ValueError(f"SampleLog.flush_every must be >= 1, got {flush_every}")
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._flush_every, self._pending = flush_every, 0

    def write(self, sample: Sample, step: int) -> None:
        """Appends one line for a completed sample of training step `step`."""
        self.write_row(sample_record(sample, step))

    def write_row(self, row: dict[str, Any]) -> None:
        """Appends one line: `row` as JSON."""
        line = json.dumps(row, separators=(",", ":"))
        with self._lock:
            if self._f.closed:
                raise ValueError(f"SampleLog {self.path}: write after close")
            self._f.write(line + "\n")
            self._pending += 1
            if self._pending >= self._flush_every:
                self._f.flush()
                self._pending = 0

    def flush(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()

    def __enter__(self) -> SampleLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_sample_log(path: str) -> Iterator[LoggedSample]:
    """Yields the records of a sample log in file order.

    Raises:
      ValueError: a line (other than a torn last line) is not JSON or lacks a field;
        the message names the file, the line number and the field.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if no == len(lines) and not line.endswith("\n"):
                return  # torn last line of a killed run: the rest is intact
            raise ValueError(f"{path}:{no}: not a JSON object ({e})") from None
        for field in _FIELDS:
            if field not in rec:
                raise ValueError(f"{path}:{no}: missing field {field!r}")
        tokens = rec["prompt_tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise ValueError(f"{path}:{no}: prompt_tokens must be a non-empty list of ids")
        yield LoggedSample(
            prompt_id=str(rec["prompt_id"]),
            step=int(rec["step"]),
            prompt_tokens=tuple(int(t) for t in tokens),
            output_length=int(rec["output_length"]),
            task=rec.get("task"),
            finish_reason=str(rec.get("finish_reason", "stop")),
            request_id=str(rec.get("request_id", "")),
            policy_version=int(rec.get("policy_version", 0)),
        )


def read_sample_log(path: str) -> list[LoggedSample]:
    """All records of a sample log (see `iter_sample_log`)."""
    return list(iter_sample_log(path))


def _request_order(r: LoggedSample) -> tuple:
    """Natural order of request ids: "train/3/5/10" after "train/3/5/9"."""
    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in r.request_id.split("/"))


def group_by_prompt(records: Iterable[LoggedSample]) -> dict[str, list[LoggedSample]]:
    """Each prompt's samples in *request* order (prompts in order of first appearance).

    The log is written in completion order, so in log order a prompt's first sample is
    its shortest; request order is independent of the lengths (any "first sample vs the
    others" or split-half comparison must use it, or it compares short with long).
    """
    groups: dict[str, list[LoggedSample]] = {}
    for r in records:
        groups.setdefault(r.prompt_id, []).append(r)
    return {pid: sorted(rs, key=_request_order) for pid, rs in groups.items()}
