"""Partial rollout's carried work across processes, kept beside the run's checkpoints.

In one process a checkpoint at step boundary k holds the work carried into round k (the
samples paused into it, with the requests they continue, and the finished members of
groups not complete yet: `PartialRollout.state`). Across processes that work lives in
the generation processes, each for the groups it owns. So each generation process, when
its rollout closes round k - 1 and before it reports the closure (`start_reporter`),
writes its share of the work carried into round k to
`<workdir>/carried/<k>/generation-<process>.json` (written whole, then renamed into
place). The trainers' step k - 1 waits for every process's report of round k - 1, so
when the first training process saves checkpoint k every share is on disk: the
checkpoint and the shares are one consistent cut. The checkpoint's rollout state names
the shares (`RemoteRounds.state`).

A resumed run's generation processes read every share of round k (`read`: any number
of processes wrote them, so a run may resume onto another count), each keeps the work
of the groups it owns now (`owned`): its paused samples continue in round k, the
finished members go to their training process again (their groups complete in a later
round). A missing or unreadable share is an error naming the file.

Each generation process removes its own shares of rounds no checkpoint can resume from
any more (`prune`): those below the `checkpoint.keep` newest multiples of
`checkpoint.every` and the last `staleness + 3` rounds (a checkpoint on a signal saves
whichever boundary the trainer reached).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

DIR = "carried"
_NAME = re.compile(r"generation-(\d+)\.json")


def share_path(workdir: str, k: int, process: int) -> str:
    return os.path.join(workdir, DIR, str(k), f"generation-{process}.json")


def write(workdir: str, k: int, process: int, state: dict[str, Any]) -> None:
    """Process `process`'s work carried into round k (`PartialRollout.state(k)`),
    written whole (a temporary file, flushed to disk, renamed into place)."""
    path = share_path(workdir, k, process)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(workdir: str, k: int, processes: list[int]) -> dict[str, list[Any]]:
    """Every named process's share of the work carried into round k, merged: its lists
    ("paused", "finished": `partial.to_json` entries; with episodes, "episodes": the
    carried episodes' records, [request id, record]).

    Raises:
      ValueError: a share is missing or is not what `write` writes (naming the file).
    """
    merged: dict[str, list[Any]] = {"paused": [], "finished": []}
    for process in processes:
        path = share_path(workdir, k, process)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"resume from checkpoint {k}: generation-{process}'s carried partial-rollout "
                f"work {path} does not read back ({e})"
            ) from e
        if not isinstance(state, dict) or not all(
            isinstance(state.get(name), list) for name in merged
        ):
            raise ValueError(
                f"resume from checkpoint {k}: {path} is not a carried-work file "
                "(lists 'paused' and 'finished')"
            )
        for name, entries in state.items():
            if not isinstance(entries, list):
                raise ValueError(f"resume from checkpoint {k}: {path}: {name!r} is not a list")
            merged.setdefault(name, []).extend(entries)
    return merged


def owned(state: dict[str, list[Any]], mine: Callable[[int, int], bool]) -> dict[str, list]:
    """The entries of `state` whose group (batch, group) `mine` says this process owns
    (an episode's record: that of a paused sample it keeps)."""
    out = {
        name: [x for x in state[name] if mine(int(x["tag"]["batch"]), int(x["tag"]["group"]))]
        for name in ("paused", "finished")
    }
    if "episodes" in state:
        kept = {x["request_id"] for x in out["paused"]}
        out["episodes"] = [e for e in state["episodes"] if e[0] in kept]
    return out


def prune(workdir: str, process: int, newest: int, every: int, keep: int, recent: int) -> None:
    """Removes `process`'s shares that no checkpoint can resume from any more, `newest`
    being the round it just wrote (module docstring)."""
    kept_multiples = set()
    if every > 0:
        last = newest - newest % every
        kept_multiples = {last - i * every for i in range(keep)}
    root = os.path.join(workdir, DIR)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not name.isdigit():
            continue
        k = int(name)
        if k in kept_multiples or k > newest - recent:
            continue
        path = share_path(workdir, k, process)
        if os.path.exists(path):
            os.remove(path)
        with contextlib.suppress(OSError):  # the last process's share: the round's too
            os.rmdir(os.path.dirname(path))
