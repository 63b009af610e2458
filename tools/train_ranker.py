"""Trains the output-length ranker from a per-sample JSONL log and reports held-out quality.

Input: the JSONL that `scheduling.sample_log.SampleLog` writes (prompt_id, step,
prompt_tokens, output_length, ...). Samples of one prompt (a GRPO group, or the same prompt
in several steps) are merged into one example whose target is their mean output length;
prompts are split into train / held-out by a hash of prompt_id (`--holdout` share), or into
`--folds` cross-validation folds (every prompt scored by the ranker that did not see it,
pooled), so no held-out prompt is ever trained on; 20 % of the training prompts validate
(Kendall tau every 10 steps) and the best checkpoint is kept (early stopping). Reports
recall of the true longest 20 / 10 / 5 % among the predicted longest and Kendall tau on
the held-out prompts, next to reference predictors (prompt length; the training mean
length of the prompt's task; chance) and the split-half repeatability of the target
itself (one half of a prompt's samples predicting the other half), and writes the ranker
(arrays + JSON, `scheduling/ranker_file.py`; `load_ranker(path)` reads it back).

With `--eval_samples` (a log of other prompts, e.g. another dataset seed) the ranker trains
on all of `--samples` and is judged on those prompts only, on three targets: each prompt's
mean length, one sample, and the mean of half its samples, each next to its noise ceiling
(another sample of the same prompt; the other half of its samples).

    python tools/train_ranker.py --samples=/tmp/run/samples.jsonl --out=/tmp/ranker.pkl
    python tools/train_ranker.py --samples=/tmp/train_a.jsonl,/tmp/train_b.jsonl \
        --eval_samples=/tmp/eval_x4.jsonl
"""

from __future__ import annotations

import json

from absl import app, flags

from streamrl_bench.ranker_eval import (
    evaluate_separate,
    merge_by_prompt,
    read_logs,
    train_and_evaluate,
)
from streamrl_jax.scheduling.ranker import RankerConfig
from streamrl_jax.scheduling.ranker_file import save_ranker

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of the command line (not defined on import: bench_scheduling imports this)."""
    flags.DEFINE_string("samples", None, "Sample JSONL(s) written by SampleLog (comma list).")
    flags.DEFINE_string(
        "eval_samples", None, "Evaluate on these prompts (another dataset seed) instead."
    )
    flags.DEFINE_string("out", None, "Where to write the trained ranker (.npz); none = skip.")
    flags.DEFINE_integer("steps", 600, "Optimizer steps.")
    flags.DEFINE_float("holdout", 0.25, "Share of prompts held out for evaluation.")
    flags.DEFINE_integer("folds", 1, "> 1: k-fold cross-validation instead of one holdout.")
    flags.DEFINE_integer("vocab_size", 49152, "Ranker embedding rows (ids beyond are hashed).")
    flags.DEFINE_integer("seed", 0, "Ranker seed.")


def main(argv):
    del argv
    if not FLAGS.samples:
        raise app.UsageError("--samples is required (a SampleLog JSONL)")
    examples = merge_by_prompt(read_logs(FLAGS.samples))
    cfg = RankerConfig(vocab_size=FLAGS.vocab_size, seed=FLAGS.seed)
    if FLAGS.eval_samples:
        test = merge_by_prompt(read_logs(FLAGS.eval_samples))
        ranker, report = evaluate_separate(examples, test, cfg, FLAGS.steps)
    else:
        ranker, report = train_and_evaluate(examples, cfg, FLAGS.steps, FLAGS.holdout, FLAGS.folds)
    report.pop("heldout_scores", None)
    if FLAGS.out:
        save_ranker(FLAGS.out, ranker, report)
    print(json.dumps(report))


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("samples")
    app.run(main)
