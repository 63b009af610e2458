"""A served checkpoint evaluated by an OpenAI Agents SDK agent, against the same checkpoint
evaluated in-process on the same problems.

  python tools/eval_served.py --config=configs/agent.py:chained \\
      --checkpoint=workdir/agent/checkpoints
  python tools/eval_served.py --config=configs/agent.py:chained_tiny --problems=8
  python tools/eval_served.py --config=configs/agent.py:chained --url=http://127.0.0.1:8000/v1 \\
      --token_file=token.txt --checkpoint=...    # a `serve` already running

Without `--url` it starts `python -m streamrl_jax.serve` itself (the run's config with
its `--config.*` overrides, `--checkpoint`, `--slots`, `--top_logprobs`, a fresh token,
loopback) and stops it when the agent is done. The run's held-out problems
(`data.eval_seed` or `--eval_seed`, `eval.num_problems` or `--problems`) are played
greedily by the agent, `--concurrency` episodes at once (`pipeline/episode_evaluation.py`),
then in-process on an engine holding the same checkpoint with the served engine's
config (`--in_process`). `--deterministic` (default) gives the started server and the
in-process engine one decode shape (`pipeline.deterministic`), so the two agree token
for token (a running server: start it with `--config.pipeline.deterministic=true` and
the same `--slots`). `--dump`: every episode of both (JSONL).

Last line: JSON with both accuracies, the problems whose outcome (correct, return,
turns, tool calls) and whose tokens agree, and each side's wall time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_ROOT, "configs", "agent.py"), "The run's config file[:variant]."
)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "", "A run's checkpoint root or step directory; empty: the config's model."
)
_URL = flags.DEFINE_string("url", "", "A running serve's base URL; empty: start one.")
_TOKEN_FILE = flags.DEFINE_string(
    "token_file", "", "With --url: its bearer token's file (else $STREAMRL_ENDPOINT_TOKEN)."
)
_MODEL = flags.DEFINE_string("served_model", "policy", "The served model's name.")
_PROBLEMS = flags.DEFINE_integer("problems", 0, "Held-out problems (0: eval.num_problems).")
_EVAL_SEED = flags.DEFINE_integer("eval_seed", -1, "The held-out set's seed (<0: the config's).")
_SLOTS = flags.DEFINE_integer("slots", 16, "The served (and in-process) engine's slots.")
_TOP = flags.DEFINE_integer("top_logprobs", 20, "serve --top_logprobs (the engine's).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 0, "Agent episodes at once (0: --slots).")
_DETERMINISTIC = flags.DEFINE_bool(
    "deterministic", True, "One decode shape in the started server and in-process."
)
_IN_PROCESS = flags.DEFINE_bool("in_process", True, "Also evaluate in-process and compare.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 300.0, "Each request's deadline (and the start's).")
_DUMP = flags.DEFINE_string("dump", "", "Write every episode of both evaluations (JSONL).")


def _start_serve(token: str, ready: str) -> subprocess.Popen:
    """`python -m streamrl_jax.serve` with this run's config flags, as given."""
    given = [a for a in sys.argv[1:] if a.startswith("--config")]
    cmd = [sys.executable, "-m", "streamrl_jax.serve", *given, "--port=0",
           f"--ready_file={ready}", f"--slots={_SLOTS.value}",
           f"--top_logprobs={_TOP.value}", f"--served_model={_MODEL.value}"]  # fmt: skip
    if _CHECKPOINT.value:
        cmd.append(f"--checkpoint={_CHECKPOINT.value}")
    if _DETERMINISTIC.value:
        cmd.append("--config.pipeline.deterministic=true")
    env = dict(os.environ, STREAMRL_ENDPOINT_TOKEN=token)
    return subprocess.Popen(cmd, cwd=_ROOT, env=env)


def _listening(proc: subprocess.Popen, ready: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready) or not os.path.getsize(ready):
        if proc.poll() is not None:
            sys.exit(f"error: serve exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"error: serve did not listen within {timeout:.0f} s")
        time.sleep(0.5)
    with open(ready) as f:
        return json.load(f)["url"]


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from streamrl_jax import config as config_lib
    from streamrl_jax import platforms

    for name in ("httpx", "httpx2", "openai"):  # a line per request is not this output
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = config_lib.from_config_dict(_CONFIG.value)
    if _DETERMINISTIC.value:
        cfg = dataclasses.replace(
            cfg, pipeline=dataclasses.replace(cfg.pipeline, deterministic=True)
        )
    import jax

    if (names := platforms.jax_platforms(os.environ)) is not None:
        jax.config.update("jax_platforms", names)
    jax.config.update("jax_num_cpu_devices", cfg.mesh.generate_devices + cfg.mesh.train_devices)
    from streamrl_jax.pipeline import components
    from streamrl_jax.pipeline import episode_evaluation as ee
    from streamrl_jax.pipeline.evaluation import with_eval_seed

    seed = _EVAL_SEED.value if _EVAL_SEED.value >= 0 else cfg.data.eval_seed
    cfg = with_eval_seed(cfg, seed, _PROBLEMS.value)
    held = ee.HeldOutEpisodes(cfg, components.describe_model(cfg).tokenizer)
    concurrency = _CONCURRENCY.value or _SLOTS.value
    named = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
    out = {
        "config": named[0] if named else "configs/agent.py",
        "checkpoint": _CHECKPOINT.value,
        "eval_seed": seed,
        "problems": len(held.prompts),
        "concurrency": concurrency,
    }
    try:
        if _URL.value:
            token = os.environ.get("STREAMRL_ENDPOINT_TOKEN", "")
            if _TOKEN_FILE.value:
                with open(_TOKEN_FILE.value) as f:
                    token = f.read().strip()
            served = held.served(
                _URL.value, token, _MODEL.value, concurrency=concurrency,
                timeout_s=_TIMEOUT.value,
            )  # fmt: skip
        else:
            token = secrets.token_urlsafe(32)
            with tempfile.TemporaryDirectory() as tmp:
                ready = os.path.join(tmp, "ready.json")
                t0 = time.perf_counter()
                proc = _start_serve(token, ready)
                try:
                    url = _listening(proc, ready, _TIMEOUT.value)
                    out["serve_start_s"] = round(time.perf_counter() - t0, 2)
                    served = held.served(
                        url, token, _MODEL.value, concurrency=concurrency,
                        timeout_s=_TIMEOUT.value,
                    )  # fmt: skip
                finally:
                    _stop(proc)
        out.update(_figures("served", served))
        runs = {"served": served}
        if _IN_PROCESS.value:
            engine, _ = ee.policy_engine(
                cfg, checkpoint=_CHECKPOINT.value, slots=_SLOTS.value, top_logprobs=_TOP.value
            )
            local = held.in_process(engine)
            runs["in_process"] = local
            agree = served.agreement(local)
            out.update(_figures("in_process", local))
            out.update(agree_outcomes=agree["outcomes"], agree_tokens=agree["tokens"])
            out["in_process_reprefilled"] = int(engine.metrics()["reprefilled"])
            out["differ"] = [
                a.prompt_id
                for a, b in zip(served.episodes, local.episodes, strict=True)
                if not (a.same_outcome(b) and a.same_tokens(b))
            ]
    finally:
        held.close()
    if _DUMP.value:
        with open(_DUMP.value, "w") as f:
            for name, run in runs.items():
                for e in run.episodes:
                    f.write(json.dumps({"evaluation": name, **dataclasses.asdict(e)}) + "\n")
    print(json.dumps(out), flush=True)


def _figures(name: str, run) -> dict:
    """An evaluation's accuracy, means per episode and wall time."""
    n = max(len(run.episodes), 1)
    return {
        f"{name}_accuracy": run.accuracy,
        f"{name}_turns": round(sum(e.turns for e in run.episodes) / n, 3),
        f"{name}_tool_calls": round(sum(e.tool_calls for e in run.episodes) / n, 3),
        f"{name}_wall_s": round(run.wall_s, 2),
    }


if __name__ == "__main__":
    app.run(main)
