"""The scaffold's side: episodes of the endpoint through the official `openai` client.

    client = EndpointClient("http://127.0.0.1:8000", token)
    with client.episode() as (openai_client, episode_id):
        openai_client.chat.completions.create(model="policy", messages=[...])

`episode()` asks the endpoint for an episode id and yields an `openai.OpenAI` whose
every request carries it (the `X-Episode-Id` header); the episode is closed when the
block ends unless `close=False` (a training run closes its episodes itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from streamrl_jax.endpoint.api import EPISODE_HEADER


class EndpointError(RuntimeError):
    """The endpoint refused an episode call; the message is its own."""


class EndpointClient:
    """Episode ids and per-episode OpenAI clients of one endpoint."""

    def __init__(self, url: str, token: str, *, timeout: float = 120.0, max_retries: int = 0):
        self.url, self.token = url.rstrip("/"), token
        self.timeout, self.max_retries = timeout, max_retries
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def _post(self, path: str) -> dict[str, Any]:
        r = self._http.post(path)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - whatever came back, shown
                message = r.text[:200]
            raise EndpointError(f"{path}: {r.status_code} {message}")
        return r.json()

    def open(self) -> str:
        """A new episode's id."""
        return self._post("/v1/episodes")["id"]

    def close(self, episode_id: str) -> dict[str, Any]:
        """Ends the episode; its counts (turns, policy tokens)."""
        return self._post(f"/v1/episodes/{episode_id}/close")

    def openai(self, episode_id: str, **kwargs: Any):
        """An `openai.OpenAI` whose requests belong to `episode_id`."""
        import openai

        return openai.OpenAI(**self._options(episode_id, kwargs))

    def async_openai(self, episode_id: str, **kwargs: Any):
        """An `openai.AsyncOpenAI` whose requests belong to `episode_id`."""
        import openai

        return openai.AsyncOpenAI(**self._options(episode_id, kwargs))

    def _options(self, episode_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "base_url": self.url + "/v1",
            "api_key": self.token,
            "default_headers": {EPISODE_HEADER: episode_id},
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            **kwargs,
        }

    @contextlib.contextmanager
    def episode(self, *, close: bool = True) -> Iterator[tuple[Any, str]]:
        """(an OpenAI client of a new episode, its id); closed at the end if `close`."""
        eid = self.open()
        client = self.openai(eid)
        try:
            yield client, eid
        finally:
            client.close()
            if close:
                self.close(eid)

    def close_client(self) -> None:
        self._http.close()
