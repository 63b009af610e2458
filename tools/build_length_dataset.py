"""Builds the shipped real-length dataset (`scheduling/length_data.py`) from --collect logs.

    python tools/build_length_dataset.py \
        --heldout=/tmp/heldout_s5x4.jsonl:2000 --train=/tmp/train_s6x1.jsonl:4000 \
        --out=data/lengths/smollm2_varied.jsonl.gz

Each `LOG:N` is a SampleLog that `tools/bench_scheduling.py --collect=N` wrote (N: the
dataset size it was collected with; the prompt ids say the dataset seed). Every prompt's
question text is regenerated from `streamrl_bench.collect_samples.VARIED_MIXTURE` at that
seed and size, re-tokenised with SmolLM2's chat template and checked against the logged
prompt tokens (a mismatch is an error: the log is not of this mixture). Held-out prompts must have
every sample (`--heldout_samples`): a collection stopped before its budget ran out
leaves its last prompts incomplete or absent, so each log is cut at its first
incomplete or absent prompt in submission order (a prefix: no bias towards prompts whose
samples happened to finish first); a training prompt whose tokens equal a held-out
prompt's (reasoning-gym repeats some short questions across seeds) is dropped from
training, so no held-out prompt is ever trained on. Prompts are written held-out first,
each split in submission order.
"""

from __future__ import annotations

import collections
import json

from absl import app, flags

from streamrl_bench import collect_samples
from streamrl_jax.data import tokenize
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import describe
from streamrl_jax.rewards.tasks import TaskDataset
from streamrl_jax.scheduling import length_data
from streamrl_jax.scheduling.sample_log import group_by_prompt, read_sample_log

FLAGS = flags.FLAGS
flags.DEFINE_list("heldout", [], "LOG:N of the held-out prompts (several samples each).")
flags.DEFINE_list("train", [], "LOG:N of the training prompts.")
flags.DEFINE_integer("heldout_samples", 4, "Samples every held-out prompt must have.")
flags.DEFINE_integer("train_samples", 1, "Samples per training prompt of its collection.")
flags.DEFINE_string("out", length_data.DEFAULT_PATH, "Dataset file to write (.jsonl.gz).")


def _prompts(spec: str, split: str, samples: int, tokenizer) -> list[length_data.PromptLengths]:
    """The prompts of one LOG:N (`samples` requests per prompt: request id // samples is
    the prompt's submission order)."""
    path, _, size = spec.rpartition(":")
    if not path or not size.isdigit():
        raise app.UsageError(f"{spec!r}: expected LOG:N (N = the --collect size)")
    groups = group_by_prompt(read_sample_log(path))
    datasets: dict[int, TaskDataset] = {}
    out = []
    for pid, rs in groups.items():
        name, seed, index = pid.split("/")
        if name != "mixture":
            raise ValueError(f"{path}: prompt id {pid!r} is not of the --collect mixture")
        if int(seed) not in datasets:
            datasets[int(seed)] = TaskDataset(
                {k: 1.0 for k in collect_samples.VARIED_MIXTURE},
                seed=int(seed),
                size=int(size),
                task_configs=collect_samples.VARIED_MIXTURE,
            )
        problem = datasets[int(seed)][int(index)]
        tokens = tokenize(problem, tokenizer).tokens
        if problem.prompt_id != pid or tokens != rs[0].prompt_tokens:
            raise ValueError(f"{path}: prompt {pid} does not match the regenerated question")
        order = int(rs[0].request_id) // samples
        out.append(
            length_data.PromptLengths(
                prompt_id=pid,
                split=split,
                order=order,
                task=rs[0].task,
                question=problem.question,
                prompt_tokens=tokens,
                lengths=tuple(r.output_length for r in rs),
                finish_reasons=tuple(r.finish_reason for r in rs),
            )
        )
    return out


def _prefix(spec: str, split: str, samples: int, tokenizer) -> list[length_data.PromptLengths]:
    """The prompts of one log up to (not including) its first incomplete prompt in
    submission order: one with fewer than `samples` samples, or none (absent)."""
    rows = sorted(_prompts(spec, split, samples, tokenizer), key=lambda p: p.order)
    short = [p.order for p in rows if len(p.lengths) != samples]
    short += sorted(set(range(rows[-1].order)) - {p.order for p in rows})
    return [p for p in rows if not short or p.order < min(short)]


def main(argv):
    del argv
    tok = describe(smollm2_gguf_path()).tokenizer
    heldout = [p for s in FLAGS.heldout for p in _prefix(s, "heldout", FLAGS.heldout_samples, tok)]
    seen = {p.prompt_tokens for p in heldout}
    train, dropped = [], 0
    for p in (p for s in FLAGS.train for p in _prefix(s, "train", FLAGS.train_samples, tok)):
        if p.prompt_tokens in seen:
            dropped += 1
            continue
        seen.add(p.prompt_tokens)
        train.append(p)
    rows = sorted(heldout, key=lambda p: p.order) + sorted(train, key=lambda p: p.order)
    length_data.write_length_dataset(FLAGS.out, rows)
    tasks = collections.Counter(p.task for p in rows)
    print(
        json.dumps(
            {
                "out": FLAGS.out,
                "heldout_prompts": len(heldout),
                "heldout_orders": [min(p.order for p in heldout), max(p.order for p in heldout)],
                "heldout_samples": sum(len(p.lengths) for p in heldout),
                "train_prompts": len(train),
                "train_samples": sum(len(p.lengths) for p in train),
                "train_dropped_as_heldout_duplicates": dropped,
                "tasks": dict(sorted(tasks.items())),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
