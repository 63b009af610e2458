"""tools/plan_pod.py's planners on this machine's CPU devices (the TPU topology needs
libtpu, an optional install; the planners are the same code for any device kind): every
executable of both roles compiles from abstract inputs placed by the roles' shardings
and reports its memory. (What a remat policy saves shows on a TPU compile, not in
XLA:CPU's memory analysis of these tiny programs: BENCHMARKS.md "Pod plans".)"""

import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import plan_pod  # noqa: E402

KNOBS = plan_pod.Knobs(model="tiny", rows=4, seq=64, slots=4, max_prompt=16, max_len=64,
                       chunk_steps=4, prefill_batch=2, dtype="float32")  # fmt: skip


def test_both_roles_compile_and_report_their_memory_per_device():
    devices = np.array(jax.devices()[:4])
    training = plan_pod.plan_training(KNOBS, devices[:2], hbm=1.0)
    generation = plan_pod.plan_generation(KNOBS, devices[2:3], hbm=1.0)
    assert [r["executable"] for r in training + generation] == [
        "accumulate", "apply", "prefill", "decode_chunk"
    ]  # fmt: skip
    for r in training + generation:
        assert r["fits"] and 0 < r["arguments_bytes"] <= r["peak_bytes"] < 1 << 30, r
