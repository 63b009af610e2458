"""The endpoint's record of every episode: what the policy sampled, kept server-side.

An episode id is issued by the server (`EpisodeBook.open`), 128 random bits; a request
that names an id the book never issued, or one already closed, is refused. The book
keeps, per episode, the conversation as the server rendered it and the tokens the
model actually saw and sampled: the first prompt's tokens, then every policy turn's
tokens with their behaviour log-probs and per-token versions, and between turns the
tokens the chat template puts around the client's new messages (policy mask False).
A later request's history must repeat the recorded conversation exactly (the
assistant turns as the server returned them); only the messages after it are
tokenised, so earlier turns are never re-tokenised and the episode is trained on the
tokens as sampled (`close` returns them as one `Sample`).

Bounds: at most `max_open` episodes at once (opening one more is refused), one
request in flight per episode (a second is refused: an episode is one conversation),
and a bounded memory of closed ids (to answer "closed" rather than "unknown").
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
from typing import Any

from streamrl_jax.generation.types import Sample


class BookError(ValueError):
    """A request the book refuses; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Record:
    """One episode's conversation and tokens (guarded by the book's lock while a
    request holds it: one at a time)."""

    id: str
    kind: str = ""  # "chat" or "completion", fixed by the first request
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # chat
    tools: list[Any] = dataclasses.field(default_factory=list)  # chat: the tools offered
    text: str = ""  # completion: the prompt and completions so far, as the client sees it
    sample: Sample | None = None  # every token so far (the last turn's sample)
    prompt: list[int] = dataclasses.field(default_factory=list)
    seed: int | None = None
    turns: int = 0
    cut: int = 0  # turns that ended at max_tokens
    busy: bool = False
    closed: str = ""  # why it was closed ("" while open)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class EpisodeBook:
    """Issued episode ids and their records (module docstring)."""

    def __init__(self, max_open: int = 1024, remember_closed: int = 65536):
        self.max_open = max_open
        self._lock = threading.Lock()
        self._open: dict[str, Record] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._remember = remember_closed

    def open(self, metadata: dict[str, Any] | None = None, seed: int | None = None) -> str:
        """A new episode's id.

        Raises:
          BookError(429): `max_open` episodes are open.
        """
        with self._lock:
            if len(self._open) >= self.max_open:
                raise BookError(
                    429, f"{len(self._open)} episodes are open (the endpoint's limit); close one"
                )
            eid = "ep-" + secrets.token_hex(16)
            self._open[eid] = Record(eid, metadata=dict(metadata or {}), seed=seed)
            return eid

    def take(self, eid: Any) -> Record:
        """The open episode `eid`, held for one request (`give_back` ends the hold).

        Raises:
          BookError: 400 no id; 404 an id never issued; 409 closed, or a request of it
            already in flight.
        """
        if not isinstance(eid, str) or not eid:
            raise BookError(400, "no episode id: send the X-Episode-Id header (POST /v1/episodes)")
        with self._lock:
            rec = self._open.get(eid)
            if rec is None:
                why = self._closed.get(eid)
                if why is not None:
                    raise BookError(409, f"episode {eid} is closed ({why})")
                raise BookError(404, f"episode {eid[:80]!r} was not issued by this endpoint")
            if rec.busy:
                raise BookError(409, f"episode {eid}: a request of it is already in flight")
            rec.busy = True
            return rec

    def fresh(self, eid: Any) -> bool:
        """Whether `eid` is an open episode with no turn yet."""
        with self._lock:
            rec = self._open.get(eid) if isinstance(eid, str) else None
            return rec is not None and rec.turns == 0 and not rec.busy

    def give_back(self, rec: Record) -> None:
        with self._lock:
            rec.busy = False

    def close(self, eid: Any, why: str = "closed by its client") -> Record:
        """Closes `eid` (in flight or not); returns its record.

        Raises:
          BookError: as `take`, for an unknown or already closed id.
        """
        with self._lock:
            rec = self._open.pop(eid, None) if isinstance(eid, str) else None
            if rec is None:
                why_closed = self._closed.get(eid) if isinstance(eid, str) else None
                if why_closed is not None:
                    raise BookError(409, f"episode {eid} is closed ({why_closed})")
                raise BookError(404, f"episode {str(eid)[:80]!r} was not issued by this endpoint")
            rec.closed = why
            self._closed[eid] = why
            while len(self._closed) > self._remember:
                self._closed.popitem(last=False)
            return rec

    def fail(self, rec: Record, why: str) -> None:
        """Closes a held episode that cannot go on (a completion past its deadline)."""
        with self._lock:
            if self._open.pop(rec.id, None) is not None:
                rec.closed = why
                self._closed[rec.id] = why

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)
