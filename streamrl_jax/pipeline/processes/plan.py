"""How a multi-controller run is laid out: what works across processes, who trains what.

Every process runs the same `python -m streamrl_jax.launch --config=...`;
processes 0 .. G-1 generate, the others train (`distributed/roles.py`). Several
training processes run one SPMD trainer over a mesh of all their devices, each
feeding its own slice of every micro-batch (`shards.py`). Addresses go through
the coordination service under the keys below; no port is configured.

In-flight weight updates (`pipeline.weight_update="inflight"`) work as in one
process: the generation process's driver hands each version it receives to its
instances at once (they swap at the next chunk boundary), and every sample carries
its per-token versions over the wire (`distributed/wire.py`) to the trainer's
version gate. Partial rollout (`pipeline.partial_budget_tokens`) runs with one
generation and one training process: the rounds run in the generation process, which
reports each closure to the trainer (`round_reports.py`).

Not supported across processes yet (an error at start-up, on every process):
colocated mode; partial rollout with more than one generation or training process, or
with checkpoints (the paused samples a checkpoint must hold live in the generation
process); training processes that cannot split every micro-batch equally. Elastic
generation (`scheduling.elastic_reserved`) counts reserved generation processes
(`roster.py`); it must leave one active. A lost generation process is
left behind while another is alive, and a restarted one rejoins (`roster.py`).
Checkpoints are written by the training processes (orbax's active set,
`checkpoint/manager.py`); the generation processes learn where a resumed run starts
under `START_KEY`.
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.pipeline.rollouts.partial import NO_RESUME
from streamrl_jax.pipeline.shards import ownership

SAMPLES_KEY, WEIGHTS_KEY, RUN_END_KEY = "samples", "weights", "run_end"
START_KEY = "start"  # JSON: the first batch; a resumed run's prompt state and in-flight ids
RANKER_KEY = "ranker"  # the trainer's ranker channel (online refresh -> dispatchers)
IN_FLIGHT = 8  # samples being scored or waiting for stream room, over all producers
CLOSE_TIMEOUT_S = 10.0


def check_supported(
    cfg: ExperimentConfig, num_processes: int | None, generation_processes: int
) -> None:
    """Raises ValueError naming the setting that does not work across processes yet.

    Runs before `jax.distributed.initialize`, on every process, so all of them fail
    the same way at once.
    """
    n = "several processes" if num_processes is None else f"{num_processes} processes"
    if cfg.pipeline.mode == "colocated":
        raise ValueError(
            f"pipeline.mode='colocated' shares one device set between generation and "
            f"training, so it runs in one process; this program has {n} "
            "(STREAMRL_NUM_PROCESSES). Use disaggregated_batch, stream_sync or stream_async, "
            "or run one process."
        )
    partial = cfg.pipeline.partial_budget_tokens
    if partial > 0 and (num_processes != 2 or generation_processes != 1):
        raise ValueError(
            f"pipeline.partial_budget_tokens={partial}: partial rollout across processes "
            f"runs with one generation and one training process; this program has {n}, "
            f"{generation_processes} generating (STREAMRL_NUM_PROCESSES, "
            "STREAMRL_GENERATION_PROCESSES): the paused samples live in their generation "
            "process, which a lost one would take with it, and the round reports go to "
            "one trainer. Use 2 processes (-n 2 -g 1), or set pipeline.partial_budget_tokens=0."
        )
    if partial > 0 and cfg.checkpoint.every > 0:
        raise ValueError(
            f"pipeline.partial_budget_tokens={partial} with checkpoint.every="
            f"{cfg.checkpoint.every}: {NO_RESUME}"
        )
    if num_processes is not None and num_processes - generation_processes > 1:
        try:
            ownership(cfg.pipeline, num_processes - generation_processes)
        except ValueError as e:
            raise ValueError(
                f"STREAMRL_NUM_PROCESSES={num_processes}, STREAMRL_GENERATION_PROCESSES="
                f"{generation_processes}: {e}"
            ) from None
    reserved = cfg.scheduling.elastic_reserved
    if reserved > 0 and reserved >= generation_processes:
        raise ValueError(
            f"scheduling.elastic_reserved={reserved}: across processes it counts reserved "
            f"generation processes, and must leave at least one of the "
            f"{generation_processes} (STREAMRL_GENERATION_PROCESSES) active"
        )


def ranker_online(cfg: ExperimentConfig) -> bool:
    """The run refreshes a ranker online (`LiveScheduler.online`): across processes the
    trainer refreshes it and sends its parameters to the generation processes."""
    s = cfg.scheduling
    return s.ranker_online and (s.dispatch == "skew_aware" or bool(s.ranker_path))
