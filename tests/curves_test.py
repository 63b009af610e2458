"""Tests of `streamrl_bench.curves` (shared by tools/bench_vs_trl.py and
tools/bench_recipes.py): a run's config and its evaluation read the overrides as the
launcher does. (The bench scripts themselves define absl flags at import: not imported
here.)"""

from __future__ import annotations

import pathlib

import pytest

from streamrl_bench import curves

QUICKSTART = str(pathlib.Path(curves.ROOT) / "configs" / "quickstart.py")


def test_overrides_are_typed_as_the_launcher_types_them():
    cfg = curves.config_of(
        QUICKSTART,
        [
            "trainer.lora.rank=8",
            "optimizer.learning_rate=2e-4",
            "algorithm.distill_teacher=/tmp/teacher/checkpoints/240",
            "pipeline.rollout=full",
            "eval.at_start=false",
        ],
    )
    assert cfg.trainer.lora.rank == 8 and cfg.optimizer.learning_rate == 2e-4
    assert cfg.algorithm.distill_teacher == "/tmp/teacher/checkpoints/240"
    assert cfg.pipeline.rollout == "full" and cfg.eval.at_start is False
    assert curves.config_of(QUICKSTART) == curves.config_of(f"{QUICKSTART}:async")
    assert curves.config_of(f"{QUICKSTART}:short").pipeline.steps == 20


@pytest.mark.parametrize(
    "override, match",
    [
        ("trainer.lora.rank=eight", "rank"),
        ("pipeline.no_such_field=1", "no_such_field"),
    ],
)
def test_a_bad_override_is_refused_naming_it(override, match):
    with pytest.raises(Exception, match=match):
        curves.config_of(QUICKSTART, [override])


def test_a_run_is_a_name_and_its_overrides():
    assert curves.parse_run("full:") == ("full", [])
    assert curves.parse_run("lora:trainer.lora.rank=8; optimizer.learning_rate=2e-4") == (
        "lora",
        ["trainer.lora.rank=8", "optimizer.learning_rate=2e-4"],
    )
    for bad in ("full", ":x=1", "a b:x=1", "lora:trainer.lora.rank"):
        with pytest.raises(ValueError, match="--run="):
            curves.parse_run(bad)


def test_time_to_is_the_first_time_a_curve_reaches_a_target():
    curve = [(0.0, 0.2), (100.0, 0.4), (200.0, 0.3), (300.0, 0.5)]
    assert curves.time_to(curve, 0.4) == 100.0 and curves.time_to(curve, 0.45) == 300.0
    assert curves.time_to(curve, 0.6) is None
