"""Fault drill: SIGKILL the quickstart `:tiny` run K times at random points, resume each time.

  python tools/fault_drill.py --kills=10             # ~10 min on 2 cores
  python tools/fault_drill.py --kills=3 --steps=15   # a shorter drill
  python tools/fault_drill.py --processes --kills=10 # across processes (1 gen + 1 train)
  python tools/fault_drill.py --processes --num_processes=3 --generation_processes=2 \
      --set=pipeline.rollout=dynamic_sampling --set=generation.max_new_tokens=1

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

With `--processes` the job is a multi-controller run: `launch/local.py -n N -g G`
(default 1 generation + 1 training process) of `python -m streamrl_jax.launch` with
the same settings (`data.reward=vowels`, `log.final_params`), its children's pids
in `--pids_file`. Each kill SIGKILLs one process chosen at random (generation or
training, `victim` in the leg's record) at the same random moments;
`launch/local.py` then stops the others (SIGTERM: the trainer saves its last step
boundary if it is still alive) and the next leg relaunches the whole program,
which resumes from the newest checkpoint (a lost training process ends the run;
with one generation process its loss does too: docs/multicontroller.md). The
reference is the same multi-process command, uninterrupted.

With `--processes --generation_only` (G >= 2, e.g. `--num_processes=3
--generation_processes=2`) only generation processes are killed, and the run is one
leg: `launch/local.py --restart_generation K` starts each victim again and it rejoins
(docs/multicontroller.md, "Losing a process"). Each kill waits until the previous
victim has rejoined (the trainer's `rejoined` line) and the run has trained another
step, then a uniform random delay in [0, --max_delay]; the run must then finish by
itself with the uninterrupted run's parameters, every prompt once.

Last line: JSON with `kills`, `resumed_ok`, `prompts_exactly_once`, `params_match`.
"""

from __future__ import annotations

import collections
import contextlib
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
    "steps", 120, "Training steps of the drilled run (enough that K kills land before the end)."
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
_PROCESSES = flags.DEFINE_bool(
    "processes", False, "Drill a multi-controller run (launch/local.py), killing one process."
)
_NUM = flags.DEFINE_integer("num_processes", 2, "--processes: processes in the program.")
_GEN = flags.DEFINE_integer("generation_processes", 1, "--processes: generation processes.")
_GEN_ONLY = flags.DEFINE_bool(
    "generation_only",
    False,
    "--processes: kill only generation processes; the launcher restarts them and they rejoin.",
)

_SET = flags.DEFINE_multi_string(
    "set",
    [],
    "A config override SECTION.FIELD=VALUE for the drilled and the reference run alike, "
    "e.g. --set=pipeline.rollout=dynamic_sampling --set=generation.max_new_tokens=1.",
)

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
    for dotted, text in _overrides().items():
        section, field = dotted.split(".")
        old = cd[section][field]
        value = text.lower() in ("1", "true") if isinstance(old, bool) else type(old)(text)
        cd[section][field] = value
    return config_lib.from_config_dict(cd)


def _overrides() -> dict[str, str]:
    """`--set`'s overrides, by SECTION.FIELD (ValueError naming a malformed one)."""
    out = {}
    for item in _SET.value:
        dotted, eq, value = item.partition("=")
        if not eq or dotted.count(".") != 1:
            raise ValueError(f"--set={item!r}: expected SECTION.FIELD=VALUE")
        out[dotted] = value
    return out


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


def _launch_cmd(workdir: str) -> list[str]:
    """--processes: the multi-controller job, the same settings as `_config`."""
    settings = {
        "pipeline.mode": "stream_async",
        "pipeline.steps": _STEPS.value,
        "pipeline.deterministic": True,
        "checkpoint.every": 1,
        "checkpoint.keep": 2,
        "eval.num_problems": 0,
        "log.tensorboard": False,
        "log.trace": False,
        "log.final_params": True,
        "data.reward": "vowels",
        **_overrides(),
    }
    return [
        *[sys.executable, os.path.join(_ROOT, "launch", "local.py")],
        *["-n", str(_NUM.value), "-g", str(_GEN.value), "--pids_file", workdir + ".pids"],
        *(["--restart_generation", str(_KILLS.value)] if _GEN_ONLY.value else []),
        *["--", sys.executable, "-m", "streamrl_jax.launch"],
        f"--config={os.path.join(_ROOT, 'configs', 'quickstart.py')}:tiny",
        f"--workdir={workdir}",
        *[f"--config.{k}={v}" for k, v in settings.items()],
    ]


def _start(workdir: str, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--child={workdir}",
        f"--steps={_STEPS.value}",
        *[f"--set={item}" for item in _SET.value],
    ]
    if _PROCESSES.value:
        with contextlib.suppress(FileNotFoundError):
            os.remove(workdir + ".pids")
        cmd = _launch_cmd(workdir)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT)


def _kill(proc: subprocess.Popen, workdir: str, rng: random.Random) -> str:
    """SIGKILLs the job: the child itself, or (--processes) one of the launcher's
    children at random (its process group); returns which."""
    if not _PROCESSES.value:
        proc.send_signal(signal.SIGKILL)
        return "job"
    deadline = time.monotonic() + 60
    while not os.path.exists(workdir + ".pids"):  # written once every child started
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"launcher exited (rc {proc.returncode}) without {workdir}.pids")
        time.sleep(0.05)
    with open(workdir + ".pids", encoding="utf-8") as f:
        pids = json.load(f)
    i = rng.choice(sorted(pids, key=int))
    pid, role = pids[i]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return f"p{i} {role}"


def _trained_steps(workdir: str) -> int:
    from streamrl_jax.pipeline.resume import CONSUMED

    path = os.path.join(workdir, CONSUMED)
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.endswith("\n"))


def _wait_and_kill(
    proc: subprocess.Popen, workdir: str, kind: str, delay: float | None, rng: random.Random
) -> tuple[int, str | None]:
    """Waits for `proc`; SIGKILLs it (or one of its processes) `delay` s after start
    ("start-up") or after its first trained step ("running"); returns its exit code and
    the victim (None when it ended by itself)."""
    if kind == "to the end":
        return proc.wait(), None
    start, steps0, armed = time.monotonic(), _trained_steps(workdir), None
    if kind == "start-up":
        armed = start
    while proc.poll() is None:
        now = time.monotonic()
        if armed is None and _trained_steps(workdir) > steps0:
            armed = now
        if armed is not None and now - armed >= delay:
            victim = _kill(proc, workdir, rng)
            try:  # the launcher stops the others (SIGTERM, then SIGKILL after 3 s)
                return proc.wait(timeout=120), victim
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the job did not end within 120 s of killing {victim}") from None
        time.sleep(0.1)
    return proc.returncode, None


def _generation_leg(proc, workdir: str, log_path: str, rng: random.Random) -> tuple[int, list]:
    """--generation_only: SIGKILLs a random generation process `--kills` times in one leg
    (each once the previous victim rejoined and a step more was trained), then waits
    for the run to end; returns its exit code and the kills."""
    kills = []
    while len(kills) < _KILLS.value:
        deadline = time.monotonic() + 300
        steps0 = _trained_steps(workdir)
        while True:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                rejoined = f.read().count(" rejoined (roster epoch ")
            if rejoined >= len(kills) and _trained_steps(workdir) > steps0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the run ended or stalled before kill {len(kills) + 1}")
            time.sleep(0.1)
        delay = rng.uniform(0, _MAX.value)
        time.sleep(delay)
        with open(workdir + ".pids", encoding="utf-8") as f:
            pids = json.load(f)
        i = rng.choice(sorted((i for i in pids if pids[i][1] == "gen"), key=int))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pids[i][0], signal.SIGKILL)
        kills.append({"victim": f"p{i} gen", "delay_s": round(delay, 2), "at": time.time()})
        print(f"kill {len(kills)}: {kills[-1]}", file=sys.stderr, flush=True)
    return proc.wait(timeout=600), kills


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
        return {k: f[k] for k in f.files}


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
    if _GEN_ONLY.value:
        if not _PROCESSES.value or _GEN.value < 2:
            raise SystemExit("--generation_only needs --processes and --generation_processes >= 2")
        log_path = os.path.join(root, "leg0.log")
        with open(log_path, "w") as log:
            rc, done = _generation_leg(_start(drill_dir, log), drill_dir, log_path, rng)
        kills = len(done)
        legs.append({"kill": "generation only", "kills": done, "rc": rc})
        if rc != 0:
            raise SystemExit(f"the run failed (rc {rc}); see {log_path}")
    while not _GEN_ONLY.value:
        before = _latest_checkpoint(drill_dir)
        with open(os.path.join(root, f"leg{len(legs)}.log"), "w") as log:
            proc = _start(drill_dir, log)
            delay, kind = None, "to the end"
            if kills < _KILLS.value:
                kind = "start-up" if kills % _STARTUP.value == _STARTUP.value - 1 else "running"
                delay = rng.uniform(1.0, 10.0) if kind == "start-up" else rng.uniform(0, _MAX.value)
            rc, victim = _wait_and_kill(proc, drill_dir, kind, delay, rng)
            if victim is not None:
                kills += 1
        after = _latest_checkpoint(drill_dir)
        # Killed: the job's exit code is the victim's (-9; the launcher's 137), or a
        # survivor's that failed first; either way the next leg must resume.
        ok = rc == 0 or victim is not None
        if before is not None and ok:
            resumed_ok += 1
        legs.append(
            {
                "kill": kind,
                "victim": victim,
                "delay_s": delay,
                "rc": rc,
                "checkpoint_before": before,
                "after": after,
            }
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
    params_match = sorted(mine) == sorted(ref) and all(np.array_equal(mine[k], ref[k]) for k in ref)
    out = {
        "tool": "fault_drill",
        "processes": _NUM.value if _PROCESSES.value else 1,
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
