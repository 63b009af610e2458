"""`simulation.compiled.CompiledCosts`: the simulator's stages rescaled by compiled costs.

Fed the roofline's own FLOPs and bytes at the compiled point it must predict what the
roofline predicts; fed a decode step that reads its cache twice over (what XLA:TPU's
copy of a cache it cannot update in place costs), generation must take longer and
training not.
"""

import dataclasses

import numpy as np
import pytest

from streamrl_jax.scheduling import lengths
from streamrl_podplan.simulation import compiled, cost_model, hardware, simulator, stages
from streamrl_podplan.simulation.cost_model import CostParams
from streamrl_podplan.simulation.scenario import Scenario

MODEL = hardware.get_model("qwen2.5-7b")
HW = hardware.get_hardware("tpu_v5p")
PARAMS = CostParams()
TP, SLOTS, MAX_LEN, PROMPT, PREFILL, TRAIN, ROWS, SEQ = 2, 64, 8192, 512, 8, 16, 16, 4096


def _roofline_point() -> compiled.Compiled:
    """Per-device FLOPs and bytes the roofline itself assumes at the compiled point."""
    m, ctx = MODEL, SLOTS * MAX_LEN
    attn = 4.0 * m.layers * m.n_heads * m.head_dim * ctx
    prefill = PREFILL * m.forward_flops(PROMPT, PROMPT / 2.0)
    return compiled.Compiled(
        decode_flops=(2.0 * m.matmul_params * SLOTS + attn) / TP,
        decode_bytes=(m.weight_bytes + m.kv_bytes_per_token * ctx) / TP,
        prefill_flops=prefill / TP,
        prefill_bytes=0.0,
        train_flops=3.0 * m.forward_flops(SEQ, SEQ / 2.0) * ROWS / TRAIN,
        train_bytes=0.0,
        apply_bytes=1e9,
        instance_tp=TP, slots=SLOTS, max_len=MAX_LEN, prefill_batch=PREFILL,
        max_prompt=PROMPT, train_devices=TRAIN, rows=ROWS, seq=SEQ,
    )  # fmt: skip


def _base() -> stages.RooflineCosts:
    return stages.RooflineCosts(MODEL, HW, TP, SLOTS, "grpo", PARAMS)


def _simulate(costs) -> float:
    scenario = Scenario(
        mode="stream_async", model=MODEL, hw=HW, devices=64, trace=lengths.paper_trace(7680),
        global_batch=256, algorithm="grpo", gen_tp=TP, max_batch=SLOTS, iterations=3,
        warmup=1,
    )  # fmt: skip
    return simulator.simulate(scenario, costs)


def test_the_roofline_own_costs_predict_what_the_roofline_does():
    costs = compiled.CompiledCosts.from_compiled(_base(), _roofline_point())
    assert costs.decode_scale == pytest.approx(1.0, rel=1e-9)
    assert costs.prefill_scale == pytest.approx(1.0, rel=1e-9)
    assert costs.train_scale == pytest.approx(1.0, rel=1e-9)
    a, b = _simulate(costs), _simulate(_base())
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-6)
    assert a.gen_devices == b.gen_devices


def test_a_decode_step_that_reads_more_is_slower_and_training_is_not():
    point = _roofline_point()
    slow = dataclasses.replace(point, decode_bytes=3 * point.decode_bytes)
    fast, costly = (compiled.CompiledCosts.from_compiled(_base(), p) for p in (point, slow))
    assert costly.decode_scale > 2.0  # memory bound: three reads of what the roofline reads
    spec_a, spec_b = fast.instance(), costly.instance()
    assert spec_b.cost.segment_time(SLOTS, 1e5, 100) > 2 * spec_a.cost.segment_time(SLOTS, 1e5, 100)
    assert costly.train_seconds(*_lens(), TRAIN) == pytest.approx(
        fast.train_seconds(*_lens(), TRAIN)
    )
    assert _simulate(costly).iteration_s > _simulate(fast).iteration_s


def test_training_not_analysed_keeps_the_roofline_training_time():
    # plan_pod --train_cost=roofline: generation compiled and analysed, training not.
    point = dataclasses.replace(_roofline_point(), decode_bytes=3 * _roofline_point().decode_bytes)
    unanalysed = dataclasses.replace(point, train_flops=0.0, train_bytes=0.0)
    costs = compiled.CompiledCosts.from_compiled(_base(), unanalysed)
    assert costs.train_scale == 1.0 and costs.decode_scale > 2.0
    assert costs.train_seconds(*_lens(), TRAIN) == pytest.approx(
        _base().train_seconds(*_lens(), TRAIN)
    )


def test_a_mismatched_instance_is_refused():
    base = dataclasses.replace(_base(), slots=SLOTS * 2)
    with pytest.raises(ValueError, match="not the compiled one"):
        compiled.CompiledCosts.from_compiled(base, _roofline_point())


def _lens():
    return np.array([512.0, 512.0]), np.array([1000.0, 4000.0])


def test_training_fits_from_the_compiled_mesh_up():
    costs = compiled.CompiledCosts.from_compiled(_base(), _roofline_point())
    assert costs.train_fits(TRAIN) and costs.train_fits(2 * TRAIN) and not costs.train_fits(8)
    assert costs.optimizer_seconds(2 * TRAIN) == pytest.approx(costs.optimizer_seconds(TRAIN) / 2)
    assert cost_model.FLOP_FACTORS["grpo"] == 5.0  # the 3-forward accumulate scales 5 forwards


def test_simulate_cli_takes_a_plans_compiled_costs(tmp_path):
    # streamrl_podplan.simulate --compiled=<a plan's output>: the roofline's own costs predict
    # the roofline's step; three times the decode bytes a slower one.
    import json
    import os
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[2]

    def run(*flags):
        cmd = [sys.executable, "-m", "streamrl_podplan.simulate", "--mode=stream_async",
               "--model=qwen2.5-7b", "--hardware=tpu_v5p", "--devices=64", "--max_len=7680",
               "--global_batch=256", "--iterations=3", "--warmup=1", "--algorithm=grpo",
               *flags]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(repo))
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=repo, env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])["stream_async"]["iteration_s"]

    def plan(point):
        path = tmp_path / f"plan{point.decode_bytes}.json"
        chosen = {"compiled": dataclasses.asdict(point)}
        path.write_text("== a search\n" + json.dumps({"settings": [{"chosen": chosen}]}) + "\n")
        return f"--compiled={path}"

    point = _roofline_point()
    roofline = run(f"--gen_tp={TP}", f"--max_batch={SLOTS}")
    assert run(plan(point)) == pytest.approx(roofline, rel=1e-6)
    assert run(plan(dataclasses.replace(point, decode_bytes=3 * point.decode_bytes))) > roofline
