"""Algorithm 1 over the stream's three stages at run time (docs/reward_models.md, "How
many devices should score").

With a judge on devices of its own (`judge.placement="scoring"`: the training process's
scoring mesh, or scoring processes), every step's row gets the split of the run's
devices that would balance generation, scoring and training
(`balance.rebalance_three_stages` on the step's measured seconds), its predicted step
and the measured slowest stage; a split that differs from the run's is logged once. A
run without a judge, or with the generation service's tenant (no devices of its own),
reports nothing.
"""

from __future__ import annotations

from typing import Any

from absl import logging

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.distributed.judge_channel import RemoteJudge
from streamrl_jax.scheduling import balance


class ThreeStages:
    """A run's stage sizes and units, and the figures of each step (module docstring)."""

    def __init__(
        self, sizes: tuple[int, int, int], units: tuple[int, int, int], sets: int, trainers: int
    ):
        """`sizes`/`units`: generation, scoring and training devices and their units (an
        instance, a judge's mesh, a device); `sets`: the judge's device sets; `trainers`:
        the training processes (each stage timed its own forwards)."""
        self.sizes, self.units, self.sets, self.trainers = sizes, units, sets, trainers
        self._said: tuple[int, int, int] | None = None  # the last split logged

    def figures(self, row: dict[str, float], t_gen: float, t_train: float) -> dict[str, float]:
        """Step figures from its generation span, training seconds and the stage's judge
        seconds (`row["judge/busy_s"]`); {} for a step without all three."""
        busy = row.get("judge/busy_s", 0.0)
        if min(t_gen, t_train, busy) <= 0:
            return {}
        # The judge's device sets serve the training processes' stages side by side.
        t_score = busy * self.trainers / self.sets
        split = balance.rebalance_three_stages(self.sizes, (t_gen, t_score, t_train), self.units)
        found = (split.gen_devices, split.score_devices, split.train_devices)
        if found != self.sizes and found != self._said:
            logging.info(
                "three stages: generation %.1f s on %d devices, scoring %.1f s on %d, "
                "training %.1f s on %d; balanced on %d / %d / %d (%s-bound): %.1f s a step",
                t_gen, self.sizes[0], t_score, self.sizes[1], t_train, self.sizes[2], *found,
                split.bottleneck, split.step_time,
            )  # fmt: skip
        self._said = found
        return {
            "balance/gen_devices": float(split.gen_devices),
            "balance/score_devices": float(split.score_devices),
            "balance/train_devices": float(split.train_devices),
            "balance/step_s": split.step_time,
            "balance/now_s": max(t_gen, t_score, t_train),
        }


class _Nothing:
    """A run without a judge on devices of its own: no figures."""

    def figures(self, row: dict[str, float], t_gen: float, t_train: float) -> dict[str, float]:
        del row, t_gen, t_train
        return {}


def of(
    cfg: ExperimentConfig, judge: Any, generation_processes: int, trainers: int
) -> ThreeStages | _Nothing:
    """The run's three stages (`judge`: its scorer, None without one; across processes,
    `generation_processes` and `trainers` processes)."""
    if judge is None or cfg.judge.placement != "scoring":
        return _Nothing()
    m = cfg.mesh
    # One judge per training process, or the scoring processes' (shared by all).
    sets = judge.parallel if isinstance(judge, RemoteJudge) else trainers
    sizes = (
        m.generate_devices * max(generation_processes, 1),
        cfg.judge.devices * sets,
        m.train_devices * trainers,
    )
    units = (m.generate_devices // len(m.instance_slots), cfg.judge.devices, 1)
    return ThreeStages(sizes, units, sets, trainers)
