"""The trainer's micro-batch: a typed pytree, and a host-side packer into shape buckets.

Layout. Row b holds one sample: its prompt then its response, right-padded to
T. Every per-token field is aligned with the *prediction position*: column t
describes the token `tokens[b, t + 1]` predicted from `tokens[b, :t + 1]`
(the targets are the tokens shifted left by one). So for a prompt of length
P and a response of length R, the response tokens sit at columns P .. P+R-1
of `tokens`, and `loss_mask`, `advantages`, the log-probs, values and returns
are set at columns P-1 .. P+R-2.

Buckets. `make_batch` pads T up to the smallest of `seq_buckets` and B up to
the smallest of `batch_buckets` that fit (padding rows have all masks 0 and
contribute exactly nothing), so micro-batches of arbitrary sizes cost at most
len(seq_buckets) * len(batch_buckets) compilations of each jitted step.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

ArrayLike = jax.Array | np.ndarray


@flax.struct.dataclass
class TrainBatch:
    """One (micro-)batch of samples, host numpy or device arrays.

    Attributes:
      tokens: i32[B, T] prompt + response token ids, right-padded with `pad_id`.
      attention_mask: bool[B, T] True on real (prompt or response) tokens.
      loss_mask: bool[B, T] True at column t when tokens[t + 1] is a trained
        response token (all False on padding rows).
      advantages: f32[B, T] advantage A_bt at loss positions (0 elsewhere).
      old_logp: f32[B, T] log pi_old of the response tokens (the PPO ratio's
        denominator); the behaviour log-probs in behaviour-as-old mode.
      behaviour_logp: f32[B, T] log-probs recorded by the sampler (log mu), for
        truncated importance sampling (`TrainerConfig.tis_cap`).
      ref_logp: f32[B, T] log pi_ref for the KL penalty (zeros when unused).
      old_values: f32[B, T] critic values V(s_t) when the sample was scored
        (PPO; zeros otherwise).
      returns: f32[B, T] GAE returns, the critic's regression targets (PPO).
      rewards: f32[B] outcome reward of each sequence (0 on padding rows).
      group_ids: i32[B] each row's GRPO group, an id unique within its global batch
        (-1 on padding rows); the critic's group whitening reads it.
    """

    tokens: ArrayLike
    attention_mask: ArrayLike
    loss_mask: ArrayLike
    advantages: ArrayLike
    old_logp: ArrayLike
    behaviour_logp: ArrayLike
    ref_logp: ArrayLike
    old_values: ArrayLike
    returns: ArrayLike
    rewards: ArrayLike
    group_ids: ArrayLike

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of the padded batch."""
        return tuple(self.tokens.shape)


def abstract_batch(b: int, t: int) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs, B = b rows of T = t columns (for `eval_shape`)."""
    bt = lambda dtype: jax.ShapeDtypeStruct((b, t), dtype)
    floats = ("advantages", "old_logp", "behaviour_logp", "ref_logp", "old_values", "returns")
    return TrainBatch(
        tokens=bt(np.int32),
        attention_mask=bt(np.bool_),
        loss_mask=bt(np.bool_),
        rewards=jax.ShapeDtypeStruct((b,), np.float32),
        group_ids=jax.ShapeDtypeStruct((b,), np.int32),
        **{name: bt(np.float32) for name in floats},
    )


def bucket(n: int, buckets: Sequence[int], field: str) -> int:
    """Smallest bucket >= n.

    Raises:
      ValueError: naming `field` when n exceeds the largest bucket.
    """
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{field}: {n} exceeds the largest bucket {max(buckets)} ({list(buckets)})")


def _per_token(
    values: Sequence[ArrayLike] | ArrayLike | None, lengths: Sequence[int], name: str
) -> list[np.ndarray] | None:
    """Normalises a per-sample field to one f32 array per sample of its response length.

    Accepts None, one array per sample of that sample's response length, or a
    1-D array / sequence of scalars (one value per sequence, broadcast over
    its response tokens).
    """
    if values is None:
        return None
    if len(values) != len(lengths):
        raise ValueError(f"{name}: {len(values)} entries for {len(lengths)} samples")
    out = []
    for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
        v = np.asarray(v, np.float32)
        if v.ndim == 0:
            v = np.full((n,), v, np.float32)
        if v.shape != (n,):
            raise ValueError(f"{name}[{i}]: shape {v.shape}, expected ({n},) (response length)")
        out.append(v)
    return out


def make_batch(
    prompts: Sequence[ArrayLike],
    responses: Sequence[ArrayLike],
    *,
    behaviour_logp: Sequence[ArrayLike],
    advantages: Sequence[ArrayLike] | ArrayLike | None = None,
    rewards: ArrayLike | None = None,
    group_ids: ArrayLike | None = None,
    old_logp: Sequence[ArrayLike] | None = None,
    ref_logp: Sequence[ArrayLike] | None = None,
    old_values: Sequence[ArrayLike] | None = None,
    returns: Sequence[ArrayLike] | None = None,
    seq_buckets: Sequence[int],
    batch_buckets: Sequence[int],
    pad_id: int = 0,
) -> TrainBatch:
    """Packs samples into a bucket-padded host TrainBatch (numpy arrays).

    Args:
      prompts: N int arrays, prompt token ids (length >= 1).
      responses: N int arrays, response token ids (may be empty).
      behaviour_logp: N f32 arrays, the sampler's log-prob of each response token.
      advantages: per sequence (N scalars, broadcast to its response tokens) or
        per token (N arrays of response length); zeros if None.
      rewards: N outcome rewards (zeros if None).
      group_ids: N group ids, unique within the global batch (0 .. N-1 if None:
        every sample its own group).
      old_logp: per-token log pi_old; defaults to `behaviour_logp`
        (behaviour-as-old).
      ref_logp: per-token reference log-probs; zeros if None.
      old_values: per-token critic values; zeros if None.
      returns: per-token returns; zeros if None.
      seq_buckets: allowed T (ascending), e.g. `TrainerConfig.seq_buckets`.
      batch_buckets: allowed B (ascending), e.g. `TrainerConfig.batch_buckets`.
      pad_id: token id written into padding.

    Returns:
      A TrainBatch of numpy arrays with B, T from the buckets; move it with
      `jax.device_put(batch, trainer.batch_sharding)`.

    Raises:
      ValueError: mismatched lengths, an empty prompt, or no bucket that fits;
        the message names the field and sample.
    """
    n = len(prompts)
    if n == 0:
        raise ValueError("make_batch: no samples")
    if len(responses) != n:
        raise ValueError(f"responses: {len(responses)} entries for {n} prompts")
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    responses = [np.asarray(r, np.int32).reshape(-1) for r in responses]
    for i, p in enumerate(prompts):
        if p.size == 0:
            raise ValueError(f"prompts[{i}]: empty prompt (need >= 1 token to predict from)")
    resp_lens = [r.size for r in responses]
    behaviour = _per_token(behaviour_logp, resp_lens, "behaviour_logp")
    fields = {
        "advantages": _per_token(advantages, resp_lens, "advantages"),
        "old_logp": _per_token(old_logp, resp_lens, "old_logp") or behaviour,
        "behaviour_logp": behaviour,
        "ref_logp": _per_token(ref_logp, resp_lens, "ref_logp"),
        "old_values": _per_token(old_values, resp_lens, "old_values"),
        "returns": _per_token(returns, resp_lens, "returns"),
    }
    longest = max(p.size + r.size for p, r in zip(prompts, responses, strict=True))
    t = bucket(longest, seq_buckets, "sequence length (prompt + response)")
    b = bucket(n, batch_buckets, "micro-batch size")

    tokens = np.full((b, t), pad_id, np.int32)
    attention = np.zeros((b, t), bool)
    loss = np.zeros((b, t), bool)
    per_token = {k: np.zeros((b, t), np.float32) for k in fields}
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        lp, lr = p.size, r.size
        tokens[i, :lp] = p
        tokens[i, lp : lp + lr] = r
        attention[i, : lp + lr] = True
        loss[i, lp - 1 : lp - 1 + lr] = True
        for k, v in fields.items():
            if v is not None:
                per_token[k][i, lp - 1 : lp - 1 + lr] = v[i]
    reward_B, group_B = np.zeros((b,), np.float32), np.full((b,), -1, np.int32)
    group_B[:n] = np.arange(n)
    for name, values, out in (("rewards", rewards, reward_B), ("group_ids", group_ids, group_B)):
        if values is not None:
            values = np.asarray(values, out.dtype).reshape(-1)
            if values.shape != (n,):
                raise ValueError(f"{name}: shape {values.shape}, expected ({n},)")
            out[:n] = values
    return TrainBatch(
        tokens=tokens,
        attention_mask=attention,
        loss_mask=loss,
        rewards=reward_B,
        group_ids=group_B,
        **per_token,
    )
