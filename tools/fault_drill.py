"""Fault drill: SIGKILL the quickstart `:tiny` run K times at random points, resume each time.

  python tools/fault_drill.py --kills=10             # ~10 min on 2 cores
  python tools/fault_drill.py --kills=3 --steps=15   # a shorter drill

The run is `configs/quickstart.py:tiny` in stream_async, deterministic mode, a
checkpoint every step. A random tiny model never earns the task's reward, so
the run scores a dense stand-in (the fraction of vowels in the response, as the
pipeline tests do); otherwise every advantage is 0 and the parameters would
trivially match.

1. A reference child runs the whole job uninterrupted and writes its final
   parameters.
2. The drill child is started in a fresh workdir and killed with SIGKILL, then
   started again on the same workdir, K times; then it runs to the end. A
   every `--startup_every`-th kill lands at a random time in the first seconds
   (import, restore, compilation); the others wait until the leg has trained a
   step (so it is mid-generation, mid-accumulation or mid-checkpoint-write) and
   then a uniform random delay in [0, --max_delay] seconds.
3. Checks: every start after the first resumed from the newest complete
   checkpoint and exited only by our SIGKILL (or 0 at the end); consumed.jsonl
   lists steps 0..S-1 once each and every prompt as often as the reference
   (exactly once per epoch); the final parameters equal the reference's bit for
   bit.

Last line: JSON with `kills`, `resumed_ok`, `prompts_exactly_once`, `params_match`.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags

_KILLS = flags.DEFINE_integer("kills", 10, "SIGKILLs before the run may finish.")
_STEPS = flags.DEFINE_integer(
    "steps", 60, "Training steps of the drilled run (enough that K kills land before the end)."
)
_MAX = flags.DEFINE_float(
    "max_delay", 5.0, "A running leg is killed uniformly within this many seconds (s)."
)
_STARTUP = flags.DEFINE_integer(
    "startup_every", 4, "Every N-th kill is aimed at start-up (import, restore, compile)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the kill times.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/fault_drill", "Drill directory (wiped).")
_CHILD = flags.DEFINE_string("child", "", "Internal: run the job in this workdir.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PARAMS = "final_params.npz"


def _config(steps: int):
    import importlib.util

    from streamrl_jax import config as config_lib

    spec = importlib.util.spec_from_file_location(
        "quickstart", os.path.join(_ROOT, "configs", "quickstart.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config("tiny").to_dict()
    cd["pipeline"].update(mode="stream_async", steps=steps, deterministic=True)
    cd["checkpoint"].update(every=1, keep=2)
    cd["eval"]["num_problems"] = 0
    cd["log"].update(tensorboard=False, trace=False)
    return config_lib.from_config_dict(cd)


def vowel_reward(text, metadata):
    from streamrl_jax.rewards.base import RewardResult

    score = sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1)
    return RewardResult(score=score, correct=score > 0.5, extracted_answer=None, format_ok=True)


def _child(workdir: str, steps: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np

    from streamrl_jax import pipeline as run_lib

    result = run_lib.run(_config(steps), workdir, reward_fn=vowel_reward)
    leaves = jax.device_get(jax.tree.leaves(result.state.params))
    np.savez(os.path.join(workdir, _PARAMS), *[np.asarray(x) for x in leaves])


def _start(workdir: str, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--child={workdir}",
        f"--steps={_STEPS.value}",
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT)


def _trained_steps(workdir: str) -> int:
    from streamrl_jax.pipeline.resume import CONSUMED

    path = os.path.join(workdir, CONSUMED)
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.endswith("\n"))


def _wait_and_kill(proc: subprocess.Popen, workdir: str, kind: str, delay: float | None) -> int:
    """Waits for `proc`; SIGKILLs it `delay` s after start ("start-up") or after its
    first trained step ("running"); returns its exit code."""
    if kind == "to the end":
        return proc.wait()
    start, steps0, armed = time.monotonic(), _trained_steps(workdir), None
    if kind == "start-up":
        armed = start
    while proc.poll() is None:
        now = time.monotonic()
        if armed is None and _trained_steps(workdir) > steps0:
            armed = now
        if armed is not None and now - armed >= delay:
            proc.send_signal(signal.SIGKILL)
            return proc.wait()
        time.sleep(0.1)
    return proc.returncode


def _latest_checkpoint(workdir: str) -> int | None:
    d = os.path.join(workdir, "checkpoints")
    steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
    return max(steps, default=None)


def _consumed(workdir: str):
    from streamrl_jax.pipeline.resume import CONSUMED, read_consumed

    rows = read_consumed(os.path.join(workdir, CONSUMED))
    return [r["step"] for r in rows], collections.Counter(p for r in rows for p in r["prompt_ids"])


def _params(workdir: str):
    import numpy as np

    with np.load(os.path.join(workdir, _PARAMS)) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        _child(_CHILD.value, _STEPS.value)
        return
    import numpy as np

    root = _WORKDIR.value
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    ref_dir, drill_dir = os.path.join(root, "reference"), os.path.join(root, "drill")
    t0 = time.time()
    with open(os.path.join(root, "reference.log"), "w") as log:
        rc = _start(ref_dir, log).wait()
    if rc != 0:
        raise SystemExit(f"reference run failed (rc {rc}); see {root}/reference.log")
    print(f"reference: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    rng = random.Random(_SEED.value)
    kills, resumed_ok, legs = 0, 0, []
    while True:
        before = _latest_checkpoint(drill_dir)
        with open(os.path.join(root, f"leg{len(legs)}.log"), "w") as log:
            proc = _start(drill_dir, log)
            delay, kind = None, "to the end"
            if kills < _KILLS.value:
                kind = "start-up" if kills % _STARTUP.value == _STARTUP.value - 1 else "running"
                delay = rng.uniform(1.0, 10.0) if kind == "start-up" else rng.uniform(0, _MAX.value)
            rc = _wait_and_kill(proc, drill_dir, kind, delay)
            if rc == -signal.SIGKILL:
                kills += 1
        after = _latest_checkpoint(drill_dir)
        ok = rc in (0, -signal.SIGKILL)
        if before is not None and ok:
            resumed_ok += 1
        legs.append(
            {"kill": kind, "delay_s": delay, "rc": rc, "checkpoint_before": before, "after": after}
        )
        print(f"leg {len(legs) - 1}: {legs[-1]}", file=sys.stderr, flush=True)
        if not ok:
            raise SystemExit(
                f"leg {len(legs) - 1} failed (rc {rc}); see {root}/leg{len(legs) - 1}.log"
            )
        if rc == 0:
            if kills < _KILLS.value:
                raise SystemExit(
                    f"the run finished after {kills} of {_KILLS.value} kills: raise --steps"
                )
            break

    steps, counts = _consumed(drill_dir)
    ref_steps, ref_counts = _consumed(ref_dir)
    exactly_once = steps == ref_steps == list(range(_STEPS.value)) and counts == ref_counts
    mine, ref = _params(drill_dir), _params(ref_dir)
    params_match = len(mine) == len(ref) and all(
        np.array_equal(a, b) for a, b in zip(mine, ref, strict=True)
    )
    out = {
        "tool": "fault_drill",
        "kills": kills,
        "restarts": len(legs) - 1,
        "resumed_ok": resumed_ok,
        "prompts_exactly_once": bool(exactly_once),
        "params_match": bool(params_match),
        "max_prompt_count": max(counts.values(), default=0),
        "steps": _STEPS.value,
        "legs": legs,
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, _ROOT)
    app.run(main)
