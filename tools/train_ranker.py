"""Trains the output-length ranker from a per-sample JSONL log and reports held-out quality.

Input: the JSONL that `scheduling.sample_log.SampleLog` writes (prompt_id, step,
prompt_tokens, output_length, ...). Samples of one prompt (a GRPO group, or the same prompt
in several steps) are merged into one example whose target is their mean output length;
prompts are split into train / held-out by a hash of prompt_id (`--holdout` share), so no
held-out prompt is ever trained on; 20 % of the training prompts validate (Kendall tau every
10 steps) and the best checkpoint is kept (early stopping). Reports recall of the true
longest 20 / 10 / 5 % among the predicted longest and Kendall tau on the held-out prompts,
next to reference predictors (prompt length; the training mean length of the prompt's task;
chance), and writes the ranker (pickle of {"config", "state", "report"};
`Ranker.load_state(d["state"])`).

    python tools/train_ranker.py --samples=/tmp/run/samples.jsonl --out=/tmp/ranker.pkl
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pickle
import time

import numpy as np
from absl import app, flags

from streamrl_jax.scheduling.rank_metrics import kendall_tau, ranking_report, recall_at
from streamrl_jax.scheduling.ranker import Ranker, RankerConfig
from streamrl_jax.scheduling.sample_log import LoggedSample, read_sample_log

FLAGS = flags.FLAGS
_EVAL_EVERY = 10  # optimizer steps between validation checks (early stopping)


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: its tokens, task and mean observed output length."""

    prompt_id: str
    tokens: tuple[int, ...]
    task: str | None
    length: float


def merge_by_prompt(records: list[LoggedSample]) -> list[Example]:
    """One example per prompt_id, target = mean output length of its samples."""
    groups: dict[str, list[LoggedSample]] = collections.defaultdict(list)
    for r in records:
        groups[r.prompt_id].append(r)
    return [
        Example(pid, rs[0].prompt_tokens, rs[0].task, float(np.mean([r.output_length for r in rs])))
        for pid, rs in groups.items()
    ]


def is_heldout(prompt_id: str, share: float) -> bool:
    """Deterministic split by a hash of the prompt id."""
    h = int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < share


def train_and_evaluate(
    examples: list[Example], cfg: RankerConfig, steps: int, holdout: float
) -> tuple[Ranker, dict]:
    """Trains on the non-held-out prompts; returns the ranker and the held-out report."""
    train = [e for e in examples if not is_heldout(e.prompt_id, holdout)]
    test = [e for e in examples if is_heldout(e.prompt_id, holdout)]
    if len(train) < 2 or len(test) < 5:
        raise ValueError(
            f"train_ranker: {len(train)} train / {len(test)} held-out prompts; need more samples"
        )
    # Early stopping on a validation split of the *training* prompts (never the held-out
    # ones): with a few hundred noisy lengths the ranker overfits within ~100 steps.
    val = [e for e in train if is_heldout("val/" + e.prompt_id, 0.2)]
    fit = [e for e in train if not is_heldout("val/" + e.prompt_id, 0.2)]
    ranker = Ranker(cfg)
    t0 = time.time()
    losses: list[float] = []
    best_tau, best_state, best_steps = -np.inf, ranker.state(), 0
    val_len = np.array([e.length for e in val])
    for done in range(0, steps, _EVAL_EVERY):
        n = min(_EVAL_EVERY, steps - done)
        losses += ranker.fit([e.tokens for e in fit], [e.length for e in fit], n)
        tau = kendall_tau(val_len, ranker.score([e.tokens for e in val])) if len(val) > 2 else 0
        if np.isfinite(tau) and tau > best_tau:
            best_tau, best_state, best_steps = tau, ranker.state(), done + n
    ranker.load_state(best_state)
    train_s = time.time() - t0
    true = np.array([e.length for e in test])
    report = {"ranker": ranking_report(true, ranker.score([e.tokens for e in test]))}
    report["prompt_length"] = ranking_report(true, np.array([len(e.tokens) for e in test]))
    task_mean = collections.defaultdict(list)
    for e in train:
        task_mean[e.task].append(e.length)
    overall = float(np.mean([e.length for e in train]))
    task_score = [np.mean(task_mean[e.task]) if e.task in task_mean else overall for e in test]
    report["task_mean"] = ranking_report(true, np.array(task_score))
    # Chance level: with many ties at the top (responses cut at max_new_tokens) a random
    # order already scores well on the tie-aware recall.
    rng = np.random.default_rng(0)
    report["random_recall_at_20"] = float(
        np.mean([recall_at(true, rng.random(len(true)), 0.2) for _ in range(200)])
    )
    report.update(
        train_prompts=len(train),
        heldout_prompts=len(test),
        steps=steps,
        best_steps=best_steps,
        val_kendall_tau=float(best_tau),
        train_s=train_s,
        loss_first=float(np.mean(losses[:20])),
        loss_last=float(np.mean(losses[-20:])),
    )
    return ranker, report


def define_flags() -> None:
    """Flags of the command line (not defined on import: bench_scheduling imports this)."""
    flags.DEFINE_string("samples", None, "Sample JSONL written by SampleLog.")
    flags.DEFINE_string("out", None, "Where to write the trained ranker (pickle); none = skip.")
    flags.DEFINE_integer("steps", 600, "Optimizer steps.")
    flags.DEFINE_float("holdout", 0.25, "Share of prompts held out for evaluation.")
    flags.DEFINE_integer("vocab_size", 49152, "Ranker embedding rows (ids beyond are hashed).")
    flags.DEFINE_integer("seed", 0, "Ranker seed.")


def main(argv):
    del argv
    if not FLAGS.samples:
        raise app.UsageError("--samples is required (a SampleLog JSONL)")
    examples = merge_by_prompt(read_sample_log(FLAGS.samples))
    cfg = RankerConfig(vocab_size=FLAGS.vocab_size, seed=FLAGS.seed)
    ranker, report = train_and_evaluate(examples, cfg, FLAGS.steps, FLAGS.holdout)
    if FLAGS.out:
        with open(FLAGS.out, "wb") as f:
            pickle.dump(
                {"config": dataclasses.asdict(cfg), "state": ranker.state(), "report": report}, f
            )
    print(json.dumps(report))


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("samples")
    app.run(main)
