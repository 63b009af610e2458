"""An auxiliary supervised loss on an environment's demonstrations, mixed into RL steps
(`algorithm.sft_coef > 0`).

The supervised warm-up (pipeline/warmup.py) trains on the environment's demonstrations
before RL; this target keeps training on them during RL. With every RL micro-batch the
policy's accumulator also takes one micro-batch of `algorithm.sft_batch`
demonstrations (`demonstrations.py`), through the policy's own step with advantage
`sft_coef` and the old and behaviour log-probs set to the current policy's (ratio 1,
importance weight 1): its gradient is `sft_coef` times that of the demonstrations'
negative log-likelihood. Its tokens join the step's normaliser (token-mean: the mean
over the RL and demonstration tokens), and its loss terms join the policy's row
figures; the row gets `sft_nll`, the mean negative log-likelihood per demonstration
token under W_b.

Which demonstrations a micro-batch takes depends only on (batch, micro-batch index,
run seed): a resumed run draws the same ones, and the target saves no state. With T
training processes every one draws the same `sft_batch` and feeds its own slice of
`sft_batch / T` (`Micro.rows`), padded to the shape they agree on: the same
demonstration batch as one process.
"""

from __future__ import annotations

import numpy as np

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.errors import UserError
from streamrl_jax.learner.demonstrations import Demonstration, demonstrations
from streamrl_jax.learner.learner import POLICY
from streamrl_jax.learner.protocol import (
    Accumulators,
    Context,
    Metrics,
    Micro,
    Reduce,
    Target,
    Totals,
)
from streamrl_jax.trainer.batch import TrainBatch, make_batch

NAME = "supervised"


def wanted(cfg: ExperimentConfig) -> bool:
    return cfg.algorithm.sft_coef > 0


def make(ctx: Context) -> Target:
    a = ctx.cfg.algorithm
    demos = demonstrations(ctx.cfg, ctx.tokenizer, ctx.problems)
    if not demos:
        raise UserError(
            f"algorithm.sft_coef={a.sft_coef}: environment {ctx.cfg.environment.name!r} has "
            "no demonstration for the training problems"
        )
    rows = ctx.trainer.cfg.batch_buckets[-1]
    if a.sft_batch > rows:
        raise UserError(
            f"algorithm.sft_batch ({a.sft_batch}) exceeds the largest micro-batch the "
            f"trainer packs ({rows} rows)"
        )
    loss = Supervised(demos, a.sft_coef, a.sft_batch, ctx.tokenizer.pad_id, ctx.cfg.seed)
    return Target(NAME, row=loss.row, trains=loss)


class Supervised:
    """The demonstrations and where this step's draws are (module docstring)."""

    def __init__(self, demos: list[Demonstration], coef: float, batch: int, pad_id: int, seed: int):
        self.demos, self.coef, self.batch, self.pad_id, self.seed = (
            demos,
            coef,
            batch,
            pad_id,
            seed,
        )
        self._at = (None, 0)  # (the batch trained, its micro-batches so far)
        self._nll: list = []  # this step's (negative log-likelihood sum, tokens), on device

    def _draw(self, b: int) -> list[Demonstration]:
        batch, k = self._at
        k = k if batch == b else 0
        self._at = (b, k + 1)
        rng = np.random.default_rng([self.seed, b + 1, k])  # b = -1: a precompile run
        return [self.demos[int(i)] for i in rng.integers(0, len(self.demos), self.batch)]

    def _placed(self, chosen: list[Demonstration], micro: Micro) -> TrainBatch:
        t, rows = micro.trainer, micro.rows
        per = len(chosen) // rows.count  # several training processes: this one's slice
        chosen = chosen[rows.index * per : (rows.index + 1) * per]
        host = make_batch(
            [d.prompt for d in chosen],
            [d.response for d in chosen],
            behaviour_logp=[np.zeros(len(d.response), np.float32) for d in chosen],
            advantages=np.full(len(chosen), self.coef, np.float32),
            policy_masks=[d.policy_mask for d in chosen],
            pad_id=self.pad_id,
            **t.cfg.layout,
        )
        dev = t.place_batch(rows.agree(host))
        logp = t.logprobs(micro.state.params, dev)  # ratio 1: the NLL gradient
        if micro.batch >= 0:
            # The sum is over the global batch (every process computes it: one program),
            # counted by the first process; each counts its own tokens (the row sums both
            # over the processes).
            nll = -(logp * dev.loss_mask).sum()
            self._nll.append((nll if rows.index == 0 else 0.0, int(host.loss_mask.sum())))
        return dev.replace(old_logp=logp, behaviour_logp=logp)

    def init_accumulators(self) -> Accumulators:
        return {}

    def accumulate(self, dev: TrainBatch, accs: Accumulators, micro: Micro) -> Accumulators:
        del dev
        sft = self._placed(self._draw(micro.batch), micro)
        acc, _ = micro.trainer.accumulate(micro.state, accs[POLICY], sft, micro.one)
        return accs | {POLICY: acc}

    def apply(self, accs: Accumulators) -> tuple[Accumulators, Metrics]:
        return accs, {}  # its gradients went into the policy's step

    def arrays(self) -> dict:
        return {}

    def restore(self, arrays: dict) -> None:
        del arrays

    def row(self, totals: Totals, reduce: Reduce) -> dict[str, float]:
        del totals
        nll, n = reduce([float(sum(x for x, _ in self._nll)), float(sum(t for _, t in self._nll))])
        self._nll = []
        return {"sft_nll": nll / n if n else float("nan")}
