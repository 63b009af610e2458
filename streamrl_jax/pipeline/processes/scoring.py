"""A scoring process of a multi-controller run: the run's judge, served to the training
processes (docs/reward_models.md, "Scoring processes").

With `STREAMRL_SCORING_PROCESSES=S` (`launch/local.py -s S`) the program's last S
processes score: the stream's third stage gets processes of its own, as generation and
training have (generation -> scoring -> training). A scoring process loads the judge
(`components.make_judge`: `judge.model` on a ("tp",) mesh of its first `judge.devices`
devices, the shape one process gives its judge, so its verdicts are the same bits),
serves it to the training processes (`distributed/judge_channel.JudgeServer`) and
publishes its address under `judge/<k>`. Each training process's scoring stage
(`pipeline/scoring.py`) keeps its queue, order, back-pressure and masks; only its
forwards run here (`judge_channel.RemoteJudge`, round robin over the scoring processes).

**End of a run.** It leaves once the training process publishes the run's outcome
(`run_end`), raising for a failed one. **Failure.** A lost training process (its
channel lost: one that ends closes it in order first) fails this process at once,
naming it; so does no training process connecting within `pipeline.timeout_s`.
**Restarted** (the same command and id: `roles.Roles.rejoined`, e.g. `launch/local.py
--restart_scoring`), it loads the judge again and publishes a new address; the training
processes send it the forwards its predecessor left unanswered (each within
`judge.timeout_s`, or masked and counted), so a run that loses a scoring process for
less than that ends as if it had not.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.distributed import roles
from streamrl_jax.distributed.channel import TransportError
from streamrl_jax.distributed.judge_channel import JudgeServer, publish_address
from streamrl_jax.errors import UserError
from streamrl_jax.pipeline import components as components_lib
from streamrl_jax.pipeline.processes.plan import CLOSE_TIMEOUT_S, RUN_END_KEY


def run_scoring(
    cfg: ExperimentConfig,
    dcfg: roles.DistributedConfig,
    r: roles.Roles,
    board: roles.Board = roles.PROGRAM,
) -> None:
    """Serves the judge until the run ends (module docstring).

    Raises:
      UserError: this process has fewer devices than `judge.devices`.
      RuntimeError: a training process was lost, or the run ended with a failure.
    """
    k = r.scoring_processes.index(r.process_id)
    name = f"scoring-{k}"
    if r.rejoined and (outcome := board.try_lookup(RUN_END_KEY)) is not None:
        logging.warning("%s: the run already ended (%s)", name, outcome)
        return
    mine = [d for d in r.scoring_devices if d.process_index == r.process_id]
    n = cfg.judge.devices
    if len(mine) < n:
        raise UserError(
            f"judge.devices={n}: scoring process {r.process_id} has {len(mine)} device(s)"
        )
    mesh = Mesh(np.asarray(mine[:n], dtype=object), ("tp",), axis_types=(AxisType.Auto,))
    judge = components_lib.make_judge(cfg, mesh)
    lost: list[str] = []
    event = threading.Event()

    def on_lost(peer: str, exc: TransportError) -> None:
        lost.append(f"{peer}: {exc}")
        event.set()

    server = JudgeServer(
        judge,
        f"{roles.advertised_host(dcfg)}:0",
        authkey=dcfg.authkey,
        peers=len(r.training_processes),
        timeout_s=dcfg.peer_timeout_s,
        name=name,
        on_lost=on_lost,
    )
    publish_address(k, server.address, board)
    logging.info(
        "%s: judge %s served at %s:%d%s",
        name,
        cfg.judge.model,
        *server.address,
        " (restarted)" if r.rejoined else "",
    )
    deadline = time.monotonic() + cfg.pipeline.timeout_s
    try:
        outcome = None
        while outcome is None:
            if not server.connected and time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: no training process connected within pipeline.timeout_s="
                    f"{cfg.pipeline.timeout_s:g} s"
                )
            if event.wait(1.0):  # (a training process that ends closes its channel in
                # order first: this is a loss, and the coordination service it may have
                # served is gone with it: no lookup)
                logging.error("lost peer: %s", lost[0])
                raise RuntimeError(f"{name}: lost a training process: {lost[0]}")
            outcome = board.try_lookup(RUN_END_KEY)
    finally:
        server.close(CLOSE_TIMEOUT_S)
    logging.info(
        "%s: %d forwards, %d samples judged; the run ended: %s",
        name,
        server.forwards,
        server.items,
        outcome,
    )
    if outcome not in ("ok", "stopped"):
        raise RuntimeError(f"{name}: the training process ended the run: {outcome}")
