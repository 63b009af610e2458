"""The base model's ceiling on a run's held-out problems: greedy accuracy and pass@k.

  python tools/pass_at_k.py                                  # quickstart, eval seed 2
  python tools/pass_at_k.py --eval_seeds=2,3 --k=16 --problems=64
  python tools/pass_at_k.py --checkpoint=/tmp/quickstart     # a run's latest weights

GRPO mostly sharpens what the policy already samples: a problem that none of k
samples of the starting policy solves gives its group no reward variance, so no
gradient. pass@k of the base model (k samples at the run's temperature, the
unbiased estimator of Chen et al. 2021 for every k' <= k) is therefore the
measured ceiling that issue 17's learning goal is judged against (greedy
held-out accuracy >= 0.80): a recipe can reach it only on problems the model
solves at least sometimes. The held-out set, prompts, system prompt, response
cap and scorer are the config's own (`pipeline/datasets.py`), each eval seed a
set the training never uses.

Last line: JSON with, per eval seed, `greedy` accuracy, `sample_mean` (mean
accuracy of the temperature samples), `pass_at` {k': pass@k'}, the share of
responses cut at the cap, and the wall time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

_CONFIG = flags.DEFINE_string(
    "config", os.path.join(_ROOT, "configs", "quickstart.py"), "Config file[:variant]."
)
_SEEDS = flags.DEFINE_string("eval_seeds", "", "Comma-separated eval seeds (default: config's).")
_PROBLEMS = flags.DEFINE_integer("problems", 0, "Held-out problems (0 = config's eval size).")
_K = flags.DEFINE_integer("k", 16, "Samples per problem.")
_TEMPERATURE = flags.DEFINE_float("temperature", -1.0, "Sampling temperature (<0: config's).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine batch (slots).")
_DUMP = flags.DEFINE_string("dump", "", "Write every response (JSONL) to this path.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint",
    "",
    "A run's workdir (run with --config): its latest checkpoint's policy instead of the base.",
)


def _config():
    from streamrl_jax import config as config_lib

    path, _, arg = _CONFIG.value.partition(":")
    spec = importlib.util.spec_from_file_location("pass_at_k_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return config_lib.from_config_dict(module.get_config(arg or None).to_dict())


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _engine(cfg, policy, mesh, tokenizer):
    """The run's own engine config (stop ids, lengths, chunk), with --slots slots and
    prefills of up to 16 prompts (all of a problem's samples share one prompt length)."""
    import dataclasses

    from streamrl_jax.generation.engine import Engine
    from streamrl_jax.pipeline.components import engine_config

    ecfg = engine_config(cfg, tokenizer, _SLOTS.value)
    ecfg = dataclasses.replace(ecfg, prefill_batch=min(_SLOTS.value, 16), admission="fifo")
    return Engine(policy.graphdef, policy.params, policy.model_cfg, ecfg, mesh)


def _policy(cfg):
    """The policy measured: the base model, or a run's latest checkpoint (LoRA-aware),
    on one device."""
    from streamrl_jax.model.loader import load_pretrained, single_device_mesh
    from streamrl_jax.pipeline import components, evaluation

    if cfg.model.source != "smollm2":
        raise ValueError(f"model.source={cfg.model.source!r}: this tool measures smollm2")
    mesh = single_device_mesh()
    base = load_pretrained(components.model_path(cfg), mesh=mesh)
    checkpoint = os.path.join(_CHECKPOINT.value, "checkpoints") if _CHECKPOINT.value else None
    return mesh, base.tokenizer, evaluation.run_policy(cfg, base, checkpoint)


def measure(
    cfg, engine, tokenizer, seed: int, n_problems: int, k: int, temperature: float, dump=None
):
    from streamrl_jax.data import tokenize
    from streamrl_jax.generation.types import GenerationRequest, SamplingParams
    from streamrl_jax.pipeline import datasets, evaluation

    d, g = cfg.data, cfg.generation
    eval_set = datasets.eval_set(evaluation.with_eval_seed(cfg, seed, n_problems))
    reward = eval_set.reward_fn(format_bonus=d.format_reward)
    prompts = [tokenize(p, tokenizer, d.system_prompt) for p in eval_set]
    sampling = SamplingParams(temperature=temperature, top_k=g.top_k, top_p=g.top_p)
    requests = []
    for i, p in enumerate(prompts):
        requests.append(
            GenerationRequest(
                request_id=(i, -1),
                prompt=p.tokens,
                max_new_tokens=g.max_new_tokens,
                sampling=SamplingParams.greedy(),
            )
        )
        for j in range(k):
            requests.append(
                GenerationRequest(
                    request_id=(i, j),
                    prompt=p.tokens,
                    max_new_tokens=g.max_new_tokens,
                    sampling=sampling,
                    seed=1_000_003 * seed + 1_009 * i + j,
                )
            )
    t0 = time.perf_counter()
    samples = engine.run(requests)
    wall = time.perf_counter() - t0
    greedy = np.zeros(len(prompts), dtype=bool)
    correct = np.zeros(len(prompts), dtype=np.int64)
    cut = 0
    for s in samples:
        i, j = s.request_id
        text = tokenizer.decode(s.response)
        r = reward(text, prompts[i].problem.metadata)
        ok = r.correct
        if dump is not None:
            row = {"eval_seed": seed, "problem": i, "sample": j, "correct": bool(ok)}
            row.update(question=prompts[i].problem.question, response=text)
            row.update(extracted=r.extracted_answer, finish=s.finish_reason)
            dump.write(json.dumps(row) + "\n")
        cut += s.finish_reason == "length"
        if j < 0:
            greedy[i] = ok
        else:
            correct[i] += ok
    ks = sorted({1, 2, 4, 8, k} & set(range(1, k + 1)))
    return {
        "eval_seed": seed,
        "problems": len(prompts),
        "greedy": round(float(greedy.mean()), 4),
        "sample_mean": round(float(correct.sum() / (k * len(prompts))), 4),
        "pass_at": {
            str(kk): round(float(np.mean([pass_at(k, int(c), kk) for c in correct])), 4)
            for kk in ks
        },
        "never_solved": int((correct == 0).sum()),
        "truncated": round(cut / len(samples), 4),
        "generate_s": round(wall, 1),
    }


def main(argv):
    del argv
    cfg = _config()
    seeds = [int(s) for s in _SEEDS.value.split(",") if s] or [cfg.data.eval_seed]
    train_seed = cfg.data.train_seed
    if train_seed in seeds:
        raise ValueError(f"--eval_seeds={_SEEDS.value}: {train_seed} is the training seed")
    n = _PROBLEMS.value or cfg.eval.num_problems
    temperature = _TEMPERATURE.value if _TEMPERATURE.value >= 0 else cfg.generation.temperature
    mesh, tokenizer, policy = _policy(cfg)
    engine = _engine(cfg, policy, mesh, tokenizer)
    out = {
        "bench": "pass_at_k",
        "config": os.path.relpath(_CONFIG.value, _ROOT),
        "checkpoint": _CHECKPOINT.value or None,
        "k": _K.value,
        "temperature": temperature,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "seeds": [],
    }
    dump = open(_DUMP.value, "w", encoding="utf-8") if _DUMP.value else None  # noqa: SIM115
    for seed in seeds:
        r = measure(cfg, engine, tokenizer, seed, n, _K.value, temperature, dump)
        print(
            f"eval seed {seed}: greedy {r['greedy']:.3f}  pass@k {r['pass_at']}  "
            f"({r['problems']} problems, {r['generate_s']} s)",
            file=sys.stderr,
            flush=True,
        )
        out["seeds"].append(r)
    if dump is not None:
        dump.close()
    out["load_avg"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
