"""Probe: does the frozen policy's own representation of a prompt rank output lengths?

Features: SmolLM2-135M-Instruct's last-layer hidden states (after the final RMSNorm) of
each prompt, mean-pooled over its tokens and at its last token (the chat template ends
with "<|im_start|>assistant\\n", so the last position is where the answer starts). Heads,
trained per fold of the same 5-fold CV as `tools/train_ranker.py --folds=5`
(`streamrl_bench.ranker_eval`; same hash folds, same 20 % validation split of each
training fold, same pooled metrics):

* ridge regression on log(length) (alpha picked on the validation split, then refit on
  the whole training fold), on the mean, the last and both features, and on both plus a
  one-hot of the task;
* a small Flax NNX head (linear, or one hidden GELU layer) trained with the ranker's
  pairwise logistic loss (`ranker.pairwise_logistic_loss`), AdamW with strong weight
  decay, full batch, early stopping on the validation Kendall tau (best kept).

Next to them, on the same folds: the training mean length of the prompt's task, the
prompt length, chance, and the split-half repeatability of the target. Prints one JSON
line. Features are cached (`--cache`), so changing the heads does not re-run the model.

    nice -n 19 python tools/ranker_probe.py --samples=/tmp/smollm2_varied.jsonl

Result on /tmp/smollm2_varied.jsonl: a negative result (docs/benchmarks/scheduling.md,
"Frozen-policy features").
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from streamrl_bench.ranker_eval import (
    Example,
    _reference_scores,
    fold_of,
    is_heldout,
    merge_by_prompt,
    random_recall_at_20,
    split_half_report,
)
from streamrl_jax.model import layers
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained
from streamrl_jax.scheduling.rank_metrics import kendall_tau, ranking_report
from streamrl_jax.scheduling.ranker import pairwise_logistic_loss
from streamrl_jax.scheduling.sample_log import read_sample_log

FLAGS = flags.FLAGS
flags.DEFINE_string("samples", None, "Sample JSONL written by SampleLog.")
flags.DEFINE_string("model", None, "GGUF / HF checkpoint of the policy; default SmolLM2.")
flags.DEFINE_string("cache", "/tmp/ranker_probe_layers.npz", "Feature cache ('' = none).")
flags.DEFINE_integer("folds", 5, "Cross-validation folds (hash of prompt_id).")
flags.DEFINE_integer("steps", 400, "Optimizer steps of the NNX heads.")
flags.DEFINE_integer("hidden", 32, "Hidden width of the MLP head.")
flags.DEFINE_float("weight_decay", 0.3, "AdamW decoupled weight decay of the NNX heads.")
flags.DEFINE_integer("seeds", 3, "NNX heads are trained with seeds 0..seeds-1.")

_BUCKET = 32  # prompts padded to a multiple of this many tokens (few compiled shapes)
_BATCH = 16
_EVAL_EVERY = 10
_ALPHAS = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 1e4)


# ---------------------------------------------------------------------- features
def policy_features(examples: list[Example], path: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer (mean-pooled f32[L, n, E], last-token f32[L, n, E]) hidden states.

    Layer l is the residual stream after block l (the same blocks, mask and positions as
    `Llama.hidden_states`), RMS-normalized; the last layer uses the model's final norm
    scale, so it is the representation the LM head reads.
    """
    pre = load_pretrained(path)
    cfg = pre.cfg

    @jax.jit
    def pooled(params, tokens_BxT, mask_BxT):
        model = nnx.merge(pre.graphdef, params)
        positions_BxT = jnp.maximum(jnp.cumsum(mask_BxT, axis=-1) - 1, 0)
        t = tokens_BxT.shape[1]
        attn_mask = jnp.tril(jnp.ones((t, t), bool))[None] & mask_BxT[:, None, :]
        cos, sin = layers.rope_tables(positions_BxT, layers.rope_inv_freq(cfg))
        m_BxTx1 = mask_BxT[..., None].astype(jnp.float32)
        last_B = mask_BxT.sum(1) - 1  # right padding: the last real token

        def body(x_BxTxE, p):
            x_BxTxE, _ = layers.block(x_BxTxE, p, cfg, cos, sin, attn_mask)
            h_BxTxE = layers.rms_norm(x_BxTxE, jnp.ones((cfg.hidden_size,)), cfg.rms_norm_eps)
            mean_BxE = (h_BxTxE * m_BxTx1).sum(1) / jnp.maximum(m_BxTx1.sum(1), 1.0)
            last_BxE = jnp.take_along_axis(h_BxTxE, last_B[:, None, None], axis=1)[:, 0]
            return x_BxTxE, (mean_BxE, last_BxE)

        x0 = model.embed_tokens(tokens_BxT)
        _, (mean_LxBxE, last_LxBxE) = jax.lax.scan(body, x0, model.layers.arrays())
        scale_E = model.final_norm[...].astype(jnp.float32)
        return mean_LxBxE.at[-1].multiply(scale_E), last_LxBxE.at[-1].multiply(scale_E)

    n, e, nl = len(examples), cfg.hidden_size, cfg.num_layers
    mean, last = np.zeros((nl, n, e), np.float32), np.zeros((nl, n, e), np.float32)
    order = sorted(range(n), key=lambda i: len(examples[i].tokens))
    for lo in range(0, n, _BATCH):
        idx = order[lo : lo + _BATCH]
        t = -(-max(len(examples[i].tokens) for i in idx) // _BUCKET) * _BUCKET
        tokens = np.zeros((_BATCH, t), np.int32)
        mask = np.zeros((_BATCH, t), bool)
        for r, i in enumerate(idx):
            ids = examples[i].tokens
            tokens[r, : len(ids)], mask[r, : len(ids)] = ids, True
        mask[len(idx) :, 0] = True  # padding rows: one dummy token, output discarded
        mean_b, last_b = jax.device_get(pooled(pre.params, tokens, mask))
        mean[:, idx], last[:, idx] = mean_b[:, : len(idx)], last_b[:, : len(idx)]
    return mean, last


# ---------------------------------------------------------------------- heads
def _standardize(x_tr: np.ndarray, x_te: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    return (x_tr - mu) / sd, (x_te - mu) / sd


def _ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """Ridge on centred y (features already standardized): (w, intercept)."""
    b = float(y.mean())
    w = np.linalg.solve(x.T @ x + alpha * np.eye(x.shape[1]), x.T @ (y - b))
    return w, b


def ridge_scores(x_tr, y_tr, val, x_te, offset_tr=0.0, offset_te=0.0):
    """Alpha by validation Kendall tau (on log length), refit on all of train.

    With offsets (log of the task's training mean length), the ridge fits the residual
    log length and the score is offset + prediction: the features only rank within a task.
    Returns (scores, alpha, validation tau).
    """
    x_tr, x_te = _standardize(x_tr, x_te)
    log_y = np.log(np.maximum(y_tr, 1.0)) - offset_tr
    off_val = offset_tr[val] if np.ndim(offset_tr) else offset_tr
    best = (-np.inf, _ALPHAS[0])
    for a in _ALPHAS:
        w, b = _ridge(x_tr[~val], log_y[~val], a)
        tau = kendall_tau(y_tr[val], x_tr[val] @ w + b + off_val)
        if np.isfinite(tau) and tau > best[0]:
            best = (tau, a)
    w, b = _ridge(x_tr, log_y, best[1])
    return x_te @ w + b + offset_te, best[1], best[0]


class ProbeHead(nnx.Module):
    """features -> scalar score: linear (hidden = 0) or one GELU hidden layer."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(dim, hidden, rngs=rngs) if hidden else None
        self.out = nnx.Linear(hidden or dim, 1, rngs=rngs)

    def __call__(self, x_BxD: jax.Array) -> jax.Array:
        if self.hidden is not None:
            x_BxD = jax.nn.gelu(self.hidden(x_BxD))
        return self.out(x_BxD)[:, 0]


def head_scores(x_tr, y_tr, val, x_te, hidden: int, seed: int) -> tuple[np.ndarray, int]:
    """Pairwise-loss NNX head, full batch on the fit split, best validation tau kept."""
    x_tr, x_te = _standardize(x_tr, x_te)
    fit = ~val
    graphdef, params = nnx.split(ProbeHead(x_tr.shape[1], hidden, rngs=nnx.Rngs(seed)))
    tx = optax.adamw(1e-3, weight_decay=FLAGS.weight_decay)
    opt_state = tx.init(params)
    x_fit, log_fit = jnp.asarray(x_tr[fit]), jnp.log(jnp.maximum(jnp.asarray(y_tr[fit]), 1.0))

    @jax.jit
    def steps(params, opt_state):
        def one(carry, _):
            p, s = carry
            loss, g = jax.value_and_grad(
                lambda p: pairwise_logistic_loss(nnx.merge(graphdef, p)(x_fit), log_fit)
            )(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        (params, opt_state), _ = jax.lax.scan(one, (params, opt_state), length=_EVAL_EVERY)
        return params, opt_state

    score = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    best_tau, best_params, best_steps = -np.inf, params, 0
    for done in range(_EVAL_EVERY, FLAGS.steps + 1, _EVAL_EVERY):
        params, opt_state = steps(params, opt_state)
        tau = kendall_tau(y_tr[val], np.asarray(score(params, x_tr[val])))
        if np.isfinite(tau) and tau > best_tau:
            best_tau, best_params, best_steps = tau, params, done
    return np.asarray(score(best_params, x_te), np.float64), best_steps


# ---------------------------------------------------------------------- main
def main(argv):
    del argv
    t0 = time.time()
    examples = merge_by_prompt(read_sample_log(FLAGS.samples))
    ids = np.array([e.prompt_id for e in examples])
    cached = FLAGS.cache and os.path.exists(FLAGS.cache) and np.load(FLAGS.cache)
    if cached and list(cached["ids"]) == list(ids):
        mean, last = cached["mean"], cached["last"]
    else:
        mean, last = policy_features(examples, FLAGS.model or smollm2_gguf_path())
        if FLAGS.cache:
            np.savez(FLAGS.cache, ids=ids, mean=mean, last=last)
    feature_s = time.time() - t0
    nl = mean.shape[0]
    y = np.array([e.length for e in examples])
    mid = nl // 2
    feats = {  # fixed choices (no peeking at the test folds)
        "final_mean": mean[-1],
        "final_last": last[-1],
        "final_both": np.concatenate([mean[-1], last[-1]], 1),
        f"L{nl // 4}_mean": mean[nl // 4 - 1],
        f"L{mid}_mean": mean[mid - 1],
        f"L{mid}_both": np.concatenate([mean[mid - 1], last[mid - 1]], 1),
        f"L{3 * nl // 4}_mean": mean[3 * nl // 4 - 1],
    }
    fold = np.array([fold_of(e.prompt_id, FLAGS.folds) for e in examples])
    val_all = np.array([is_heldout("val/" + e.prompt_id, 0.2) for e in examples])
    order, scores, chosen = [], {}, {}

    def add(name, v):
        scores.setdefault(name, []).extend(np.asarray(v, np.float64).tolist())

    for k in range(FLAGS.folds):
        tr, te = fold != k, fold == k
        order += np.flatnonzero(te).tolist()
        train = [e for e, m in zip(examples, tr, strict=True) if m]
        test = [e for e, m in zip(examples, te, strict=True) if m]
        for name, v in _reference_scores(train, test).items():
            add(name, v)
        log_task_tr = np.log(_reference_scores(train, train)["task_mean"])
        log_task_te = np.log(_reference_scores(train, test)["task_mean"])
        for name, x in feats.items():
            s, a, _ = ridge_scores(x[tr], y[tr], val_all[tr], x[te])
            add(f"ridge_{name}", s)
            chosen.setdefault(f"ridge_{name}_alpha", []).append(a)
        for name in ("final_both", f"L{mid}_both"):
            x = feats[name]
            s, _, _ = ridge_scores(x[tr], y[tr], val_all[tr], x[te], log_task_tr, log_task_te)
            add(f"task_mean+ridge_residual_{name}", s)
        # Layer picked per fold on the validation split only.
        per_layer = [ridge_scores(mean[i][tr], y[tr], val_all[tr], mean[i][te]) for i in range(nl)]
        best = int(np.argmax([r[2] for r in per_layer]))
        add("ridge_mean_layer_by_val", per_layer[best][0])
        chosen.setdefault("ridge_mean_layer_by_val", []).append(best + 1)
        for fname in ("final_both", f"L{mid}_both"):
            x = feats[fname]
            for name, hidden in (("linear", 0), ("mlp", FLAGS.hidden)):
                for seed in range(FLAGS.seeds):
                    s, n = head_scores(x[tr], y[tr], val_all[tr], x[te], hidden, seed)
                    add(f"nnx_{name}_{fname}/seed{seed}", s)
                    chosen.setdefault(f"nnx_{name}_{fname}_best_steps", []).append(n)
    true = y[order]
    report = {name: ranking_report(true, np.array(v)) for name, v in scores.items()}
    for name in sorted({n.split("/")[0] for n in report if "/seed" in n}):
        runs = [report.pop(f"{name}/seed{s}") for s in range(FLAGS.seeds)]
        report[name] = {
            key: float(np.mean([r[key] for r in runs])) for key in runs[0] if key != "n"
        } | {f"{key}_sd": float(np.std([r[key] for r in runs])) for key in runs[0] if key != "n"}
    report["random_recall_at_20"] = random_recall_at_20(true)
    report.update(
        split_half=split_half_report(examples),
        chosen=chosen,
        evaluation=f"{FLAGS.folds}-fold cross-validation, pooled",
        prompts=len(examples),
        feature_dim=int(mean.shape[-1]),
        layers=nl,
        feature_s=feature_s,
        total_s=time.time() - t0,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    flags.mark_flag_as_required("samples")
    app.run(main)
