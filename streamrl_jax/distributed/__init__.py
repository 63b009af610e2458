"""Multi-controller building blocks: process roles, the sample channel, weight transfer.

`roles` (needs JAX) starts the program and assigns roles; `peers` (open and
authenticate a connection), `channel` (run it) and `transport` (generation →
training samples) are host code that never imports JAX; `shard_sync` /
`shard_receiver` move params pytrees training → generation (the policy, shard to
shard, and the online ranker's parameters). See docs/multicontroller.md.
"""

from streamrl_jax.distributed.channel import (
    AuthenticationFailed,
    ChannelClosed,
    PeerLost,
    TransportError,
    TransportTimeout,
)
from streamrl_jax.distributed.transport import SampleClient, SampleServer

__all__ = [
    "AuthenticationFailed",
    "ChannelClosed",
    "PeerLost",
    "SampleClient",
    "SampleServer",
    "TransportError",
    "TransportTimeout",
]
