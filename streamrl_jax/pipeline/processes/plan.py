"""How a multi-controller run is laid out: what works across processes, who trains what.

Every process runs the same `python -m streamrl_jax.launch --config=...`;
processes 0 .. G-1 generate, the others train (`distributed/roles.py`). Several
training processes run one SPMD trainer over a mesh of all their devices, each
feeding its own slice of every micro-batch (`shards.py`). Addresses go through
the coordination service under the keys below; no port is configured.

In-flight weight updates, partial rollout (checkpointed too), dynamic sampling, the
curriculum, agents, the supervised target and several learners run across processes as
in one process (docs/multicontroller.md, "The pipeline across processes"). What does not
(colocated mode; training processes that cannot split every micro-batch or demonstration
batch equally; several learners on a number of training processes that is not a multiple
of theirs; elastic generation that leaves no generation process active) is refused at
start-up, on every process, by `config.check` (`config/rules.py`). Elastic generation
(`scheduling.elastic_reserved`) counts reserved generation processes (`roster.py`). A
lost generation process is left behind while another is alive, and a restarted one
rejoins (`roster.py`). Checkpoints are written by the training processes (orbax's
active set, `checkpoint/manager.py`); the generation processes learn where a resumed
run starts under `START_KEY`.
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
