"""The trainer's micro-batch: a typed pytree, and the host-side packer into shape buckets.

Layout. A row holds one or more *units*, each a prompt and the responses that
attend to it (`trainer.packing`):

    prompt[:-1] | prompt[-1] response_1 | prompt[-1] response_2 | ... | next unit | pad

With one response per unit and one unit per row this is the plain layout,
row b = prompt then response. Shared-prompt rows (`shared_prompt=True`) put a
GRPO group's G responses after one copy of its prompt; packing (`pack=True`)
puts several units in a row. `positions`, `prefix_ids` and `segment_ids`
describe the structure (`model.segments`: each response sees its prompt and
its own earlier tokens; RoPE positions restart at P - 1 for every response
segment, as if it followed the prompt directly).

Every per-token field is aligned with the *prediction position*: column t
describes the token `tokens[b, t + 1]` predicted from what column t sees (the
targets are the tokens shifted left by one). A response of length R whose
segment starts at column c (the copy of the prompt's last token) has its
tokens at columns c+1 .. c+R, and `loss_mask`, `advantages`, the log-probs,
values and returns are set at columns c .. c+R-1; in the plain layout
c = P - 1. A segment's last column (it would predict the next segment's first
token) is never trained. `rewards` holds each sequence's outcome reward at its
last loss column, the token-level reward GAE reads.

A sequence is (row, segment id >= 1): the `seq_mean_*` aggregations and GAE
read `segment_ids`, group whitening reads the per-column `group_ids`.

Response-only log-probs. `loss_columns[b]` lists row b's loss columns in order,
padded with T (out of range); its width L is the longest row's loss count
rounded up to a multiple of `loss_chunk` (the model's projection chunk), at
most T. The policy projects only those columns (`Llama.token_logprobs`), so a
(B, T) bucket compiles once per L, at most ceil(T / loss_chunk) widths.

Buckets. `make_batch` pads T up to one of `seq_buckets` that holds the
longest unit (`packing.plan`) and the rows up to one of `batch_buckets` (padding
rows and columns have all masks 0, `prefix_ids` and `group_ids` -1, and
contribute exactly nothing), so micro-batches of arbitrary sizes cost at most
len(seq_buckets) * len(batch_buckets) * ceil(max T / loss_chunk) compilations
of each jitted step.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from streamrl_jax.model import routes as routes_lib
from streamrl_jax.model.segments import Segments
from streamrl_jax.trainer import packing

ArrayLike = jax.Array | np.ndarray
_FLOATS = ("advantages", "old_logp", "behaviour_logp", "ref_logp", "old_values", "returns")
_INTS = ("positions", "prefix_ids", "segment_ids", "group_ids")


@flax.struct.dataclass
class TrainBatch:
    """One (micro-)batch of packed rows, host numpy or device arrays (module docstring).

    Attributes:
      tokens: i32[B, T] token ids of the units, right-padded with `pad_id`.
      attention_mask: bool[B, T] True on real (prompt or response) columns.
      positions: i32[B, T] RoPE position of each column (0 on padding).
      prefix_ids: i32[B, T] the column's unit within its row (-1 on padding).
      segment_ids: i32[B, T] 0 on a unit's prompt columns (and padding), k >= 1 on
        response segment k (unique within a row).
      group_ids: i32[B, T] the column's GRPO group, an id unique within its global
        batch (-1 on padding); the critic's group whitening reads it.
      loss_mask: bool[B, T] True at column t when tokens[t + 1] is a trained
        response token (a policy token: an episode's environment tokens are not).
      loss_columns: i32[B, L] the columns where `loss_mask` is True, in order,
        padded with T (module docstring).
      advantages: f32[B, T] advantage A_bt at loss positions (0 elsewhere).
      old_logp: f32[B, T] log pi_old of the response tokens (the PPO ratio's
        denominator); the behaviour log-probs in behaviour-as-old mode.
      behaviour_logp: f32[B, T] log-probs recorded by the sampler (log mu), for
        truncated importance sampling (`TrainerConfig.tis_cap`).
      ref_logp: f32[B, T] log pi_ref for the KL penalty (zeros when unused).
      old_values: f32[B, T] critic values V(s_t) when the sample was scored
        (PPO; zeros otherwise).
      returns: f32[B, T] GAE returns, the critic's regression targets (PPO).
      rewards: f32[B, T] each sequence's outcome reward at its last loss column
        (0 elsewhere).
      routes: routing replay (`model/routes.py`): u8/u16[B, T, L, k] the experts the
        token at column t went to in each layer where it was generated; `no_route` on
        padding, on a segment's last column (its token was never fed to the engine)
        and where a sample came without a record (the trainer routes those itself).
        None: no replay.
    """

    tokens: ArrayLike
    attention_mask: ArrayLike
    positions: ArrayLike
    prefix_ids: ArrayLike
    segment_ids: ArrayLike
    group_ids: ArrayLike
    loss_mask: ArrayLike
    loss_columns: ArrayLike
    advantages: ArrayLike
    old_logp: ArrayLike
    behaviour_logp: ArrayLike
    ref_logp: ArrayLike
    old_values: ArrayLike
    returns: ArrayLike
    rewards: ArrayLike
    routes: ArrayLike | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T) of the padded batch."""
        return tuple(self.tokens.shape)

    def segments(self) -> Segments:
        """The rows' positions and attention structure, for the model's forward."""
        return Segments(
            positions=self.positions, prefix_ids=self.prefix_ids, segment_ids=self.segment_ids
        )


def abstract_batch(b: int, t: int, routing_replay: routes_lib.Spec | None = None) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs, B = b rows of T = t columns (and L = T), with
    routes of `routing_replay`'s size when given (for `eval_shape`)."""
    bt = lambda dtype: jax.ShapeDtypeStruct((b, t), dtype)
    routes = None
    if routing_replay is not None:
        spec = routing_replay
        routes = jax.ShapeDtypeStruct((b, t, spec.layers, spec.k), spec.dtype)
    return TrainBatch(
        routes=routes,
        tokens=bt(np.int32),
        loss_columns=bt(np.int32),
        attention_mask=bt(np.bool_),
        loss_mask=bt(np.bool_),
        rewards=bt(np.float32),
        **{name: bt(np.int32) for name in _INTS},
        **{name: bt(np.float32) for name in _FLOATS},
    )


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
    policy_masks: Sequence[ArrayLike | None] | None = None,
    routes: Sequence[ArrayLike | None] | None = None,
    routing_replay: routes_lib.Spec | None = None,
    seq_buckets: Sequence[int],
    batch_buckets: Sequence[int],
    pad_id: int = 0,
    shared_prompt: bool = False,
    pack: bool = False,
    loss_chunk: int = 128,
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
      policy_masks: per sample, None or bool[response length]: False on the tokens an
        environment appended to an episode (tool results, chat scaffolding), which get
        loss mask 0 and are never trained; None: every response token is trained.
      routes: per sample, its `Sample.routes` (u8/u16[prompt + response - 1, L, k],
        checked against `routing_replay`) or None (no record: routed by the trainer).
      routing_replay: the model's route size when routes are replayed (the batch then
        has `routes`); None: no replay, `routes` must be None.
      seq_buckets: allowed T (ascending), e.g. `TrainerConfig.seq_buckets`.
      batch_buckets: allowed B (ascending), e.g. `TrainerConfig.batch_buckets`.
      pad_id: token id written into padding.
      shared_prompt: one unit per group (the samples with the same group id and
        prompt): the prompt once, then its responses; False = one unit per sample.
      pack: several units per row when they fit (first-fit decreasing); False =
        one unit per row.
      loss_chunk: `loss_columns`' width is a multiple of it (or T); the trainer's
        `logprob_chunk`.

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
    trained = _policy_masks(policy_masks, resp_lens)
    records = _route_records(routes, routing_replay, prompts, resp_lens)
    reward_N = _per_sample(rewards, n, np.float32, 0.0, "rewards")
    group_N = _per_sample(group_ids, n, np.int32, None, "group_ids")

    t, b, rows = packing.layout(
        prompts,
        resp_lens,
        group_N,
        seq_buckets=seq_buckets,
        batch_buckets=batch_buckets,
        shared_prompt=shared_prompt,
        pack=pack,
    )

    out = {
        "tokens": np.full((b, t), pad_id, np.int32),
        "attention_mask": np.zeros((b, t), bool),
        "loss_mask": np.zeros((b, t), bool),
        "rewards": np.zeros((b, t), np.float32),
        "positions": np.zeros((b, t), np.int32),
        "segment_ids": np.zeros((b, t), np.int32),
        "prefix_ids": np.full((b, t), -1, np.int32),
        "group_ids": np.full((b, t), -1, np.int32),
        **{k: np.zeros((b, t), np.float32) for k in fields},
    }
    if routing_replay is not None:
        spec = routing_replay
        out["routes"] = spec.empty(b * t).reshape(b, t, spec.layers, spec.k)
    for r, row in enumerate(rows):
        col, segment = 0, 0
        for u_index, unit in enumerate(row):
            prompt = prompts[unit.samples[0]]
            lp = prompt.size
            span = slice(col, col + unit.length)
            out["attention_mask"][r, span] = True
            out["prefix_ids"][r, span] = u_index
            out["tokens"][r, col : col + lp - 1] = prompt[:-1]
            out["positions"][r, col : col + lp - 1] = np.arange(lp - 1)
            if records is not None:  # the prompt's, from the unit's first sample
                out["routes"][r, col : col + lp - 1] = records[unit.samples[0]][: lp - 1]
            col += lp - 1
            for i in unit.samples:
                segment += 1
                lr = resp_lens[i]
                seg = slice(col, col + lr + 1)  # prompt[-1], then the response
                out["tokens"][r, col] = prompt[-1]
                out["tokens"][r, col + 1 : col + 1 + lr] = responses[i]
                out["positions"][r, seg] = np.arange(lp - 1, lp + lr)
                out["segment_ids"][r, seg] = segment
                out["group_ids"][r, seg] = group_N[i]
                out["loss_mask"][r, col : col + lr] = trained[i]
                if records is not None:  # prompt[-1] and the response but its last token
                    out["routes"][r, col : col + lr] = records[i][lp - 1 :]
                for k, v in fields.items():
                    if v is not None:
                        out[k][r, col : col + lr] = v[i]
                if trained[i].any():  # the outcome reward at the last trained column
                    out["rewards"][r, col + int(np.flatnonzero(trained[i])[-1])] = reward_N[i]
                col += lr + 1
            # The prompt's columns belong to the unit's group (its first sample's).
            out["group_ids"][r, span.start : span.start + lp - 1] = group_N[unit.samples[0]]
    out["loss_columns"] = loss_columns(out["loss_mask"], loss_chunk)
    return TrainBatch(**out)


def _route_records(
    routes: Sequence[ArrayLike | None] | None,
    spec: routes_lib.Spec | None,
    prompts: list[np.ndarray],
    resp_lens: list[int],
) -> list[np.ndarray] | None:
    """Per sample, its checked route record (`spec.empty` for a sample without one)."""
    if spec is None:
        if routes is not None:
            raise ValueError("routes given without routing_replay (the model's route size)")
        return None
    if routes is None:
        routes = [None] * len(prompts)
    if len(routes) != len(prompts):
        raise ValueError(f"routes: {len(routes)} entries for {len(prompts)} samples")
    out = []
    for i, (r, p, n) in enumerate(zip(routes, prompts, resp_lens, strict=True)):
        positions = p.size + n - 1  # every token but the response's last was fed
        out.append(spec.empty(positions) if r is None else spec.check(r, positions, f"routes[{i}]"))
    return out


def _policy_masks(masks: Sequence[ArrayLike | None] | None, lengths: list[int]) -> list:
    """Per sample, bool[response length]: which response tokens are trained."""
    if masks is None:
        return [np.ones((n,), bool) for n in lengths]
    if len(masks) != len(lengths):
        raise ValueError(f"policy_masks: {len(masks)} entries for {len(lengths)} samples")
    out = []
    for i, (m, n) in enumerate(zip(masks, lengths, strict=True)):
        m = np.ones((n,), bool) if m is None else np.asarray(m, bool).reshape(-1)
        if m.shape != (n,):
            raise ValueError(f"policy_masks[{i}]: shape {m.shape}, expected ({n},)")
        out.append(m)
    return out


def loss_columns(loss_mask_BxT: np.ndarray, chunk: int) -> np.ndarray:
    """i32[B, L]: each row's loss columns in order, padded with T; L = the longest row's
    count rounded up to a multiple of `chunk`, at most T (at least 1)."""
    b, t = loss_mask_BxT.shape
    counts = loss_mask_BxT.sum(axis=1)
    width = packing.loss_width(int(counts.max(initial=0)), t, chunk)
    out = np.full((b, width), t, np.int32)
    for row in range(b):
        cols = np.flatnonzero(loss_mask_BxT[row])
        out[row, : cols.size] = cols
    return out


def _per_sample(
    values: ArrayLike | None, n: int, dtype: type, default: float | None, name: str
) -> np.ndarray:
    """One value per sample: `values` checked to shape (n,), else `default` (None: 0..n-1)."""
    if values is None:
        return np.arange(n, dtype=dtype) if default is None else np.full((n,), default, dtype)
    out = np.asarray(values, dtype).reshape(-1)
    if out.shape != (n,):
        raise ValueError(f"{name}: shape {out.shape}, expected ({n},)")
    return out
