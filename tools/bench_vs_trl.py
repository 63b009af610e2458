"""The main job against Hugging Face TRL's `GRPOTrainer`, side by side: held-out accuracy
against wall time for the same budget on the same machine, one after the other.

    pip install -e ".[trl]"                    # the baseline: trl==1.16.0, torch==2.13.0
    python tools/bench_vs_trl.py --quick       # a smoke of the comparison, < 5 min
    python tools/bench_vs_trl.py --budget_s=1500

Both runs start from SmolLM2-135M-Instruct (the embedded GGUF; TRL loads the same file
through transformers) on the quickstart recipe (`--config`): the same training problems
(reasoning-gym, the config's train seed, the held-out questions excluded), the same
chat-templated prompts (the project's token ids; TRL's tokenisation of the same text is
checked equal), the same reward (the task's scorer, the format bonus and DAPO's soft
overlong penalty), group size, prompts a step, response cap, temperature, top-k/top-p,
learning rate and cosine schedule to 0.1x, warm-up, clip range (0.2, 0.28 above),
token-mean loss (TRL's "dapo"), no KL. TRL runs at its fastest CPU settings: no
activation checkpointing, `--threads` torch threads (the cores), f32, no vLLM.

* The project: `python -m streamrl_jax.launch --config=<config>` (the README's main job)
  with `checkpoint.every=--project_every` steps (all kept) and no in-run evaluation
  (`eval.at_start=false`, `eval.every` past the budget); stopped with SIGTERM at the
  budget. A checkpoint of step k counts at the wall time of step k's metrics row.
* TRL: a subprocess (`--trl_worker`) whose callback saves the policy (`save_pretrained`)
  every `--snapshot_s` seconds of training and stops at the budget; the seconds spent
  saving are not counted.
* Wall time runs from each process's launch (model loading and compiles count).
* One evaluator for both, afterwards: every snapshot's greedy accuracy on the config's
  held-out problems (`--eval_problems` of eval seed `--eval_seed`) with the project's
  engine and scorer (`Evaluator`); TRL's snapshots are read back
  through the project's HF loader. The base model's accuracy is measured both ways (the
  GGUF, and TRL's step-0 snapshot) and must come out equal: the mirror's check.

What TRL cannot mirror: dynamic sampling (DAPO's refill of zero-variance groups: TRL
trains on every group), the one-step staleness of stream_async and the behaviour
log-probs it corrects with (TRL generates and trains in turn, on-policy), the prompt
order (both shuffle the same problems with their own seeds), and the project's
checkpoint writes, which count in its time (TRL's saves do not).

Reports accuracy against wall time for both, the time each needs to reach the other's
best accuracy, and ends with one JSON line: `time_to_accuracy_ratio` = TRL's time to its
best accuracy within the budget / the project's time to reach that accuracy (> 1: the
project is faster), and both curves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

# The repository (streamrl_bench, streamrl_jax) from a checkout that is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from streamrl_bench import curves  # noqa: E402

_ROOT = curves.ROOT

_CONFIG = flags.DEFINE_string(
    "config", os.path.join(_ROOT, "configs", "quickstart.py"), "Config file[:variant]."
)
_BUDGET = flags.DEFINE_float("budget_s", 1500.0, "Wall-clock budget of each run (seconds).")
_SNAPSHOT = flags.DEFINE_float("snapshot_s", 150.0, "TRL: seconds of training between saves.")
_PROJECT_EVERY = flags.DEFINE_integer("project_every", 20, "Project: steps between checkpoints.")
_EVAL_PROBLEMS = flags.DEFINE_integer("eval_problems", 64, "Held-out problems per evaluation.")
_EVAL_SEED = flags.DEFINE_integer("eval_seed", -1, "Held-out seed (<0: the config's).")
_THREADS = flags.DEFINE_integer("threads", 0, "TRL's torch threads (0: every core).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_vs_trl", "Where both runs write.")
_QUICK = flags.DEFINE_bool("quick", False, "Budgets of 100 s, 16 problems: a smoke (< 5 min).")
_SKIP = flags.DEFINE_list("skip", [], "Runs not to (re)run: project, trl (reuse the workdir's).")
_TRL_WORKER = flags.DEFINE_bool("trl_worker", False, "Internal: run TRL in this process.")


def _budget() -> float:
    return 100.0 if _QUICK.value else _BUDGET.value


# ----------------------------------------------------------------------------- the project
# ----------------------------------------------------------------------------- TRL
def trl_worker() -> None:
    """TRL's GRPOTrainer on the mirrored recipe (module docstring), in this process."""
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from streamrl_jax.algorithms.overlong import soft_overlong_penalty
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import describe
    from streamrl_jax.pipeline import datasets as datasets_lib

    t_launch = float(os.environ["BENCH_VS_TRL_T0"])
    out_dir = _WORKDIR.value + "/trl"
    threads = _THREADS.value or os.cpu_count()
    torch.set_num_threads(threads)
    cfg = curves.config_of(_CONFIG.value)
    d, g, a, o, p = cfg.data, cfg.generation, cfg.algorithm, cfg.optimizer, cfg.pipeline
    tokenizer = describe(smollm2_gguf_path()).tokenizer
    _, train_set = datasets_lib.datasets(cfg)
    reward = train_set.reward_fn(format_bonus=d.format_reward)
    from streamrl_jax.data import chat_messages, tokenize

    prompts = [tokenize(q, tokenizer, d.system_prompt) for q in train_set]
    prompts = [q for q in prompts if len(q.tokens) <= g.max_prompt_len]
    # The chat-templated text `tokenize` encodes (decoding would drop the special tokens).
    convo = [
        chat_messages(q.problem.question, *[d.system_prompt] * bool(d.system_prompt))
        for q in prompts
    ]
    texts = [tokenizer.apply_chat_template(c) for c in convo]
    gguf = smollm2_gguf_path()
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    for q, text in zip(prompts[:64], texts[:64], strict=True):
        ids = hf_tok(text=text)["input_ids"]
        if list(ids) != list(q.tokens):
            raise RuntimeError(
                f"TRL's tokenisation of prompt {q.problem.prompt_id} differs from the "
                f"project's ({len(ids)} vs {len(q.tokens)} tokens): the mirror is broken"
            )
    metadata = [json.dumps(q.problem.metadata) for q in prompts]
    data = Dataset.from_dict({"prompt": texts, "meta": metadata})
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    # transformers dequantises the GGUF to f32 but marks the model quantised, which its
    # Trainer refuses to fine-tune: the weights are plain f32 tensors, so unmark it.
    model.is_quantized, model.hf_quantizer = False, None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def score(prompts, completions, completion_ids, meta, **_):
        lengths = np.asarray([len(c) for c in completion_ids])
        outcome = [reward(c, json.loads(m)).score for c, m in zip(completions, meta, strict=True)]
        penalty = 0.0
        if a.overlong_buffer:
            penalty = soft_overlong_penalty(
                lengths, lengths >= g.max_new_tokens, max_len=g.max_new_tokens,
                buffer=a.overlong_buffer, penalty=a.overlong_penalty,
            )  # fmt: skip
        return list(np.asarray(outcome, np.float32) + penalty)

    snaps: list[dict] = []
    excluded = [0.0]  # seconds spent saving

    def save(step: int) -> None:
        t = time.time()
        path = os.path.join(out_dir, f"step-{step}")
        model.save_pretrained(path)
        snaps.append({"step": step, "seconds": t - t_launch - excluded[0], "path": path})
        excluded[0] += time.time() - t
        with open(os.path.join(out_dir, "snapshots.json"), "w") as f:
            json.dump(snaps, f)

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            elapsed = time.time() - t_launch - excluded[0]
            due = snaps[-1]["seconds"] + _SNAPSHOT.value if len(snaps) > 1 else _SNAPSHOT.value
            if elapsed >= _budget():
                control.should_training_stop = True
                save(state.global_step)
            elif elapsed >= due or _QUICK.value:
                save(state.global_step)
            return control

    # One optimizer step per step's groups, in micro-batches of the project's size.
    args = GRPOConfig(
        output_dir=out_dir,
        num_generations=p.group_size,
        per_device_train_batch_size=p.group_size * p.micro_batch_groups,
        gradient_accumulation_steps=max(p.prompts_per_step // p.micro_batch_groups, 1),
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=g.top_p,
        epsilon=a.clip_eps,
        epsilon_high=a.clip_eps_high if a.policy_loss == "dapo" else a.clip_eps,
        loss_type="dapo" if a.aggregation == "token_mean" else "grpo",
        beta=0.0,
        scale_rewards="group",
        learning_rate=o.learning_rate,
        lr_scheduler_type="cosine_with_min_lr" if o.schedule == "cosine" else "constant",
        lr_scheduler_kwargs={"min_lr_rate": o.min_lr_ratio} if o.schedule == "cosine" else None,
        warmup_steps=o.warmup_steps,
        max_grad_norm=o.max_grad_norm,
        weight_decay=o.weight_decay,
        adam_beta1=o.b1,
        adam_beta2=o.b2,
        adam_epsilon=o.eps,
        max_steps=p.steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=score,
        args=args,
        train_dataset=data,
        processing_class=hf_tok,
        callbacks=[Snapshots()],
    )
    os.makedirs(out_dir, exist_ok=True)
    save(0)  # the base, through TRL's own save: the mirror's check
    snaps[0]["seconds"] = 0.0
    trainer.train()


def run_trl(workdir: str) -> list[tuple[float, int, str]]:
    """TRL in a subprocess for the budget; [(seconds since launch, step, snapshot)]."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    env = dict(os.environ, BENCH_VS_TRL_T0=repr(time.time()), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--trl_worker", *sys.argv[1:]]
    with open(os.path.join(workdir, "bench_console.txt"), "w") as log:
        run = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT,
            timeout=_budget() + 900,
        )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"TRL's run failed (exit {run.returncode}): {workdir}/bench_console.txt")
    return trl_snapshots(workdir)


def trl_snapshots(workdir: str) -> list[tuple[float, int, str]]:
    """TRL's saves within the budget: [(seconds since launch, step, directory)]."""
    with open(os.path.join(workdir, "snapshots.json")) as f:
        snaps = json.load(f)
    return [(s["seconds"], s["step"], s["path"]) for s in snaps if s["seconds"] <= _budget() + 1]


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if _TRL_WORKER.value:
        trl_worker()
        return
    project_dir, trl_dir = _WORKDIR.value + "/project", _WORKDIR.value + "/trl"
    t0 = time.time()
    if "project" not in _SKIP.value:
        every = 2 if _QUICK.value else _PROJECT_EVERY.value
        curves.run_project(_CONFIG.value, [], project_dir, _budget(), every)
    project_points = curves.read_points(project_dir)
    print(f"project: {len(project_points)} checkpoints in {time.time() - t0:.0f} s", flush=True)
    t1 = time.time()
    if "trl" not in _SKIP.value:
        run_trl(trl_dir)
    trl_points = trl_snapshots(trl_dir)
    print(f"TRL: {len(trl_points)} snapshots in {time.time() - t1:.0f} s", flush=True)
    from streamrl_jax.pipeline import evaluation

    problems = 16 if _QUICK.value else _EVAL_PROBLEMS.value
    ev = evaluation.Evaluator(curves.config_of(_CONFIG.value), problems, _EVAL_SEED.value)
    project_curve = []
    for seconds, step in project_points:
        acc = ev.project(project_dir, step)
        project_curve.append((round(seconds, 1), acc))
        print(f"project step {step:4d} at {seconds:7.1f} s: {acc:.3f}", flush=True)
    trl_curve = []
    for seconds, step, path in trl_points:
        acc = ev.hf(path)
        trl_curve.append((round(seconds, 1), acc))
        print(f"TRL     step {step:4d} at {seconds:7.1f} s: {acc:.3f}", flush=True)
    if trl_curve[0][1] != project_curve[0][1]:
        raise RuntimeError(
            f"the base model's accuracy differs: {project_curve[0][1]} (GGUF, the project) "
            f"against {trl_curve[0][1]} (TRL's step-0 save): the mirror is broken"
        )
    trl_best = max(acc for _, acc in trl_curve)
    project_best = max(acc for _, acc in project_curve)
    t_trl = curves.time_to(trl_curve, trl_best)
    t_project = curves.time_to(project_curve, trl_best)
    out = {
        "bench": "bench_vs_trl",
        "config": os.path.relpath(_CONFIG.value, _ROOT),
        "budget_s": _budget(),
        "eval_seed": ev.seed,
        "eval_problems": ev.problems,
        "base_accuracy": project_curve[0][1],
        "trl_best": trl_best,
        "project_best": project_best,
        "trl_time_to_its_best_s": t_trl,
        "project_time_to_trl_best_s": t_project,
        "trl_time_to_project_best_s": curves.time_to(trl_curve, project_best),
        "time_to_accuracy_ratio": (t_trl / t_project) if t_project else None,
        "project_curve": project_curve,
        "trl_curve": trl_curve,
        "cpu": curves.cpu_model(),
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
