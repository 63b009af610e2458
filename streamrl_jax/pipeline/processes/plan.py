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
reports each closure to the trainer (`rollouts/partial.py`, `generation.py`).

What does not run across processes yet (colocated mode, dynamic sampling, the
curriculum; partial
rollout with more than one generation or training process, or with checkpoints;
training processes that cannot split every micro-batch equally; elastic generation
that leaves no generation process active) is refused at start-up, on every process,
by `config.check` (`config/rules.py`). Elastic generation (`scheduling.elastic_reserved`)
counts reserved generation processes (`roster.py`). A lost generation process is
left behind while another is alive, and a restarted one rejoins (`roster.py`).
Checkpoints are written by the training processes (orbax's active set,
`checkpoint/manager.py`); the generation processes learn where a resumed run starts
under `START_KEY`.
"""

from __future__ import annotations

from streamrl_jax.config import ExperimentConfig

SAMPLES_KEY, WEIGHTS_KEY, RUN_END_KEY = "samples", "weights", "run_end"
START_KEY = "start"  # JSON: the first batch; a resumed run's prompt state and in-flight ids
RANKER_KEY = "ranker"  # the trainer's ranker channel (online refresh -> dispatchers)
IN_FLIGHT = 8  # samples being scored or waiting for stream room, over all producers
CLOSE_TIMEOUT_S = 10.0


def ranker_online(cfg: ExperimentConfig) -> bool:
    """The run refreshes a ranker online (`LiveScheduler.online`): across processes the
    trainer refreshes it and sends its parameters to the generation processes."""
    s = cfg.scheduling
    return s.ranker_online and (s.dispatch == "skew_aware" or bool(s.ranker_path))
