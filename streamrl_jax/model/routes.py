"""Routing replay's record: the experts each token of a sample went to, per layer.

A mixture-of-experts engine that records routes (`EngineConfig.record_routes`, on with
`model.routing_replay`) hands every sample its `Sample.routes`: for each position of
prompt + response whose key and value the slot's KV holds (all but the last sampled
token, which is never fed back), the k experts each layer's router chose there, as
u8[P + R - 1, L, k] (u16 past 254 experts). The trainer's forward then uses these
experts instead of routing again (`layers.route`, "Keep Routing" of DeepSeek-V3.2; the
R3 recipe): generation and training can differ in precision or kernel, and a token whose
router scores are close may go to other experts in training than in generation, which
makes its importance ratio a comparison of two different networks (docs/model.md,
"Routing replay").

Which forward a position's route comes from is the one that wrote its KV in the slot the
sample ended in: the prefill (or a shared-prompt fork, a copy of it), the decode step
that fed the token, or an episode's in-place extension; a continuation that re-prefills
(partial rollout, a given-up kept slot) routes its earlier positions again under the
weights of the re-prefill, as its later tokens saw them.

`Spec.no_route` (the dtype's largest value) marks a position without a record; the trainer
routes such a token itself (batch padding, a sample that came without routes).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from streamrl_jax.model.config import ModelConfig


class Spec(NamedTuple):
    """The size of one model's route records: its experts, layers and experts per token."""

    experts: int
    layers: int
    k: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> Spec:
        if not cfg.num_experts:
            raise ValueError("routes of a model without experts")
        return cls(cfg.num_experts, cfg.num_layers, cfg.experts_per_token)

    @property
    def dtype(self) -> np.dtype:
        """u8 up to 254 experts (255 is `no_route`), else u16."""
        return np.dtype(np.uint8 if self.experts < 255 else np.uint16)

    @property
    def no_route(self) -> int:
        """The id that marks a position without a recorded route."""
        return int(np.iinfo(self.dtype).max)

    def shape(self, positions: int) -> tuple[int, int, int]:
        """A record of `positions` positions: (positions, layers, experts per token)."""
        return (positions, self.layers, self.k)

    def empty(self, positions: int) -> np.ndarray:
        """A record of `positions` positions without a route."""
        return np.full(self.shape(positions), self.no_route, self.dtype)

    def check(self, routes: object, positions: int, what: str) -> np.ndarray:
        """`routes` as a record of `positions` positions, or ValueError naming `what` (a
        sample's routes are untrusted input: they cross processes)."""
        want = self.shape(positions)
        arr = np.asarray(routes)
        if arr.shape != want or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"{what}: routes of shape {arr.shape} ({arr.dtype}), expected integer {want} "
                f"(prompt + response - 1 positions, {self.layers} layers, {self.k} experts "
                "each)"
            )
        bad = (arr >= self.experts) & (arr != self.no_route)
        if arr.size and (arr.min() < 0 or bad.any()):
            raise ValueError(
                f"{what}: routes name an expert outside [0, {self.experts}) "
                f"(largest {int(arr.max())})"
            )
        return arr.astype(self.dtype, copy=False)
