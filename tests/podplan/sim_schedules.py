"""Test support of the pod planner's simulator tests: one simulated instance's schedule.

The simulator tests import what they share from here, never from another test file.
"""

from __future__ import annotations

import numpy as np

from streamrl_podplan.simulation import pipeline as sim_pipeline
from streamrl_podplan.simulation.profiles import MeasuredCosts, TableDecode

G_STEP, L, N = 0.01, 100, 8  # one instance, N samples of L tokens: generation takes L * G_STEP
TRAIN_PER_TOKEN, OPT, SYNC, SWITCH = 1e-3, 0.05, 0.2, (0.1, 0.3)


def sim_costs() -> MeasuredCosts:
    """Costs of one simulated instance with N slots at G_STEP s a decode step, and the
    trainer's, sync's and role switch's constants above."""
    return MeasuredCosts(
        decode=TableDecode(batch_sizes=np.array([1.0]), per_token_s=np.array([G_STEP])),
        slots=N,
        train_s_per_token=TRAIN_PER_TOKEN,
        optimizer_s=OPT,
        min_tokens=0,
        sync_s=SYNC,
        switch=SWITCH,
    )


def run_sim_schedule(
    mode: str, resp: np.ndarray | None = None, iterations: int = 4, warmup: int = 1
) -> sim_pipeline.SimResult:
    """Simulates `mode` on one generation and one training device, `iterations`
    batches of the response lengths `resp` (default N samples of L tokens), one plan."""
    resp = np.full(N, L) if resp is None else resp
    prompt = np.zeros(len(resp), dtype=np.int64)
    batches = [(prompt, resp)] * iterations
    plans = [[list(range(len(resp)))]] * iterations
    return sim_pipeline.run_schedule(
        mode=mode, costs=sim_costs(), batches=batches, plans=plans, gen_devices=1,
        train_devices=1, tp=1, warmup=warmup,
    )  # fmt: skip
