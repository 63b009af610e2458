"""The judge as a tenant of the generation service (`judge.placement="generation"`).

The scoring stage (`pipeline/scoring.py`) calls a `Scorer`; this one computes its
verdicts on the generation instances instead of a scoring mesh of its own. Every
instance holds the judge's params on its own ("tp",) mesh (`Judge.on`: loaded once,
placed on each), and a forward runs on the instance's thread between two of its decode
chunks (`GenerationService.run_on`): the judge and the policy's decode take turns on the
instance's devices, no device is set aside for scoring, and the judge is as near the
samples as they can be. Forwards go to the instances in turn, `parallel` of them (one per
instance) under way at once.

What it costs: the judge's params on every instance (its memory beside the policy's and
the KV cache), and each forward's time out of the instance's decode (counted per
instance, `GenerationService.metrics()["tenant_s"]`). Where the instance's mesh has the
shape of the scoring mesh it replaces (`judge.devices`), a verdict is the same bits
(tested), so a run's parameters do not depend on the placement.

Across processes each generation process holds its instances' tenant and serves it to
the training processes (`distributed/judge_channel.JudgeServer`, published under
`judge/<k>`, k its index among the generation processes), and a training process's
`RemoteJudge` sends its forwards to them in turn: the scoring stage, its queue,
back-pressure and masks stay in the training process, where ingest runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from absl import logging
from jax.sharding import Mesh

from streamrl_jax.rewards.judge import Item, Judge, Verdict


class TenantJudge:
    """A `Scorer` whose forwards run on a generation service's instances (module
    docstring); `attach` gives it the service once the service exists."""

    def __init__(self, judge: Judge, instances: Sequence[Mesh], timeout_s: float):
        """`judge`: loaded on a mesh of the instances' shape (placed on each instance
        here); `timeout_s`: the longest a forward waits (`judge.timeout_s`)."""
        self.judges = [judge if m is judge.mesh else judge.on(m) for m in instances]
        self.batch, self.parallel = judge.batch, len(self.judges)
        self.timeout_s = timeout_s
        self.service = None
        self._next = 0
        self._lock = threading.Lock()  # the turn (the stage calls from `parallel` threads)

    def attach(self, service) -> None:
        """The service whose instances (one per judge here) run the forwards."""
        if service.num_instances != len(self.judges):
            raise ValueError(
                f"judge tenant: {len(self.judges)} judges for a service of "
                f"{service.num_instances} instances"
            )
        self.service = service
        logging.info("judge: a tenant of %d generation instance(s)", len(self.judges))

    def __call__(self, items: Sequence[Item]) -> list[Verdict]:
        """The verdicts of `items`, in order, computed on the next instance in turn.

        Raises:
          RuntimeError: no service attached yet.
          TimeoutError: the instance did not run the forward within `timeout_s`.
          StreamClosed / InstanceError: the service closed or the instance failed.
        """
        service = self.service
        if service is None:
            raise RuntimeError("judge tenant: no generation service attached")
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self.judges)
        judge = self.judges[i]
        future = service.run_on(i, lambda: judge(items), f"a judge forward of {len(items)}")
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()  # still queued: never run (running: its result is dropped)
            raise TimeoutError(
                f"judge tenant: generation instance {i} did not run a forward of "
                f"{len(items)} samples within judge.timeout_s={self.timeout_s:g} s"
            ) from None
