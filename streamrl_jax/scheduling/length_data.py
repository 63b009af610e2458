"""The shipped real-length dataset: real policy output lengths per prompt, split by prompt.

`data/lengths/smollm2_varied.jsonl.gz` (its README has the provenance) is what
`tools/bench_scheduling.py --quick` judges the ranker and the dispatch on without
generating anything. One gzipped JSON line per prompt:

    {"prompt_id": "mixture/5/17",      # TaskDataset id "{dataset}/{seed}/{index}"
     "split": "heldout",               # "train" | "heldout" (held-out prompts: never trained on)
     "order": 17,                      # submission order of the prompt in its collection
     "task": "chain_sum",
     "question": "What is 12 + 7 ...",  # the task's question text (the chat prompt's user turn)
     "prompt_tokens": [1, 9690, ...],  # the tokenised chat prompt (what the ranker reads)
     "lengths": [31, 128, 40, 29],     # output tokens of each sample, in request order
     "finish_reasons": ["stop", "length", "stop", "stop"]}

A prompt's samples are in *request* order (the order they were submitted), not the
order they finished in: the first finished sample of a prompt is its shortest, so any
"one sample predicts the others" measurement must not use completion order.
`read_length_dataset` checks every line and names the file, line and field of a bad
one; `logged_samples` turns prompts back into `SampleLog` records, which is what
`tools/train_ranker.py` consumes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterable, Sequence

from streamrl_jax.scheduling.sample_log import LoggedSample

SPLITS = ("train", "heldout")
FINISH_REASONS = ("stop", "length", "context", "forced")
# The repository's data/ folder (the package sits one level below the repository root).
DEFAULT_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "data",
    "lengths",
    "smollm2_varied.jsonl.gz",
)


@dataclasses.dataclass(frozen=True)
class PromptLengths:
    """One prompt of the dataset and the output length of each of its samples."""

    prompt_id: str
    split: str
    order: int
    task: str | None
    question: str
    prompt_tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    finish_reasons: tuple[str, ...]

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"prompt {self.prompt_id}: split {self.split!r} not in {SPLITS}")
        if not self.prompt_tokens or not self.lengths:
            raise ValueError(
                f"prompt {self.prompt_id}: prompt_tokens and lengths must be non-empty"
            )
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"prompt {self.prompt_id}: negative output length in {self.lengths}")
        if len(self.finish_reasons) != len(self.lengths):
            raise ValueError(
                f"prompt {self.prompt_id}: {len(self.finish_reasons)} finish_reasons for "
                f"{len(self.lengths)} lengths"
            )
        bad = set(self.finish_reasons) - set(FINISH_REASONS)
        if bad:
            raise ValueError(f"prompt {self.prompt_id}: unknown finish_reasons {sorted(bad)}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


_TYPES = {
    "prompt_id": str,
    "split": str,
    "order": int,
    "question": str,
    "prompt_tokens": list,
    "lengths": list,
    "finish_reasons": list,
}


def _parse(path: str, no: int, line: str) -> PromptLengths:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{no}: not a JSON object ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}:{no}: not a JSON object")
    for field, kind in _TYPES.items():
        if not isinstance(rec.get(field), kind) or isinstance(rec.get(field), bool):
            raise ValueError(f"{path}:{no}: field {field!r} missing or not a {kind.__name__}")
    for field in ("prompt_tokens", "lengths"):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in rec[field]):
            raise ValueError(f"{path}:{no}: field {field!r} must be a list of integers")
    try:
        return PromptLengths(
            prompt_id=rec["prompt_id"],
            split=rec["split"],
            order=rec["order"],
            task=rec.get("task"),
            question=rec["question"],
            prompt_tokens=tuple(rec["prompt_tokens"]),
            lengths=tuple(rec["lengths"]),
            finish_reasons=tuple(str(x) for x in rec["finish_reasons"]),
        )
    except ValueError as e:
        raise ValueError(f"{path}:{no}: {e}") from None


def read_length_dataset(path: str = DEFAULT_PATH) -> list[PromptLengths]:
    """Every prompt of a dataset file (gzipped when the name ends in .gz), in file order.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a bad line (file, line number and field named) or a repeated prompt id.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"length dataset {path} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    out, seen = [], set()
    with opener(path, "rt", encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            p = _parse(path, no, line)
            if p.prompt_id in seen:
                raise ValueError(f"{path}:{no}: prompt id {p.prompt_id!r} repeated")
            seen.add(p.prompt_id)
            out.append(p)
    if not out:
        raise ValueError(f"length dataset {path} has no prompts")
    return out


def write_length_dataset(path: str, prompts: Iterable[PromptLengths]) -> None:
    """Writes `prompts` (gzipped when the name ends in .gz; mtime 0: same bytes each time)."""
    lines = "".join(json.dumps(p.to_json(), separators=(",", ":")) + "\n" for p in prompts)
    data = lines.encode("utf-8")
    if path.endswith(".gz"):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        f.write(data)


def split(prompts: Sequence[PromptLengths], name: str) -> list[PromptLengths]:
    """The prompts of one split ("train" or "heldout")."""
    if name not in SPLITS:
        raise ValueError(f"split {name!r} not in {SPLITS}")
    return [p for p in prompts if p.split == name]


def logged_samples(prompts: Iterable[PromptLengths]) -> list[LoggedSample]:
    """One `LoggedSample` per sample, request ids numbered so `group_by_prompt` restores
    the request order."""
    return [
        LoggedSample(
            prompt_id=p.prompt_id,
            step=0,
            prompt_tokens=p.prompt_tokens,
            output_length=n,
            task=p.task,
            finish_reason=r,
            request_id=f"{p.order}/{j}",
        )
        for p in prompts
        for j, (n, r) in enumerate(zip(p.lengths, p.finish_reasons, strict=True))
    ]
