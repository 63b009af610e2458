"""Device check of the pod plans (issue 40), for a session lent one accelerator: about ten
minutes on one GPU (or TPU chip).

    python -m streamrl_podplan.device_check [--model=qwen3_0.6b_shape] [--benches]

1. The plan's executables (`programs.py`: the trainer's `accumulate` and `apply`, the
   engine's `prefill` and decode chunk) on this one device, each in a fresh process: the
   plan's prediction (`need`: the compiler's peak plus the inputs jit does not read) against
   the device's own count (`memory_stats()["peak_bytes_in_use"]` of the process after one
   call on zeros, every slot active). The compile is the one the plan
   reads, on the real device instead of a compile-only one.
2. With `--benches`: `tools/bench_generation.py --quick` and `tools/bench_model.py --quick`
   at the same shape (decode against its roofline, the trainer against the matmul peak).

Each line of step 1 prints as it comes; the last line is JSON. On a CPU (no
`memory_stats`) step 1 reports the prediction alone, which is how this script is tested
before an accelerator is at hand (`--model=tiny`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string(
    "model", "qwen3_0.6b_shape", "A shape, tiny, or an HF config.json (`shapes.model_config`)."
)
_ROWS = flags.DEFINE_integer("rows", 4, "Training micro-batch rows.")
_SEQ = flags.DEFINE_integer("seq", 2048, "Training micro-batch columns.")
_SLOTS = flags.DEFINE_integer("slots", 64, "KV slots of the generation instance.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "KV cache length.")
_BENCHES = flags.DEFINE_bool("benches", False, "Also run the engine and trainer benchmarks.")
_ONE = flags.DEFINE_string("one", None, "Internal: run this one executable and print JSON.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 240, "Per child process.")

PROGRAMS = ("accumulate", "apply", "prefill", "decode_chunk")
# The repository root (the benches are its tools/ scripts).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _knobs():
    from streamrl_podplan.programs import Knobs

    return Knobs(
        model=_MODEL.value, rows=_ROWS.value, seq=_SEQ.value, slots=_SLOTS.value,
        max_len=_MAX_LEN.value, max_prompt=min(512, _MAX_LEN.value // 2),
    )  # fmt: skip


def _materialize(tree):
    """Zeros for every abstract leaf, placed by its sharding (PRNG keys from zeros too)."""
    import jax
    import jax.numpy as jnp

    def leaf(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jnp.zeros((*x.shape, 2), jnp.uint32)
            return jax.device_put(jax.random.wrap_key_data(data), x.sharding)
        return jax.device_put(jnp.zeros(x.shape, x.dtype), x.sharding)

    return jax.tree.map(leaf, tree)


def _run_one(name: str) -> dict:
    """One executable on this process's first device: predicted and measured peak."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from streamrl_podplan import programs as programs_lib
    from streamrl_podplan import reports

    device = jax.devices()[0]
    devices = np.array([device])
    k = _knobs()
    training = name in ("accumulate", "apply")
    build = programs_lib.training_programs if training else programs_lib.generation_programs
    programs = build(k, devices)
    program = next(p for p in programs if p.name == name)
    hbm = (device.memory_stats() or {}).get("bytes_limit", 0) / programs_lib.GIB
    predicted = reports.plan_programs([program], hbm or float("inf"))[0]
    args = _materialize(program.args)
    if not training:  # every slot decoding: the loop runs (an all-free state would not)
        state = args[1]
        state = state.replace(
            active=jnp.ones_like(state.active), limit=jnp.full_like(state.limit, 1 << 20)
        )
        args = (args[0], state, *args[2:])
    # A fresh process: its peak is every input (read or not) plus the call's temporaries,
    # what the plan's `need` counts.
    jax.block_until_ready(program.fn(*args, **program.kwargs))
    stats = device.memory_stats()
    measured = stats["peak_bytes_in_use"] if stats else None
    return {
        "executable": name,
        "device": device.device_kind,
        "predicted_need_bytes": predicted.get("need_bytes"),
        "predicted_peak_bytes": predicted.get("peak_bytes"),
        "measured_peak_bytes": measured,
        "measured_over_predicted": (
            round(measured / predicted["need_bytes"], 3)
            if measured and predicted.get("need_bytes")
            else None
        ),
    }


def _child(name: str) -> dict:
    cmd = [sys.executable, "-m", "streamrl_podplan.device_check", f"--one={name}"]
    cmd += [f"--{f}={v.value}" for f, v in (("model", _MODEL), ("rows", _ROWS), ("seq", _SEQ),
                                            ("slots", _SLOTS), ("max_len", _MAX_LEN))]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT.value, env=env)
    except subprocess.TimeoutExpired:
        return {"executable": name, "error": f"no result within {_TIMEOUT.value} s"}
    last = run.stdout.strip().splitlines()[-1:] or [""]
    try:
        return json.loads(last[0])
    except json.JSONDecodeError:
        return {"executable": name, "error": f"exit {run.returncode}: {run.stderr[-400:]}"}


def _bench(cmd: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=REPO)
    tail = run.stdout.strip().splitlines()[-1:] or [""]
    try:
        out = json.loads(tail[0])
    except json.JSONDecodeError:
        out = {"error": f"exit {run.returncode}: {run.stderr[-400:]}"}
    return {"cmd": " ".join(cmd[1:]), "wall_s": round(time.perf_counter() - t0, 1), "result": out}


def main(argv) -> None:
    del argv
    if _ONE.value:
        print(json.dumps(_run_one(_ONE.value)))
        return
    t0 = time.perf_counter()
    rows = []
    for name in PROGRAMS:
        rows.append(_child(name))
        print(json.dumps(rows[-1]), flush=True)
    benches = []
    if _BENCHES.value:
        shape = _MODEL.value
        benches.append(_bench([sys.executable, "tools/bench_generation.py", "--quick",
                               f"--models={shape}", "--hf=false", "--makespan=false"]))  # fmt: skip
        benches.append(_bench([sys.executable, "tools/bench_model.py", "--quick",
                               f"--model={shape}"]))  # fmt: skip
    wall = round(time.perf_counter() - t0, 1)
    print(json.dumps({"check": "streamrl_podplan.device_check", "model": _MODEL.value,
                      "plans": rows, "benches": benches, "wall_s": wall}))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
