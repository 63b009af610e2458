"""User problems from a JSONL file: the same `Problem`s and reward as `TaskDataset`.

One JSON object per line:

    {"question": "What is 6 * 7?", "answer": 42, "id": "q1", "task": "arith"}

`question` (non-empty string) and `answer` (non-empty string or finite number)
are required; `id` and `task` (non-empty strings) are optional; other keys are
kept in the entry's metadata. Blank lines are ignored. A problem's prompt id is
`"{name}/{id}"`, or `"{name}/{line number}"` for a row without an id.

Bad input fails early and says where: a missing file raises FileNotFoundError;
an empty file, a file without a usable row, duplicate prompt ids, or (with
`on_bad_row="error"`) the first malformed row raise ValueError naming
`path:line`. With `on_bad_row="skip"` malformed rows are skipped, counted in
`skipped_rows` and logged once with their first line numbers.

The reward is `TaskReward` (answer extraction, format bonus) with a scorer that
compares the extracted answer with the row's answer (`answers.same_answer`).
"""

import codecs
import json
import math
import os
import pathlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from absl import logging

from streamrl_jax.errors import UserError
from streamrl_jax.rewards.answers import same_answer
from streamrl_jax.rewards.tasks import Problem, TaskReward

ON_BAD_ROW = ("error", "skip")
_LOGGED_BAD_ROWS = 5  # line numbers named in the skip warning


class _BadRow(Exception):
    """What is wrong with one row (the caller adds `path:line`)."""


def score_reference(answer: str | None, entry: Mapping[str, Any]) -> float:
    """Scorer for `TaskReward`: 1.0 if `answer` matches `entry["answer"]`, else 0.0."""
    return 1.0 if same_answer(answer, str(entry["answer"])) else 0.0


def _json_type(value: object) -> str:
    names = {type(None): "null", bool: "boolean", int: "number", float: "number"}
    names |= {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _optional_text(row: Mapping[str, Any], key: str) -> str | None:
    if key not in row:
        return None
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"{key!r} must be a non-empty string, got {_json_type(value)} {value!r:.40}")
    return value


MAX_LINE_BYTES = 1 << 20  # a longer row is malformed (never read whole into memory)


def _lines(f: Any) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of each line; None for a line over `MAX_LINE_BYTES`, whose
    rest is read and dropped in bounded chunks."""
    line_no = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield line_no, None
        else:
            yield line_no, raw


def _parse_row(line: bytes | None) -> dict[str, Any]:
    """The validated row of one non-blank line; raises `_BadRow`."""
    if line is None:
        raise _BadRow(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        row = json.loads(line.decode("utf-8").rstrip())  # error columns within the line
    except UnicodeDecodeError as e:
        raise _BadRow(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _BadRow(f"invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise _BadRow("JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer past Python's 4,300-digit conversion limit
        raise _BadRow(f"invalid JSON value: {e}") from None
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {_json_type(row)}")
    if "question" not in row:
        raise _BadRow(f"missing 'question' (keys: {sorted(row)})")
    question = row["question"]
    if not isinstance(question, str):
        raise _BadRow(f"'question' must be a string, got {_json_type(question)}")
    if not question.strip():
        raise _BadRow("'question' is empty")
    if "answer" not in row:
        raise _BadRow(f"missing 'answer' (keys: {sorted(row)})")
    answer = row["answer"]
    # bool is an int in Python but never a sensible reference answer.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise _BadRow(f"'answer' must be a string or a number, got {_json_type(answer)}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise _BadRow(f"'answer' must be finite, got {answer}")
    if not str(answer).strip():
        raise _BadRow("'answer' is empty")
    return {
        "question": question,
        "answer": str(answer),
        "id": _optional_text(row, "id"),
        "task": _optional_text(row, "task"),
        "extra": {k: v for k, v in row.items() if k not in ("question", "answer", "id", "task")},
    }


class JsonlDataset(Sequence[Problem]):
    """Problems read from a JSONL file, with the interface of `TaskDataset`.

    Args:
      path: the JSONL file (UTF-8, one object per line).
      name: the dataset name, the prompt-id prefix and the default task
        (default: the file name without its extension).
      on_bad_row: `"error"` raises on the first malformed row; `"skip"` skips
        and counts malformed rows (duplicate ids always raise).
      exclude_questions: question texts to leave out (e.g. the eval split's);
        counted in `excluded_rows`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        on_bad_row: str = "error",
        exclude_questions: Collection[str] = (),
    ):
        if on_bad_row not in ON_BAD_ROW:
            raise UserError(f"on_bad_row={on_bad_row!r}; expected one of {ON_BAD_ROW}")
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            what = "is not a file" if self.path.exists() else "not found"
            raise FileNotFoundError(f"JSONL dataset {self.path}: {what}")
        self.name = self.path.stem if name is None else name
        if not self.name:
            raise UserError(f"JSONL dataset {self.path}: name must be non-empty")
        self.skipped_rows = 0
        self.excluded_rows = 0
        excluded = set(exclude_questions)
        first_line: dict[str, int] = {}  # prompt id -> line that defined it
        bad: list[str] = []
        rows = 0
        self._problems: list[Problem] = []
        with self.path.open("rb") as f:
            for line_no, raw in _lines(f):
                if line_no == 1 and raw is not None:
                    raw = raw.removeprefix(codecs.BOM_UTF8)  # editors on Windows write one
                if raw is not None and not raw.strip():
                    continue
                rows += 1
                try:
                    row = _parse_row(raw)
                except _BadRow as e:
                    if on_bad_row == "error":
                        raise UserError(f"{self.path}:{line_no}: {e}") from None
                    self.skipped_rows += 1
                    bad.append(f"line {line_no} ({e})")
                    continue
                prompt_id = f"{self.name}/{row['id'] or line_no}"
                if prompt_id in first_line:
                    raise UserError(
                        f"{self.path}:{line_no}: duplicate prompt id {prompt_id!r} "
                        f"(first at line {first_line[prompt_id]}); ids must be unique "
                        "and a row without an id uses its line number"
                    )
                first_line[prompt_id] = line_no
                if row["question"] in excluded:
                    self.excluded_rows += 1
                    continue
                self._problems.append(self._problem(row, prompt_id, line_no))
        if bad:
            logging.warning(
                "JSONL dataset %s: skipped %d malformed of %d rows: %s%s",
                self.path,
                len(bad),
                rows,
                "; ".join(bad[:_LOGGED_BAD_ROWS]),
                "; ..." if len(bad) > _LOGGED_BAD_ROWS else "",
            )
        if rows == 0:
            raise UserError(f"JSONL dataset {self.path}: empty file (no rows)")
        if not self._problems:
            raise UserError(
                f"JSONL dataset {self.path}: no usable rows ({rows} rows: "
                f"{self.skipped_rows} malformed and skipped, {self.excluded_rows} excluded)"
            )

    def _problem(self, row: dict[str, Any], prompt_id: str, line_no: int) -> Problem:
        task = row["task"] or self.name
        # The shape of a reasoning-gym entry, so code that reads entries works on both.
        meta = {"source_dataset": task, "path": str(self.path), "line": line_no}
        if row["id"] is not None:
            meta["id"] = row["id"]
        if row["extra"]:
            meta["extra"] = row["extra"]
        entry = {"question": row["question"], "answer": row["answer"], "metadata": meta}
        return Problem(
            prompt_id=prompt_id,
            task=task,
            question=row["question"],
            answer=row["answer"],
            metadata={"task": task, "prompt_id": prompt_id, "entry": entry},
        )

    def __len__(self) -> int:
        return len(self._problems)

    def __getitem__(self, i: int) -> Problem:  # type: ignore[override]
        return self._problems[i]

    def __iter__(self) -> Iterator[Problem]:
        return iter(self._problems)

    def questions(self) -> set[str]:
        """All question texts (to exclude them from another split)."""
        return {p.question for p in self._problems}

    def reward_fn(self, *, format_bonus: float = 0.0, partial_credit: bool = False) -> TaskReward:
        """A `TaskReward` that scores against each problem's reference answer.

        The scorer reads only `metadata["entry"]["answer"]`, so it also scores
        another JSONL split's problems. `partial_credit` is accepted for
        `TaskDataset` compatibility; this scorer is all-or-nothing.
        """
        return TaskReward(
            score_answer=score_reference, format_bonus=format_bonus, partial_credit=partial_credit
        )
