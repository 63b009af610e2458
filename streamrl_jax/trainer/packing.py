"""Which samples share a prompt and which share a row: the plan of a packed micro-batch.

Host code on lengths only (`batch.make_batch` writes the arrays). A *unit* is
one prompt and the responses that attend to it, laid out in a row as

    prompt[:-1] | prompt[-1] response_1 | prompt[-1] response_2 | ...
    (prefix)      (segment 1)             (segment 2)

Each response segment starts with a copy of the prompt's last token: that
column's hidden state is the prompt's last state (it sees the prefix and
itself, at position P - 1), and it predicts the response's first token. So
column t of a segment still describes token t + 1, the layout every
per-token field and loss already uses, and no position has to predict two
different tokens. A unit of prompt length P and responses R_1..R_k spans

    (P - 1) + sum_i (R_i + 1)   columns,

against sum_i (P + R_i) for k separate rows: P + sum_i R_i + (k - 1), the
prompt once plus one column per extra response.

* Per-sample units (`shared_prompt=False`): one sample each, the layout of
  one sequence per row.
* Shared-prompt units (`shared_prompt=True`): the samples with the same group
  id and the same prompt tokens (a GRPO group), in order.
* A unit longer than the largest row is split into consecutive parts that fit
  (each repeats the prompt); a single sample that does not fit is an error.
* Rows: one unit per row, or (`pack=True`) first-fit decreasing: units sorted
  by length (longest first, ties in input order), each into the first row with
  room, so several short units share a row and fewer rows are padded.

Shape (`plan`): the row length T is a sequence bucket that holds the longest
unit and the row count is padded to a batch bucket B. Without packing T is the
smallest such bucket; with packing, the bucket whose padded size B * T is
smallest, ties to the shorter rows: attention costs grow with the row length
squared and a packed row still computes its masked-out pairs, so rows stay
about one unit long unless longer rows save padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Unit:
    """One prompt and the samples (indices into the batch's inputs) that continue it."""

    samples: tuple[int, ...]
    prompt_len: int
    length: int  # columns: (prompt_len - 1) + sum(response length + 1)


def unit_length(prompt_len: int, response_lens: Sequence[int]) -> int:
    """Columns of a unit: (P - 1) + sum_i (R_i + 1)."""
    return prompt_len - 1 + sum(r + 1 for r in response_lens)


def make_units(
    prompts: Sequence[np.ndarray],
    response_lens: Sequence[int],
    group_ids: Sequence[int],
    *,
    shared_prompt: bool,
) -> list[Unit]:
    """Units in order of their first sample (module docstring)."""
    keys: dict[tuple[int, bytes], list[int]] = {}
    for i, group in enumerate(group_ids):
        key = (int(group), prompts[i].tobytes()) if shared_prompt else (i, b"")
        keys.setdefault(key, []).append(i)
    return [
        Unit(
            tuple(members),
            prompts[members[0]].size,
            unit_length(prompts[members[0]].size, [response_lens[i] for i in members]),
        )
        for members in keys.values()
    ]


def split_unit(unit: Unit, response_lens: Sequence[int], limit: int) -> list[Unit]:
    """`unit` as consecutive parts of at most `limit` columns, each with the prompt.

    Raises:
      ValueError: one sample (prompt + response) longer than `limit`.
    """
    parts: list[list[int]] = [[]]
    for i in unit.samples:
        alone = unit_length(unit.prompt_len, [response_lens[i]])
        if alone > limit:
            raise ValueError(
                f"sequence length (prompt + response): {alone} exceeds the largest bucket {limit}"
            )
        if unit_length(unit.prompt_len, [response_lens[j] for j in parts[-1] + [i]]) > limit:
            parts.append([])
        parts[-1].append(i)
    return [
        Unit(tuple(p), unit.prompt_len, unit_length(unit.prompt_len, [response_lens[i] for i in p]))
        for p in parts
    ]


def bucket(n: int, buckets: Sequence[int], field: str) -> int:
    """Smallest bucket >= n.

    Raises:
      ValueError: naming `field` when n exceeds the largest bucket.
    """
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{field}: {n} exceeds the largest bucket {max(buckets)} ({list(buckets)})")


def plan(
    units: Sequence[Unit], seq_buckets: Sequence[int], batch_buckets: Sequence[int], *, pack: bool
) -> tuple[int, int, list[list[Unit]]]:
    """(T, B, rows): row length, padded row count and each row's units (module docstring).

    Raises:
      ValueError: no bucket holds the longest unit, or the rows exceed the largest
        batch bucket; the message names the field.
    """
    first = bucket(max(u.length for u in units), seq_buckets, "sequence length (prompt + response)")
    best: tuple[int, int, list[list[Unit]]] | None = None
    for t in [t for t in seq_buckets if t >= first] if pack else [first]:
        rows = plan_rows(units, t, pack=pack)
        if len(rows) > max(batch_buckets):
            continue
        b = bucket(len(rows), batch_buckets, "micro-batch size (rows)")
        if best is None or b * t < best[0] * best[1]:
            best = (t, b, rows)
    if best is None:
        bucket(len(rows), batch_buckets, "micro-batch size (rows)")  # raises, naming the field
    return best


def plan_rows(units: Sequence[Unit], row_length: int, *, pack: bool) -> list[list[Unit]]:
    """Units per row, each row at most `row_length` columns (module docstring).

    Every unit must fit (`split_unit` first). Deterministic: the same units in the
    same order give the same rows.
    """
    if not pack:
        return [[u] for u in units]
    rows: list[list[Unit]] = []
    free: list[int] = []
    for u in sorted(units, key=lambda u: -u.length):  # stable: ties keep input order
        for r, room in enumerate(free):
            if room >= u.length:
                rows[r].append(u)
                free[r] -= u.length
                break
        else:
            rows.append([u])
            free.append(row_length - u.length)
    return rows


def shape(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_ids: Sequence[int],
    *,
    loss_chunk: int,
    routing_replay: Any = None,
    **kw: Any,
) -> tuple[int, int, int, int]:
    """(B, T, L, rows) of the micro-batch `batch.make_batch` packs from these lengths,
    without building it: the padded rows and columns, the `loss_columns` width and the
    rows that hold a unit. `kw`: `layout`'s buckets, `shared_prompt` and `pack`. Samples
    with one group id must share one prompt (a GRPO group), as `make_batch`'s
    shared-prompt units require. `pipeline.precompile` plans the trainer's executables
    from it; a test holds it to `make_batch`. Routes (`routing_replay`) add no shape."""
    del routing_replay
    prompts = [np.zeros((n,), np.int32) for n in prompt_lens]
    t, b, rows = layout(prompts, response_lens, group_ids, **kw)
    most = max(sum(response_lens[i] for u in row for i in u.samples) for row in rows)
    return b, t, loss_width(most, t, loss_chunk), len(rows)


def layout(
    prompts: Sequence[np.ndarray],
    response_lens: Sequence[int],
    group_ids: Sequence[int],
    *,
    seq_buckets: Sequence[int],
    batch_buckets: Sequence[int],
    shared_prompt: bool,
    pack: bool,
) -> tuple[int, int, list[list[Unit]]]:
    """(T, B, rows) of a micro-batch: its units (split to fit the largest bucket), then
    `plan` (what `batch.make_batch` writes and `shape` reports)."""
    units = make_units(prompts, response_lens, group_ids, shared_prompt=shared_prompt)
    limit = max(seq_buckets)
    units = [part for u in units for part in split_unit(u, response_lens, limit)]
    return plan(units, seq_buckets, batch_buckets, pack=pack)


def loss_width(most: int, t: int, chunk: int) -> int:
    """`loss_columns`' width L: the longest row's loss count `most` rounded up to a
    multiple of `chunk`, at most T, at least 1."""
    return min(t, max(1, -(-most // chunk) * chunk))
