"""The output-length ranker trained and judged on logged samples (`tools/train_ranker.py`,
`tools/bench_scheduling.py`, `tools/ranker_probe.py`).

Samples of one prompt (a GRPO group, or the same prompt in several steps) are merged into
one example whose target is their mean output length (`merge_by_prompt`); prompts are
split into train / held-out by a hash of the prompt id, or into cross-validation folds,
so no held-out prompt is ever trained on; 20 % of the training prompts validate (Kendall
tau every 10 steps) and the best checkpoint is kept (early stopping). Reports recall of
the true longest 20 / 10 / 5 % among the predicted longest and Kendall tau next to
reference predictors (prompt length; the training mean length of the prompt's task;
chance), the split-half repeatability of the target, and its noise ceiling
(`bootstrap_ceiling`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

import numpy as np

from streamrl_jax.scheduling.rank_metrics import kendall_tau, ranking_report, recall_at
from streamrl_jax.scheduling.ranker import Ranker, RankerConfig
from streamrl_jax.scheduling.sample_log import LoggedSample, group_by_prompt, read_sample_log

_EVAL_EVERY = 10  # optimizer steps between validation checks (early stopping)


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: its tokens, task and mean observed output length.

    Attributes:
      samples: the output length of each of its samples (in log order).
    """

    prompt_id: str
    tokens: tuple[int, ...]
    task: str | None
    length: float
    samples: tuple[int, ...] = ()


def merge_by_prompt(records: list[LoggedSample]) -> list[Example]:
    """One example per prompt_id, target = mean output length of its samples (the
    expected length is what a scheduler needs; one sample is a noisy draw of it).

    A prompt's samples are kept in request order, not log order: the log is written in
    completion order, so its first sample of a prompt is the shortest one, and any
    "first half vs second half" comparison in log order is biased (short vs long).
    """
    out = []
    for pid, rs in group_by_prompt(records).items():
        lens = tuple(r.output_length for r in rs)
        out.append(Example(pid, rs[0].prompt_tokens, rs[0].task, float(np.mean(lens)), lens))
    return out


def split_half_report(examples: list[Example]) -> dict[str, float] | None:
    """How repeatable the target is: the mean length of a prompt's first half of samples
    (request order) used as the predictor of the mean of its other half (prompts with
    >= 2 samples). A ranker cannot be expected to beat a second draw of the same prompt
    by much."""
    pairs = [
        (np.mean(e.samples[: len(e.samples) // 2]), np.mean(e.samples[len(e.samples) // 2 :]))
        for e in examples
        if len(e.samples) >= 2
    ]
    if len(pairs) < 10:
        return None
    first, second = np.array(pairs).T
    return ranking_report(second, first)


def is_heldout(prompt_id: str, share: float) -> bool:
    """Deterministic split by a hash of the prompt id."""
    h = int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < share


def fold_of(prompt_id: str, folds: int) -> int:
    """Deterministic fold of a prompt (a hash of its id)."""
    h = int.from_bytes(
        hashlib.blake2b(b"fold/" + prompt_id.encode(), digest_size=4).digest(), "little"
    )
    return h % folds


def fit_ranker(train: list[Example], cfg: RankerConfig, steps: int) -> tuple[Ranker, dict]:
    """Trains on `train` with early stopping on a validation split of it (Kendall tau
    every 10 steps, best kept): with a few hundred noisy lengths the ranker overfits
    within ~100 steps."""
    val = [e for e in train if is_heldout("val/" + e.prompt_id, 0.2)]
    fit = [e for e in train if not is_heldout("val/" + e.prompt_id, 0.2)]
    ranker = Ranker(cfg)
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
    return ranker, {
        "best_steps": best_steps,
        "val_kendall_tau": float(best_tau),
        "loss_first": float(np.mean(losses[:20])),
        "loss_last": float(np.mean(losses[-20:])),
    }


def random_recall_at_20(true: np.ndarray, rounds: int = 200) -> float:
    """Chance level of recall@20 (mean over random orders): with many ties at the top
    (responses cut at max_new_tokens) a random order already scores well on the tie-aware
    recall."""
    rng = np.random.default_rng(0)
    return float(np.mean([recall_at(true, rng.random(len(true)), 0.2) for _ in range(rounds)]))


def _reference_scores(train: list[Example], test: list[Example]) -> dict[str, np.ndarray]:
    """Predictors to compare with: prompt length, and the training mean of the task."""
    task_mean = collections.defaultdict(list)
    for e in train:
        task_mean[e.task].append(e.length)
    overall = float(np.mean([e.length for e in train]))
    return {
        "prompt_length": np.array([len(e.tokens) for e in test], np.float64),
        "task_mean": np.array(
            [np.mean(task_mean[e.task]) if e.task in task_mean else overall for e in test]
        ),
    }


def train_and_evaluate(
    examples: list[Example], cfg: RankerConfig, steps: int, holdout: float, folds: int = 1
) -> tuple[Ranker, dict]:
    """Held-out ranking quality; returns a ranker and the report.

    folds = 1: train on the prompts not held out (`holdout` share, by hash), report on the
    held-out ones; the ranker returned is that one. folds = k > 1: k-fold cross-validation
    by a hash of the prompt id; every prompt is scored by the ranker of the fold that
    did not train on it and the report pools these out-of-fold scores over all prompts
    (k times the held-out prompts of one split, so the recall of the top 20 % is much
    less noisy on a few hundred prompts); the ranker returned is the last fold's, and
    `report["heldout_scores"]` maps every prompt id to its out-of-fold score.

    Reference predictors (same prompts, the training side of each split): prompt length,
    the training mean length of the prompt's task, and chance.
    """
    splits = (
        [(lambda e: is_heldout(e.prompt_id, holdout))]
        if folds <= 1
        else [(lambda e, k=k: fold_of(e.prompt_id, folds) == k) for k in range(folds)]
    )
    t0 = time.time()
    test_all: list[Example] = []
    scores: dict[str, list[float]] = {"ranker": [], "prompt_length": [], "task_mean": []}
    fits = []
    for in_test in splits:
        train = [e for e in examples if not in_test(e)]
        test = [e for e in examples if in_test(e)]
        if len(train) < 2 or len(test) < 5:
            raise ValueError(
                f"train_ranker: {len(train)} train / {len(test)} held-out prompts; "
                "need more samples"
            )
        ranker, fit = fit_ranker(train, cfg, steps)
        fits.append(fit)
        test_all += test
        scores["ranker"] += ranker.score([e.tokens for e in test]).tolist()
        for name, v in _reference_scores(train, test).items():
            scores[name] += v.tolist()
    true = np.array([e.length for e in test_all])
    report = {name: ranking_report(true, np.array(v)) for name, v in scores.items()}
    report["random_recall_at_20"] = random_recall_at_20(true)
    samples_per_prompt = [len(e.samples) for e in examples if e.samples]
    report.update(
        target="mean output length over each prompt's samples",
        samples_per_prompt=float(np.mean(samples_per_prompt)) if samples_per_prompt else 1.0,
        split_half=split_half_report(test_all),
        evaluation=f"{folds}-fold cross-validation, pooled" if folds > 1 else "hash holdout",
        prompts=len(examples),
        heldout_prompts=len(test_all),
        steps=steps,
        best_steps=[f["best_steps"] for f in fits],
        val_kendall_tau=[f["val_kendall_tau"] for f in fits],
        loss_first=float(np.mean([f["loss_first"] for f in fits])),
        loss_last=float(np.mean([f["loss_last"] for f in fits])),
        train_s=time.time() - t0,
    )
    if folds > 1:
        report["heldout_scores"] = {
            e.prompt_id: s for e, s in zip(test_all, scores["ranker"], strict=True)
        }
    return ranker, report


def evaluate_separate(
    train: list[Example], test: list[Example], cfg: RankerConfig, steps: int
) -> tuple[Ranker, dict]:
    """Trains on `train` (its own 20 % validation split for early stopping) and reports on
    `test`, prompts of another dataset seed, never seen in training (ValueError when a
    prompt id is in both).

    Targets, and the noise ceilings that bound them (prompts with >= 2 samples):

    * each prompt's mean length over all its samples (the report's top-level entries,
      as in `train_and_evaluate`);
    * `one_sample`: each prompt's last sample (request order), next to `another_sample`,
      its first sample used as the predictor: how well a second draw of the *same*
      prompt ranks a draw, the most any predictor of the prompt's expected length can
      be expected to reach on a one-sample target (up to the draw's own noise);
    * `half_mean`: the mean of each prompt's second half of samples, next to
      `first_half_mean` (the split-half repeatability);
    * `ceiling_bootstrap`: what a perfect predictor of the expected length would score
      on the prompt-mean target (`bootstrap_ceiling`).
    """
    overlap = {e.prompt_id for e in train} & {e.prompt_id for e in test}
    if overlap:
        raise ValueError(
            f"train_ranker: the evaluation prompts share {len(overlap)} prompt ids with the "
            f"training ones (e.g. {sorted(overlap)[0]}): collect them with another dataset seed"
        )
    t0 = time.time()
    ranker, fit = fit_ranker(train, cfg, steps)
    pred = {"ranker": ranker.score([e.tokens for e in test])}
    pred |= _reference_scores(train, test)
    true = np.array([e.length for e in test])
    # The prompt-mean target at the top level (the same keys as train_and_evaluate's).
    report: dict = {k: ranking_report(true, v) for k, v in pred.items()}
    report["split_half"] = None
    multi = np.array([len(e.samples) >= 2 for e in test])
    if multi.sum() >= 10:
        tm = [e for e, m in zip(test, multi, strict=True) if m]
        last = np.array([e.samples[-1] for e in tm], np.float64)
        half = np.array([np.mean(e.samples[len(e.samples) // 2 :]) for e in tm])
        first_half = np.array([np.mean(e.samples[: len(e.samples) // 2]) for e in tm])
        sub = {k: v[multi] for k, v in pred.items()}
        report["one_sample"] = {k: ranking_report(last, v) for k, v in sub.items()} | {
            "another_sample": ranking_report(last, np.array([e.samples[0] for e in tm], float))
        }
        report["half_mean"] = {k: ranking_report(half, v) for k, v in sub.items()} | {
            "first_half_mean": ranking_report(half, first_half)
        }
        report["split_half"] = report["half_mean"]["first_half_mean"]
        report["ceiling_bootstrap"] = bootstrap_ceiling([e.samples for e in tm])
    report.update(
        random_recall_at_20=random_recall_at_20(true),
        target="mean output length over each prompt's samples",
        evaluation="trained on --samples, evaluated on --eval_samples (other prompts)",
        prompts=len(train),
        heldout_prompts=len(test),
        samples_per_prompt=float(np.mean([len(e.samples) for e in test])),
        steps=steps,
        best_steps=[fit["best_steps"]],
        val_kendall_tau=[fit["val_kendall_tau"]],
        train_s=time.time() - t0,
    )
    report["heldout_scores"] = {
        e.prompt_id: float(s) for e, s in zip(test, pred["ranker"], strict=True)
    }
    return ranker, report


def bootstrap_ceiling(samples: list[tuple[int, ...]], rounds: int = 400) -> dict[str, float]:
    """Noise ceiling of the prompt-mean target: each prompt's samples redrawn with
    replacement (as many as it has) and ranked by the prompt's own observed mean, a
    stand-in for a perfect predictor of the expected length (optimistic: the predictor
    is the distribution the draws come from). Mean and SD over `rounds` redraws."""
    rng = np.random.default_rng(0)
    k = min(len(s) for s in samples)
    s_pxk = np.array([s[:k] for s in samples], np.float64)
    mean_p = s_pxk.mean(1)
    recall, tau = [], []
    for _ in range(rounds):
        draw_p = np.take_along_axis(s_pxk, rng.integers(0, k, size=s_pxk.shape), 1).mean(1)
        recall.append(recall_at(draw_p, mean_p, 0.2))
        tau.append(kendall_tau(draw_p, mean_p))
    return {
        "recall_at_20": float(np.mean(recall)),
        "recall_at_20_sd": float(np.std(recall)),
        "kendall_tau": float(np.nanmean(tau)),
        "samples_per_prompt": float(k),
    }


def read_logs(paths: str) -> list[LoggedSample]:
    """Records of one or more sample logs (comma-separated paths)."""
    return [r for p in paths.split(",") if p for r in read_sample_log(p)]
