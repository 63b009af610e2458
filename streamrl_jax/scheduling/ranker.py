"""Output-length ranker: a small Flax NNX model scoring which prompts produce long outputs.

Only the *order* of the scores is used (the dispatcher sends the predicted-longest share to
the long-tail instances, and admits longest-predicted first), so the model is trained with
a pairwise ranking loss, not a regression:

    loss = mean over pairs (i, j) in a batch with L_i > L_j of  softplus(-(s_i - s_j))

(RankNet's logistic loss on score differences; pairs of equal length carry no order and are
masked out). s = f(prompt tokens) is:

    token ids -> embedding (E) -> conv1d (kernel 3, GELU, residual) over the prompt
      -> [masked sum / 32, masked mean, masked max, log(1 + prompt length)] -> MLP (H)
      -> scalar

A convolution over token embeddings sees local patterns (a 3-digit number, "step by
step", the task's template words); the sum pool counts them, the mean and max pools
describe the prompt's composition, the log-length feature its size. It trains in seconds
to minutes on CPU (~0.3 M params besides the embedding). Prompts longer than `max_tokens`
keep their *last* tokens: a chat template starts with a constant system prompt, the
question comes last. Ids >= `vocab_size` are hashed modulo it, so any tokenizer works (at
some loss of resolution).

Online refresh: `update(samples)` appends (prompt, length) pairs of finished samples to a
bounded buffer of the most recent ones and takes `steps_per_update` small optimizer steps
on it (each dominated by AdamW over the embedding; its cost: docs/scheduling.md), so
the caller's thread is never held for long and the ranker follows the length
distribution as the policy drifts. No thread is started here (only
scheduling/live.py starts threads); `score` and `update` may be called from different threads.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

_SCORE_BATCH = 128  # scoring pads to multiples of this, so one compiled shape serves all
_SUM_SCALE = 32.0  # sum pooling divided by this: O(1) features for prompts of ~10-300 tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankerConfig:
    """Shape and training of the ranker.

    Attributes:
      vocab_size: embedding rows; larger token ids are hashed modulo this.
      max_tokens: prompt tokens read (the last ones).
      embed_dim: token embedding width E.
      hidden_dim: MLP width H.
      learning_rate: AdamW step size.
      weight_decay: AdamW decoupled weight decay.
      batch_size: samples per training step (all their ordered pairs are used).
      buffer_size: recent (prompt, length) pairs kept for online refresh.
      steps_per_update: optimizer steps taken by each `update` call.
      min_buffer: `update` trains only once the buffer holds this many samples.
      seed: parameter init and batch sampling.
    """

    vocab_size: int
    max_tokens: int = 256
    embed_dim: int = 48
    hidden_dim: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 64
    buffer_size: int = 4096
    steps_per_update: int = 2
    min_buffer: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "max_tokens",
            "embed_dim",
            "hidden_dim",
            "batch_size",
            "buffer_size",
            "min_buffer",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"RankerConfig.{name} must be an int >= 1")
        if self.batch_size < 2:
            raise ValueError("RankerConfig.batch_size must be >= 2 (pairs need two samples)")
        if self.steps_per_update < 0:
            raise ValueError("RankerConfig.steps_per_update must be >= 0")
        if not self.learning_rate > 0:
            raise ValueError("RankerConfig.learning_rate must be > 0")


class RankerModel(nnx.Module):
    """prompt tokens -> scalar length score (higher = longer expected output)."""

    def __init__(self, cfg: RankerConfig, *, rngs: nnx.Rngs):
        e, h = cfg.embed_dim, cfg.hidden_dim
        self.embed = nnx.Embed(cfg.vocab_size, e, rngs=rngs)
        self.conv = nnx.Conv(e, e, kernel_size=(3,), padding="SAME", rngs=rngs)
        self.hidden = nnx.Linear(3 * e + 1, h, rngs=rngs)
        self.out = nnx.Linear(h, 1, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
        """Scores f32[B] of right-padded prompts (mask: True on real tokens)."""
        m_BxTx1 = mask_BxT[..., None].astype(jnp.float32)
        x_BxTxE = self.embed(tokens_BxT) * m_BxTx1
        x_BxTxE = x_BxTxE + jax.nn.gelu(self.conv(x_BxTxE)) * m_BxTx1
        n_Bx1 = jnp.maximum(m_BxTx1.sum(axis=1), 1.0)
        sum_BxE = x_BxTxE.sum(axis=1)
        max_BxE = jnp.where(m_BxTx1 > 0, x_BxTxE, -1e9).max(axis=1)
        # Sum pooling (scaled to O(1)) keeps counts (how many numbers, terms, steps), which
        # the mean loses; the mean keeps composition independent of length.
        feats = [sum_BxE / _SUM_SCALE, sum_BxE / n_Bx1, max_BxE, jnp.log1p(n_Bx1)]
        feats = jnp.concatenate(feats, axis=-1)
        return self.out(jax.nn.gelu(self.hidden(feats)))[:, 0]


def pairwise_logistic_loss(scores_B: jax.Array, log_len_B: jax.Array) -> jax.Array:
    """Mean softplus(-(s_i - s_j)) over pairs with L_i > L_j (0 when no pair is ordered)."""
    ordered_BxB = (log_len_B[:, None] > log_len_B[None, :]).astype(jnp.float32)
    diff_BxB = scores_B[:, None] - scores_B[None, :]
    total = (jax.nn.softplus(-diff_BxB) * ordered_BxB).sum()
    return total / jnp.maximum(ordered_BxB.sum(), 1.0)


def encode_prompts(
    prompts: Sequence[Sequence[int]], max_tokens: int, vocab_size: int, pad_to: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens i32[B', T], mask bool[B', T]) keeping each prompt's last `max_tokens` ids.

    B' is len(prompts) rounded up to a multiple of `pad_to` (padding rows are all-masked).
    """
    n = len(prompts)
    rows = n if pad_to is None else max(pad_to, -(-n // pad_to) * pad_to)
    tokens = np.zeros((rows, max_tokens), np.int32)
    mask = np.zeros((rows, max_tokens), bool)
    for i, p in enumerate(prompts):
        ids = np.asarray(p, np.int64)[-max_tokens:]
        if ids.size == 0:
            raise ValueError(f"ranker: prompt {i} is empty")
        tokens[i, : ids.size] = ids % vocab_size
        mask[i, : ids.size] = True
    return tokens, mask


_COMPILED: dict[Any, tuple[Any, Any]] = {}


def _compiled(cfg: RankerConfig, graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """Jitted score and train step, shared by rankers of equal shape and optimizer (a
    restored or re-created ranker compiles nothing new)."""
    key = (graphdef, cfg.vocab_size, cfg.max_tokens, cfg.learning_rate, cfg.weight_decay)
    if key not in _COMPILED:

        def score(params, tokens, mask):
            return nnx.merge(graphdef, params)(tokens, mask)

        def train_step(params, opt_state, tokens, mask, log_len):
            def loss_fn(p):
                return pairwise_logistic_loss(nnx.merge(graphdef, p)(tokens, mask), log_len)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # No donation: `score` may still read the previous params from another thread.
        _COMPILED[key] = (jax.jit(score), jax.jit(train_step))
    return _COMPILED[key]


class Ranker:
    """The ranker, its optimizer and its online-refresh buffer.

    Args:
      cfg: model and training configuration.
    """

    def __init__(self, cfg: RankerConfig):
        self.cfg = cfg
        model = RankerModel(cfg, rngs=nnx.Rngs(params=cfg.seed))
        self._graphdef, self._params = nnx.split(model)
        self._tx = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)
        self._opt_state = self._tx.init(self._params)
        self.steps = 0
        self._rng = np.random.default_rng(cfg.seed)
        self._buffer: collections.deque[tuple[tuple[int, ...], int]] = collections.deque(
            maxlen=cfg.buffer_size
        )
        self._lock = threading.Lock()  # guards params / opt state / buffer across threads
        self._score, self._train_step = _compiled(cfg, self._graphdef, self._tx)

    # ------------------------------------------------------------------ inference
    def score(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """f64[n] scores, higher = longer predicted output (only the order is meaningful)."""
        if not len(prompts):
            return np.zeros(0)
        tokens, mask = encode_prompts(
            prompts, self.cfg.max_tokens, self.cfg.vocab_size, pad_to=_SCORE_BATCH
        )
        with self._lock:
            params = self._params
        out = []
        for lo in range(0, len(tokens), _SCORE_BATCH):
            hi = lo + _SCORE_BATCH
            out.append(self._score(params, tokens[lo:hi], mask[lo:hi]))
        # One deliberate device->host sync for the whole batch of prompts.
        return np.asarray(jax.device_get(jnp.concatenate(out)), np.float64)[: len(prompts)]

    # ------------------------------------------------------------------ training
    def _step(self, prompts: Sequence[Sequence[int]], lengths: np.ndarray) -> jax.Array:
        tokens, mask = encode_prompts(prompts, self.cfg.max_tokens, self.cfg.vocab_size)
        log_len = np.log(np.maximum(np.asarray(lengths, np.float64), 1.0)).astype(np.float32)
        with self._lock:
            self._params, self._opt_state, loss = self._train_step(
                self._params, self._opt_state, tokens, mask, log_len
            )
            self.steps += 1
        return loss

    def fit(
        self, prompts: Sequence[Sequence[int]], lengths: Sequence[int], steps: int
    ) -> list[float]:
        """`steps` optimizer steps on random batches of (prompt, length); returns the losses.

        Raises:
          ValueError: prompts and lengths differ in count, or fewer than 2 samples.
        """
        n = len(prompts)
        if n != len(lengths) or n < 2:
            raise ValueError(f"ranker.fit: need >= 2 prompts with one length each ({n} prompts)")
        lengths = np.asarray(lengths)
        b = min(self.cfg.batch_size, n)
        losses = []
        for _ in range(steps):
            idx = self._rng.choice(n, size=b, replace=False)
            losses.append(self._step([prompts[i] for i in idx], lengths[idx]))
        # Fetch once at the end: the loop never waits on the device.
        return [float(x) for x in jax.device_get(losses)]

    def update(self, samples: Iterable[Any]) -> float | None:
        """Online refresh: buffer finished samples, then take `steps_per_update` steps.

        Args:
          samples: `generation.Sample`s (prompt ids and response length are read), or
            (prompt token ids, output length) pairs.

        Returns:
          The mean loss of the steps taken, or None when the buffer is still below
          `min_buffer` (or `steps_per_update` is 0).
        """
        for s in samples:
            if isinstance(s, tuple):
                prompt, length = s
            else:
                prompt, length = s.prompt, s.num_tokens
            with self._lock:
                self._buffer.append((tuple(int(t) for t in prompt), int(length)))
        with self._lock:
            buf = list(self._buffer)
        if len(buf) < max(self.cfg.min_buffer, 2) or self.cfg.steps_per_update == 0:
            return None
        prompts = [p for p, _ in buf]
        losses = self.fit(prompts, [n for _, n in buf], self.cfg.steps_per_update)
        return float(np.mean(losses))

    @property
    def buffer_size(self) -> int:
        with self._lock:
            return len(self._buffer)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Host-side pytree for checkpoints: params, optimizer state, step count.

        The online buffer is not included: it refills from the next step's samples.
        """
        with self._lock:
            params, opt_state = self._params, self._opt_state
        return {
            "params": jax.device_get(nnx.to_pure_dict(params)),
            "opt_state": jax.device_get(opt_state),
            "steps": np.asarray(self.steps, np.int64),
        }

    def params(self) -> dict[str, Any]:
        """The parameters as a host pytree (what a trainer sends to the dispatchers of
        other processes after a refresh)."""
        with self._lock:
            return jax.device_get(nnx.to_pure_dict(self._params))

    def set_params(self, params: dict[str, Any], steps: int) -> None:
        """Scores with `params` (another process's refresh, `params()`); the optimizer
        state stays (this ranker does not train). ValueError on another shape."""
        with self._lock:
            ref = nnx.to_pure_dict(self._params)
            if jax.tree.structure(ref) != jax.tree.structure(params) or any(
                np.shape(a) != np.shape(b)
                for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True)
            ):
                raise ValueError(f"ranker.set_params: not the params of RankerConfig {self.cfg}")
            nnx.replace_by_pure_dict(self._params, jax.tree.map(jnp.asarray, params))
            self.steps = steps

    def load_state(self, state: dict[str, Any]) -> None:
        """Restores what `state()` returned (raises ValueError on a shape mismatch)."""
        with self._lock:
            ref = nnx.to_pure_dict(self._params)
            got = state["params"]
            if jax.tree.structure(ref) != jax.tree.structure(got) or any(
                np.shape(a) != np.shape(b)
                for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True)
            ):
                raise ValueError(
                    "ranker.load_state: params differ in structure or shape from "
                    f"RankerConfig {self.cfg} (a checkpoint of a differently sized ranker?)"
                )
            params = jax.tree.map(jnp.asarray, got)
            nnx.replace_by_pure_dict(self._params, params)
            # Leaves in order: a checkpointer may hand back optax's namedtuples as dicts.
            ref_leaves, ref_opt = jax.tree.flatten(self._opt_state)
            got_leaves = jax.tree.leaves(state["opt_state"])
            if [np.shape(x) for x in ref_leaves] != [np.shape(x) for x in got_leaves]:
                raise ValueError("ranker.load_state: optimizer state differs in shape")
            self._opt_state = jax.tree.unflatten(ref_opt, [jnp.asarray(x) for x in got_leaves])
            self.steps = int(state["steps"])
