"""The bad-input corpus: every user mistake a clear error, no hang, no traceback.

  python tools/bench_bad_inputs.py            # every case (about 1-2 min on 2 cores)
  python tools/bench_bad_inputs.py --quick    # the same corpus (it is already quick)

Four kinds of case:

* **launch** — configs, datasets, checkpoints and model files: a real
  `python -m streamrl_jax.launch` with the bad input (files written to a
  scratch directory) must exit with status 2 within `--timeout_s`, print no
  traceback, and print exactly one `error:` line containing the expected text
  (which names the field or the file).
* **reward** — hostile model output through the sandboxed scorer
  (`rewards/sandbox.py`): the call must come back (scored, or a named
  `RewardTimeout`) within its deadline and leave no file behind.
* **network** — hostile or broken peers of the cross-process channels
  (`streamrl_bench/bad_frames.py`): outsiders without the run key, a key holder
  sending malformed, oversized, pickled or tampered frames, weight headers
  that declare the wrong tree, samples of unknown prompts: each must end in
  its named error, with no thread, file descriptor or file left behind.
* **endpoint** — hostile or broken HTTP clients of the OpenAI-compatible endpoint
  (`tools/bad_requests.py`): malformed JSON, an oversized body, too many messages, a
  missing or wrong token, an unknown model, `max_tokens` past the limit, an unknown,
  missing or closed episode id, an unsupported parameter, a client that leaves
  mid-stream, one that never reads, one that never finishes its body: each a clear
  4xx (or its turn kept), the endpoint serving afterwards.

Last line: JSON with `cases`, `clear_errors`, `hangs`, `tracebacks`, `wrong`
(the names of cases whose error was not the expected one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

import bad_requests  # noqa: E402

from streamrl_bench import bad_frames  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "launch" | "reward" | "network" | "endpoint"
    expect: str  # text the one error line (launch) or the outcome (reward) must contain
    flags: tuple[str, ...] = ()
    files: Callable[[str], None] | None = None  # writes the bad input under a directory
    answer: str = ""  # reward cases: the model's text


def _write(name: str, data: bytes | str) -> Callable[[str], None]:
    def write(root: str) -> None:
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    return write


def _both(*writers: Callable[[str], None]) -> Callable[[str], None]:
    def write(root: str) -> None:
        for w in writers:
            w(root)

    return write


def _gguf_head(root: str) -> None:
    from streamrl_jax.model.defaults import smollm2_gguf_path

    with open(smollm2_gguf_path(), "rb") as f:
        head = f.read(4096)
    _write("truncated.gguf", head)(root)


def _c(name: str, flag: str, expect: str) -> Case:
    return Case(name, "launch", expect, (flag,))


def _agent(name: str, flag: str, expect: str, *more: str) -> Case:
    """A case of the episodes job (`configs/agent.py:tiny`)."""
    return Case(name, "launch", expect, ("--config=configs/agent.py:tiny", flag, *more))


ROW = '{"question": "1+1?", "answer": 2}\n'
EVAL = _write("eval.jsonl", '{"question": "2+2?", "answer": 4}\n')


_OPENENV = "streamrl_jax.environments.openenv_arithmetic:ArithmeticToolsEnvironment"


def _jsonl(name: str, body: str | bytes, expect: str, *extra: str) -> Case:
    return Case(
        name,
        "launch",
        expect,
        ("--config.data.jsonl_path={root}/train.jsonl",
         "--config.data.eval_jsonl_path={root}/eval.jsonl", *extra),
        _both(_write("train.jsonl", body), EVAL),
    )  # fmt: skip


CASES: list[Case] = [
    # ---- config: the flags themselves
    _c("unknown field", "--config.pipeline.foo=1", "no config field pipeline.foo"),
    _c("unknown section", "--config.pipelin.steps=1", "no config field pipelin.steps"),
    _c("int field given text", "--config.pipeline.steps=abc", "--config.pipeline.steps=abc"),
    _c("float field given text", "--config.optimizer.learning_rate=x", "learning_rate"),
    _c("bool field given text", "--config.log.progress=maybe", "log.progress"),
    _c("unknown flag", "--bogus", "Unknown command line flag 'bogus'"),
    _c("missing config file", "--config=/nonexistent/cfg.py", "/nonexistent/cfg.py"),
    _c("unknown variant", "--config=configs/quickstart.py:bogus", "unknown variant 'bogus'"),
    Case(
        "config file with a syntax error",
        "launch",
        "bad.py",
        ("--config={root}/bad.py",),
        _write("bad.py", "def get_config(:\n"),
    ),  # fmt: skip
    Case(
        "config file without get_config",
        "launch",
        "get_config",
        ("--config={root}/empty.py",),
        _write("empty.py", "X = 1\n"),
    ),  # fmt: skip
    # ---- config: registry names
    _c("advantage", "--config.algorithm.advantage=gea", "algorithm.advantage='gea'"),
    _c("policy loss", "--config.algorithm.policy_loss=ppo", "algorithm.policy_loss='ppo'"),
    _c("aggregation", "--config.algorithm.aggregation=mean", "algorithm.aggregation='mean'"),
    _c("kl estimator", "--config.algorithm.kl_estimator=k4", "algorithm.kl_estimator='k4'"),
    _c("mode", "--config.pipeline.mode=stream", "pipeline.mode='stream'"),
    _c("schedule", "--config.optimizer.schedule=linear", "optimizer.schedule='linear'"),
    _c("dtype", "--config.model.dtype=fp8", "model.dtype='fp8'"),
    _c("reward sandbox", "--config.data.reward_sandbox=docker", "data.reward_sandbox='docker'"),
    _c("dispatch", "--config.scheduling.dispatch=lpt", "scheduling.dispatch='lpt'"),
    _c("task", "--config.data.tasks=basic_arithmetc", "'basic_arithmetc' is not a reasoning-gym"),
    _c("task config JSON", "--config.data.task_config={oops", "data.task_config is not valid JSON"),
    # ---- config: numbers and cross-field rules
    _c("negative eval problems", "--config.eval.num_problems=-3", "eval.num_problems must be >= 0"),
    _c("empty train set", "--config.data.train_size=0", "data.train_size must be >= 1"),
    _c("staleness 0", "--config.pipeline.staleness=0", "pipeline.staleness must be >= 1"),
    _c("top_p above 1", "--config.generation.top_p=1.5", "generation.top_p must be in"),
    _c("negative learning rate", "--config.optimizer.learning_rate=-1e-3", "learning_rate"),
    _c("b2 = 1", "--config.optimizer.b2=1.0", "optimizer.b2 must be in"),
    _c("dual clip in (0, 1]", "--config.algorithm.dual_clip=0.5", "algorithm.dual_clip"),
    _c("reward timeout 0", "--config.data.reward_timeout_s=0", "data.reward_timeout_s"),
    _c("min groups > prompts", "--config.pipeline.min_groups=99", "pipeline.min_groups (99)"),
    _c("same train and eval seed", "--config.data.eval_seed=1", "data.train_seed must differ"),
    _c("context too short", "--config.model.max_context=64", "exceeds model.max_context"),
    _c("keep 0 checkpoints", "--config.checkpoint.keep=0", "checkpoint.keep must be >= 1"),
    Case(
        "jsonl without eval file",
        "launch",
        "data.jsonl_path needs data.eval_jsonl_path",
        ("--config.data.jsonl_path={root}/t.jsonl",),
    ),  # fmt: skip
    Case(
        "oracle without forced lengths",
        "launch",
        "needs generation.length_replay",
        ("--config.scheduling.dispatch=oracle",),
    ),  # fmt: skip
    Case(
        "group whitening with groups of 1",
        "launch",
        "critic.whiten='group' needs",
        # dynamic sampling (on in the quickstart) refuses groups of one first
        (
            "--config.algorithm.advantage=gae",
            "--config.pipeline.group_size=1",
            "--config.pipeline.rollout=full",
        ),
    ),  # fmt: skip
    Case(
        "dynamic sampling with groups of 1",
        "launch",
        "pipeline.rollout='dynamic_sampling' needs pipeline.group_size >= 2",
        ("--config.pipeline.group_size=1",),
    ),
    Case(
        "all instances reserved",
        "launch",
        "scheduling.elastic_reserved=1",
        ("--config.scheduling.elastic_reserved=1",),
    ),  # fmt: skip
    # ---- datasets (JSONL)
    Case(
        "missing JSONL file",
        "launch",
        "nope.jsonl: not found",
        (
            "--config.data.jsonl_path={root}/nope.jsonl",
            "--config.data.eval_jsonl_path={root}/eval.jsonl",
        ),
        EVAL,
    ),  # fmt: skip
    _jsonl("empty JSONL", "", "empty file"),
    _jsonl("JSONL row not JSON", ROW + "{oops\n", "train.jsonl:2: invalid JSON"),
    _jsonl(
        "JSONL 5,000-digit number",
        ROW + '{"question": "q", "answer": ' + "9" * 5000 + "}\n",
        "train.jsonl:2: invalid JSON value",
    ),  # fmt: skip
    _jsonl(
        "JSONL nested 100,000 deep",
        ROW + '{"question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "train.jsonl:2: JSON nested too deeply",
    ),  # fmt: skip
    _jsonl(
        "JSONL 2 MiB line",
        ROW + '{"question": "' + "x" * (2 << 20) + '", "answer": 1}\n',
        "train.jsonl:2: line longer than",
    ),  # fmt: skip
    _jsonl(
        "JSONL answer of a wrong type",
        ROW + '{"question": "q", "answer": [1]}\n',
        "train.jsonl:2: 'answer' must be",
    ),  # fmt: skip
    _jsonl(
        "JSONL not UTF-8",
        ROW.encode() + b'{"question": "\xff", "answer": 1}\n',
        "train.jsonl:2: not valid UTF-8",
    ),  # fmt: skip
    _jsonl(
        "JSONL duplicate ids",
        '{"id": "a", "question": "1?", "answer": 1}\n' * 2,
        "duplicate prompt id",
    ),  # fmt: skip
    _jsonl(
        "JSONL every row bad, skip mode",
        "{oops\n[1]\n",
        "no usable rows",
        "--config.data.bad_rows=skip",
    ),  # fmt: skip
    _jsonl(
        "no prompt fits",
        ROW,
        "none of the 1 prompts fits",
        "--config.generation.max_prompt_len=8",
        "--config.model.source=tiny",
    ),  # fmt: skip
    # ---- checkpoints
    Case(
        "init_from a missing path",
        "launch",
        "/nonexistent/ckpt",
        ("--config.init_from=/nonexistent/ckpt", "--config.model.source=tiny"),
    ),  # fmt: skip
    Case(
        "init_from a directory of no checkpoint",
        "launch",
        "notackpt",
        ("--config.init_from={root}/notackpt", "--config.model.source=tiny"),
        _write("notackpt/readme.txt", "hello"),
    ),  # fmt: skip
    Case(
        "a workdir whose only checkpoint is garbage",
        "launch",
        "reads back",
        ("--config.model.source=tiny",),
        _both(
            _write("work/checkpoints/3/metadata/metadata", "{not json"),
            _write("work/checkpoints/3/commit_success.txt", "ok"),
        ),
    ),  # fmt: skip
    # ---- model files
    _c("model file missing", "--config.model.source=/nonexistent.gguf", "/nonexistent.gguf"),
    Case(
        "model file not GGUF",
        "launch",
        "not a GGUF file",
        ("--config.model.source={root}/random.bin",),
        _write("random.bin", os.urandom(4096)),
    ),  # fmt: skip
    Case(
        "model file truncated",
        "launch",
        "truncated.gguf",
        ("--config.model.source={root}/truncated.gguf",),
        _gguf_head,
    ),  # fmt: skip
    Case(
        "HF directory without config.json",
        "launch",
        "config.json",
        ("--config.model.source={root}/hf",),
        _write("hf/tokenizer.json", "{}"),
    ),  # fmt: skip
    Case(
        "HF config.json not JSON",
        "launch",
        "config.json: invalid JSON",
        ("--config.model.source={root}/hf",),
        _write("hf/config.json", "{oops"),
    ),  # fmt: skip
    # ---- reward outputs (model text is untrusted)
    Case(
        "answer that writes a file",
        "reward",
        "score",
        answer="<answer>__import__('pathlib').Path('{root}/pwned').touch()</answer>",
    ),
    # ---- episodes (configs/agent.py)
    _agent(
        "unknown environment", "--config.environment.name=weather", "environment.name='weather'"
    ),
    _agent(
        "tool format without a parser",
        "--config.environment.tool_format=hermes",
        "environment.tool_format='hermes': this model's vocabulary has no <tool_call>",
    ),
    _agent(
        "turn limits past the context",
        "--config.environment.max_episode_tokens=500",
        "exceeds model.max_context",
    ),
    _agent(
        "turn cap leaving no second turn",
        "--config.generation.max_new_tokens=96",
        "or a second turn never fits",
    ),
    _agent(
        "episodes without an environment",
        "--config.environment.name=",
        "needs the 'episodes' wrapper",
    ),
    _agent(
        "an environment with GAE",
        "--config.algorithm.advantage=gae",
        "algorithm.advantage='gae' with an environment",
    ),
    _agent(
        "episodes in rounds regenerated past the lag bound",
        "--config.pipeline.rollout=episodes+partial",
        "pipeline.rollout='episodes+partial' needs pipeline.lag_policy='drop'",
        "--config.pipeline.mode=stream_async",
        "--config.pipeline.partial_budget_tokens=16",
        "--config.pipeline.max_lag=3",
        "--config.pipeline.lag_policy=regenerate",
    ),
    _agent(
        "OpenEnv class that is not there",
        "--config.environment.name=openenv",
        "environment.openenv='streamrl_jax.environments.openenv_arithmetic:Nope'",
        f"--config.environment.openenv={_OPENENV.split(':')[0]}:Nope",
    ),
    _agent(
        "OpenEnv arguments that are not JSON",
        "--config.environment.name=openenv",
        "environment.openenv_kwargs is not valid JSON",
        f"--config.environment.openenv={_OPENENV}",
        "--config.environment.openenv_kwargs={task:",
    ),
    _agent(
        "OpenEnv answer tool it does not offer",
        "--config.environment.name=openenv",
        "environment.openenv_answer_tool='answer': ",
        f"--config.environment.openenv={_OPENENV}",
        "--config.environment.openenv_answer_tool=answer",
    ),
    _agent(
        "scaffolds' episodes in rounds",
        "--config.pipeline.rollout=agents+partial",
        "scaffolds' episodes ('agents') run with 'full' or 'dynamic_sampling'",
        "--config.pipeline.mode=stream_async",
        "--config.pipeline.partial_budget_tokens=16",
        "--config.pipeline.max_lag=3",
        "--config.pipeline.lag_policy=drop",
    ),
    Case(
        "answer that runs a shell",
        "reward",
        "score",
        answer="<answer>__import__('os').system('touch {root}/pwned')</answer>",
    ),
    Case(
        "answer that never finishes",
        "reward",
        "RewardTimeout",
        answer="<answer>9**9**9**9</answer>",
    ),
    Case(
        "answer that exhausts memory",
        "reward",
        "score",
        answer="<answer>len('x' * 10**11)</answer>",
    ),
]


_NETWORK = {c.name: c for c in bad_frames.cases()}
CASES += [Case(c.name, "network", c.expect) for c in _NETWORK.values()]


_ENDPOINT = {c.name: c for c in bad_requests.cases()}
CASES += [Case(c.name, "endpoint", c.expect) for c in _ENDPOINT.values()]


def run_endpoint(case: Case, root: str, timeout_s: float) -> tuple[str, str]:
    """Against one endpoint on loopback, built on first use (tools/bad_requests.py)."""
    return bad_requests.run(_ENDPOINT[case.name])


def run_network(case: Case, root: str, timeout_s: float) -> tuple[str, str]:
    """In this process, bounded by each case's own timeouts (seconds)."""
    return bad_frames.run(_NETWORK[case.name])


def run_launch(case: Case, root: str, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail): outcome is "clear", "traceback", "hang" or "wrong"."""
    cmd = [sys.executable, "-m", "streamrl_jax.launch", *launch_args(case, root)]
    try:
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=launch_env()
        )
    except subprocess.TimeoutExpired:
        return judge_launch(case, None, "", timeout_s)
    return judge_launch(case, run.returncode, run.stderr, timeout_s)


def launch_args(case: Case, root: str) -> list[str]:
    """The entry point's arguments for `case` in the scratch directory `root` (its files
    written there first)."""
    if case.files is not None:
        case.files(root)
    flags = [f.replace("{root}", root) for f in case.flags]
    return [f"--workdir={os.path.join(root, 'work')}", *flags]


def launch_env() -> dict[str, str]:
    """The environment a launch case runs in."""
    return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")


def judge_launch(case: Case, status: int | None, stderr: str, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail) of a launch that ended with `status` (None: it ran past
    `timeout_s`) and printed `stderr`."""
    if status is None:
        return "hang", f"no exit within {timeout_s:.0f} s"
    if "Traceback" in stderr:
        return "traceback", stderr.strip().splitlines()[-1]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if status == 2 and len(errors) == 1 and case.expect in errors[0]:
        return "clear", errors[0]
    return "wrong", f"rc={status} {errors or stderr[-300:]}"


def run_reward(case: Case, root: str, timeout_s: float) -> tuple[str, str]:
    """Scores `case.answer` with the countdown scorer (it `eval`s answers) in the sandbox."""
    import reasoning_gym

    from streamrl_jax.rewards.sandbox import Limits, SandboxPool
    from streamrl_jax.rewards.tasks import TaskReward

    entry = reasoning_gym.create_dataset("countdown", size=1, seed=0)[0]
    fn = TaskReward(score_answer=reasoning_gym.get_score_answer_fn("countdown"))
    meta = {"task": "countdown", "entry": entry, "prompt_id": "countdown/0"}
    pool = SandboxPool(fn, workers=1, limits=Limits(timeout_s=3.0, memory_mb=1024))
    try:
        result = pool.submit(case.answer.replace("{root}", root), meta).result(timeout_s)
        outcome = f"score={result.score}"
    except TimeoutError as e:
        outcome = f"{type(e).__name__}: {e}" if type(e).__name__ == "RewardTimeout" else "hang"
    except Exception as e:  # noqa: BLE001 - a named error is an outcome too
        outcome = f"{type(e).__name__}: {e}"
    finally:
        pool.close()
    if os.path.exists(os.path.join(root, "pwned")):
        return "wrong", "the answer wrote a file outside the sandbox"
    if outcome == "hang":
        return "hang", f"no result within {timeout_s:.0f} s"
    return ("clear" if case.expect in outcome else "wrong"), outcome


def run_case(case: Case, timeout_s: float = 120.0) -> tuple[str, str]:
    root = tempfile.mkdtemp(prefix="bad-input-")
    try:
        runner = {
            "launch": run_launch,
            "reward": run_reward,
            "network": run_network,
            "endpoint": run_endpoint,
        }[case.kind]
        return runner(case, root, timeout_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    import argparse

    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # the endpoint cases' tiny job, set first

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the same corpus (already quick)")
    parser.add_argument("--timeout_s", type=float, default=120.0)
    args = parser.parse_args()
    counts = {"clear": 0, "traceback": 0, "hang": 0, "wrong": 0}
    wrong, start = [], time.monotonic()
    for case in CASES:
        outcome, detail = run_case(case, args.timeout_s)
        counts[outcome] += 1
        if outcome != "clear":
            wrong.append(case.name)
        print(f"{outcome:9s} {case.kind:6s} {case.name}: {detail[:160]}", flush=True)
    bad_requests.close()
    print(
        json.dumps(
            {
                "bench": "bad_inputs",
                "cases": len(CASES),
                "clear_errors": counts["clear"],
                "hangs": counts["hang"],
                "tracebacks": counts["traceback"],
                "wrong": wrong,
                "wall_s": round(time.monotonic() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
