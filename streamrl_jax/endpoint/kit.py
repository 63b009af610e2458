"""An endpoint assembled: over a generation service (`serve`), or for a training run's
scaffolds (`AgentKit`).

`serve` puts an `Endpoint` over a `GenerationService` (a `ServiceBackend`) and starts
it on loopback: serving, tests, benchmarks. `AgentKit` is what the `agents` rollout
(pipeline/rollouts/agents.py) drives: an `Endpoint` on loopback over a
`PipelineBackend` (so every turn goes through the run's driver), a bearer token from a
fresh per-run secret, an `EndpointClient`, the scaffold, and `workers` threads that
each play one episode at a time (a group scaffold: one group).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from streamrl_jax.endpoint import api
from streamrl_jax.endpoint.backend import PipelineBackend, ServiceBackend
from streamrl_jax.endpoint.client import EndpointClient
from streamrl_jax.endpoint.scaffolds import GroupScaffold, Scaffold
from streamrl_jax.endpoint.server import Endpoint, EndpointServer, endpoint_token
from streamrl_jax.endpoint.turns import Context, Turns
from streamrl_jax.generation.service import GenerationService
from streamrl_jax.generation.types import GenerationRequest
from streamrl_jax.model.tokenizer import Tokenizer


def serve(
    service: GenerationService,
    tokenizer: Tokenizer,
    token: str,
    limits: api.Limits,
    *,
    served: str = "policy",
    host: str = "127.0.0.1",
    port: int = 0,
    allow_remote: bool = False,
) -> tuple[Endpoint, EndpointServer]:
    """An endpoint over `service`, listening on `host:port` (loopback unless
    `allow_remote`; port 0: any free one; `server.url`); stop the server, then close
    `endpoint.backend` (which closes the service)."""
    turns = Turns(Context.of(tokenizer, service.engines[0].cfg))
    endpoint = Endpoint(turns, ServiceBackend(service), token, served=served, limits=limits)
    server = EndpointServer(endpoint, host, port, allow_remote=allow_remote)
    server.start()
    return endpoint, server


@dataclasses.dataclass
class AgentKit:
    endpoint: Endpoint
    server: EndpointServer
    backend: PipelineBackend
    client: EndpointClient
    scaffold: Scaffold | GroupScaffold  # one episode's, or a group's together
    workers: concurrent.futures.ThreadPoolExecutor
    timeout_s: float  # a scaffold's first request must come within it

    def cancel(self) -> None:
        """Drops episodes not started yet (the run failed or stops)."""
        self.workers.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stops the server and the scaffolds' threads (a running one is not waited for)."""
        self.cancel()
        self.client.close_client()
        self.server.stop()


def make_agent_kit(
    ctx: Context,
    validate: Callable[[GenerationRequest], None],
    follow: Callable[[GenerationRequest], Any],
    scaffold: Scaffold | GroupScaffold,
    *,
    workers: int,
    limits: api.Limits,
    served: str = "policy",
) -> AgentKit:
    """The kit of a run whose engine takes requests `validate` accepts; `follow(request)`
    is the rollout's outcome that submits a later turn."""
    for name in ("httpx", "httpcore", "openai"):  # a line per request is not the run's log
        logging.getLogger(name).setLevel(logging.WARNING)
    backend = PipelineBackend(validate, follow)
    token = endpoint_token(os.urandom(32))
    endpoint = Endpoint(
        Turns(ctx), backend, token, served=served, limits=limits, single_requests=False
    )
    server = EndpointServer(endpoint)
    client = EndpointClient(server.start(), token, timeout=limits.timeout_s + 30.0)
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="agent")
    return AgentKit(endpoint, server, backend, client, scaffold, pool, limits.timeout_s)
