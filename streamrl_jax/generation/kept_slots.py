"""Slots kept for a continuation: an episode's next turn extends its KV in place.

A request with `keep_kv` that ends (a stop, the length cap, a forced length) leaves its
slot reserved with the KV of every token but the last sampled one (never fed back). A
continuation with the same request id whose prompt + tokens start with what the slot
holds is appended there (`slots.extend_into_slots`); one that does not match gives the
slot up and re-prefills. A kept slot is reserved until its continuation comes or
`release`; one kept past `EngineConfig.kv_hold_s` is given up once other requests
need slots (`overdue`). Host bookkeeping only, like `admission.PromptSources`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from streamrl_jax.generation.types import GenerationRequest


@dataclasses.dataclass(frozen=True)
class _Kept:
    slot: int
    tokens: list[int]  # what the slot's KV holds: prompt + response[:-1]
    since: float  # time.monotonic() it finished


class KeptSlots:
    """Which slot is kept for which request id (module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[Any, _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._kept

    def slots(self) -> set[int]:
        """The slots kept now."""
        return {k.slot for k in self._kept.values()}

    def keep(self, request_id: Any, slot: int, tokens: list[int]) -> None:
        """`slot` holds the KV of `tokens` for a continuation of `request_id`."""
        self._kept[request_id] = _Kept(slot, tokens, time.monotonic())

    def release(self, request_id: Any) -> bool:
        """Gives up the slot kept for `request_id`; False if none."""
        return self._kept.pop(request_id, None) is not None

    def take(self, req: GenerationRequest) -> tuple[int, int] | None:
        """(slot, tokens it holds) when `req` continues its kept slot's KV, else None;
        either way `req`'s kept slot (if any) is no longer kept."""
        kept = self._kept.pop(req.request_id, None) if req.continuation is not None else None
        if kept is None:
            return None
        full = [*req.prompt, *req.continuation.tokens.tolist()]
        n = len(kept.tokens)
        return (kept.slot, n) if n < len(full) and full[:n] == kept.tokens else None

    def overdue(self, hold_s: float) -> Iterator[tuple[Any, int]]:
        """(request id, slot) of slots kept longer than `hold_s`, oldest first; the
        caller releases those it gives up."""
        cutoff = time.monotonic() - hold_s
        for rid, k in sorted(self._kept.items(), key=lambda kv: kv[1].since):
            if k.since > cutoff:
                return
            yield rid, k.slot
