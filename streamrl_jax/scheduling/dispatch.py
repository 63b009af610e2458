"""Skewness-aware dispatch of a global batch to generation instances (Algorithm 2).

The plan, per global batch of n prompts over N instances:

1. Score every prompt with the ranker (higher = longer predicted output); the top
   `alpha` share (20 %) is the *long tail*, the rest *regular*.
2. Representative lengths from the recent length distribution: L_long = P90,
   L_reg = P50 (`long_quantile`, `regular_quantile`).
3. Predicted latency of an instance given M prompts of representative length L:

       T(M, L) = PTL(BS, L / 2) * L * ceil(M / BS),   BS = min(M, BS_max(L))

   PTL(BS, ctx) is the per-token (decode step) latency at batch BS and mean context ctx,
   from a profile (`PTLProfile`, measured by tools/profile_ptl.py); BS_max(L) is the
   instance's slot count, further capped by its KV-cache memory:
   floor(memory / (kv_bytes_per_token * (prompt + L))) (`kv_slot_cap`).
4. Enumerate N_long = 1 .. N-1 (the long tail takes the N_long instances with the fewest
   slots: small batches are what it needs, the big ones pack the regular prompts); inside a
   group, prompts are spread so the group's slowest instance is as fast as possible; pick
   the N_long minimising the objective: "sum" of the two groups' latencies (the paper's
   pseudocode) or "max" (the makespan). Both are implemented and measured
   (tools/bench_scheduling.py); the default is the one that measured better.
5. Inside an instance, admission is longest-predicted first (LPT): each request's
   `priority` is its score, and an engine with `admission="lpt"` admits the highest
   priority whenever a slot frees.

Steps 1-4 are the `"groups"` planner (the paper's). Its premise is a GPU decode step
whose cost falls with the *active* batch: a long-tail instance left with a few long
samples then runs them fast. An engine that decodes every KV slot every step
(`static_batch`; this repo's before issue 16 added decode buckets, `--nodecode_buckets`
in the benches) costs PTL(BS_max) per step however few samples it holds,
and isolating the long tail buys nothing; what remains is balancing work. The `"lpt"`
planner does that with the same inputs:

    L_r = Q_recent(1 - (r + 1/2) / n)     expected length of the prompt ranked r-th
                                          (0 = longest) of n: the ranker gives only the
                                          order, the recent distribution the lengths
                                          (equal scores share their ranks' mean)
    for r = 0, 1, ..., n-1:               longest first (list scheduling)
        k = argmin_k  free_k + L_r * PTL_k    free_k: the earliest a slot of instance k
        free_k <- free_k + L_r * PTL_k        frees; PTL_k = PTL(BS_max_k, L / 2)

which is continuous batching with LPT admission played forward on the expected lengths
(exact for fixed-shape steps; with `static_batch=False` it prices every step at PTL(BS_max)).
`tools/bench_scheduling.py` measures both planners on the engine.

Baselines: `RandomDispatcher` (shuffled, dealt in proportion to slot counts, priority 0 so
an LPT engine degenerates to FIFO) and the oracle (`plan_scores` with the true lengths as
scores). Pure numpy host code; the pod planner's simulator
(`streamrl_podplan.simulation.dispatch`) plans with `plan_from_scores` too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np

OBJECTIVES = ("max", "sum")
PLANNERS = ("groups", "lpt")
PTL = Callable[[int, float], float]  # (batch size, mean context tokens) -> seconds per step


@dataclasses.dataclass(frozen=True)
class PTLProfile:
    """Per-token latency PTL(BS) from measurements: linear in BS between measured points,
    the last slope beyond them, plus an optional per-context-token term.

    Attributes:
      batch_sizes: measured batch sizes, ascending.
      per_token_s: seconds per decode step at each batch size.
      per_context_token_s: extra seconds per step per token of mean context.
    """

    batch_sizes: tuple[int, ...]
    per_token_s: tuple[float, ...]
    per_context_token_s: float = 0.0

    def __post_init__(self):
        bs = np.asarray(self.batch_sizes)
        if len(bs) < 1 or len(bs) != len(self.per_token_s) or (np.diff(bs) <= 0).any():
            raise ValueError(
                "PTLProfile: batch_sizes must be ascending and match per_token_s in length"
            )

    def __call__(self, batch: int, ctx: float = 0.0) -> float:
        bs, pt = np.asarray(self.batch_sizes, float), np.asarray(self.per_token_s, float)
        if len(bs) > 1 and batch > bs[-1]:
            slope = (pt[-1] - pt[-2]) / (bs[-1] - bs[-2])
            base = pt[-1] + slope * (batch - bs[-1])
        else:
            base = float(np.interp(batch, bs, pt))
        return float(base + self.per_context_token_s * ctx)

    @classmethod
    def from_json(cls, path: str) -> PTLProfile:
        """Reads tools/profile_ptl.py's JSON ({"batch_sizes", "per_token_s", ...})."""
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        for key in ("batch_sizes", "per_token_s"):
            if key not in d:
                raise ValueError(f"{path}: PTL profile field {key!r} is missing")
        return cls(
            tuple(int(b) for b in d["batch_sizes"]),
            tuple(float(t) for t in d["per_token_s"]),
            float(d.get("per_context_token_s", 0.0)),
        )


def kv_bytes_per_token(model_cfg) -> int:
    """KV-cache bytes one token occupies: 2 (k, v) x layers x kv heads x head dim x dtype."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[model_cfg.dtype]
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


def kv_slot_cap(kv_bytes: int, memory_bytes: float, seq_len: float) -> int:
    """Sequences of `seq_len` tokens whose KV cache fits in `memory_bytes` (at least 1)."""
    if kv_bytes <= 0 or seq_len <= 0:
        raise ValueError("kv_slot_cap: kv_bytes and seq_len must be > 0")
    return max(1, int(memory_bytes // (kv_bytes * seq_len)))


def instance_latency(
    m: int, l_rep: float, bs_max: int, ptl: PTL, static_batch: bool = False
) -> float:
    """Predicted seconds for one instance to decode `m` prompts of length `l_rep`.

    With `static_batch` every step costs PTL(bs_max): an engine whose decode step has a
    fixed shape (this repo's, one row per KV slot) pays for idle slots too.
    """
    if m == 0:
        return 0.0
    bs = min(m, bs_max)
    # Mean context over a response of length l_rep is about l_rep / 2.
    return ptl(bs_max if static_batch else bs, l_rep / 2) * l_rep * math.ceil(m / bs)


def spread(
    m: int, caps: Sequence[int], l_rep: float, ptl: PTL, static_batch: bool = False
) -> list[int]:
    """Counts per instance (summing to m) that minimise the slowest instance's latency."""
    k = len(caps)
    if len(set(caps)) == 1:  # equal instances: an even split is optimal
        return [m // k + (i < m % k) for i in range(k)]
    counts = [0] * k
    for _ in range(m):  # greedy: each prompt to the instance that stays fastest with it
        i = min(
            range(k),
            key=lambda j: (
                instance_latency(counts[j] + 1, l_rep, caps[j], ptl, static_batch),
                counts[j],
                j,
            ),
        )
        counts[i] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Where each request of a global batch goes and in which order it is admitted.

    Attributes:
      instance_per_request: target instance of request i (`GenerationService.submit`).
      priority_per_request: admission priority (predicted length score; 0 = FIFO).
      long_instances: the instances serving the long tail (empty for the baseline).
      predicted_s: Algorithm 2's predicted latency: {"long", "regular", "cost"}.
      representative: (L_long, L_reg) used for the prediction.
    """

    instance_per_request: list[int]
    priority_per_request: list[float]
    long_instances: tuple[int, ...] = ()
    predicted_s: dict[str, float] = dataclasses.field(default_factory=dict)
    representative: tuple[float, float] = (0.0, 0.0)

    def orders(self, num_instances: int) -> list[list[int]]:
        """Per instance, its request indices in admission order (highest priority first,
        ties in submission order), as an LPT engine admits them."""
        out: list[list[int]] = [[] for _ in range(num_instances)]
        for i in sorted(
            range(len(self.instance_per_request)), key=lambda i: -self.priority_per_request[i]
        ):
            out[self.instance_per_request[i]].append(i)
        return out


def plan_from_scores(
    scores: np.ndarray,
    recent_lengths: np.ndarray,
    instance_caps: Sequence[int] | Callable[[float], Sequence[int]],
    ptl: PTL,
    *,
    alpha: float = 0.2,
    objective: str = "max",
    long_quantile: float = 0.9,
    regular_quantile: float = 0.5,
    static_batch: bool = False,
    planner: str = "groups",
) -> DispatchPlan:
    """Algorithm 2 over numbers (see the module docstring).

    Args:
      scores: f[n] predicted-length scores (higher = longer).
      recent_lengths: recent observed output lengths (representative lengths).
      instance_caps: BS_max per instance, or a function L -> BS_max per instance.
      ptl: PTL(batch, mean context) in seconds.
      alpha: long-tail share.
      objective: "max" (makespan of the two groups) or "sum" (the paper's pseudocode).
      long_quantile, regular_quantile: quantiles of `recent_lengths` for L_long, L_reg.
      static_batch: cost every step at the instance's full batch (see `instance_latency`).
      planner: "groups" (long-tail and regular instance groups, the paper's) or "lpt"
        (list scheduling of rank-quantile expected lengths; `alpha`, `objective` and the
        quantiles are unused).
    """
    if planner not in PLANNERS:
        raise ValueError(f"dispatch planner must be one of {PLANNERS}, got {planner!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"dispatch objective must be one of {OBJECTIVES}, got {objective!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"dispatch alpha must be in (0, 1), got {alpha}")
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    recent = np.asarray(recent_lengths, np.float64)
    if not len(recent):
        raise ValueError("dispatch: recent_lengths is empty (observe some lengths first)")
    l_long = float(np.quantile(recent, long_quantile))
    l_reg = float(np.quantile(recent, regular_quantile))
    caps_of = instance_caps if callable(instance_caps) else (lambda _l: instance_caps)
    caps_long, caps_reg = list(caps_of(l_long)), list(caps_of(l_reg))
    num = len(caps_reg)
    if num < 1 or min(caps_reg) < 1:
        raise ValueError(f"dispatch: need >= 1 instance with >= 1 slot, got caps {caps_reg}")
    order = np.argsort(-scores, kind="stable")
    priority = scores.tolist()
    if planner == "lpt":
        est = expected_lengths(scores, recent)
        step_s = [ptl(c, float(np.mean(est)) / 2) for c in caps_reg]
        where, finish = list_schedule(est[order], caps_reg, step_s)
        target = [0] * n
        for pos, inst in zip(order, where, strict=True):
            target[int(pos)] = inst
        return DispatchPlan(target, priority, (), {"cost": max(finish)}, (l_long, l_reg))
    if num == 1 or n < 2:
        cost = instance_latency(n, l_reg, caps_reg[0], ptl, static_batch)
        return DispatchPlan([0] * n, priority, (), {"cost": cost}, (l_long, l_reg))
    n_long = min(n - 1, max(1, int(round(alpha * n))))
    # Long tail on the instances with the fewest slots (stable: equal instances keep order).
    by_slots = sorted(range(num), key=lambda i: caps_reg[i])
    best = None
    for k in range(1, num):
        long_ids, reg_ids = by_slots[:k], by_slots[k:]
        c_long = spread(n_long, [caps_long[i] for i in long_ids], l_long, ptl, static_batch)
        c_reg = spread(n - n_long, [caps_reg[i] for i in reg_ids], l_reg, ptl, static_batch)
        t_long = max(
            instance_latency(c, l_long, caps_long[i], ptl, static_batch)
            for c, i in zip(c_long, long_ids, strict=True)
        )
        t_reg = max(
            instance_latency(c, l_reg, caps_reg[i], ptl, static_batch)
            for c, i in zip(c_reg, reg_ids, strict=True)
        )
        cost = max(t_long, t_reg) if objective == "max" else t_long + t_reg
        if best is None or cost < best[0]:
            best = (cost, t_long, t_reg, long_ids, reg_ids, c_long, c_reg)
    cost, t_long, t_reg, long_ids, reg_ids, c_long, c_reg = best
    target = [0] * n
    for idx, ids, counts in ((order[:n_long], long_ids, c_long), (order[n_long:], reg_ids, c_reg)):
        for pos, inst in zip(idx, _deal(counts), strict=True):
            target[int(pos)] = ids[inst]
    return DispatchPlan(
        target,
        priority,
        tuple(long_ids),
        {"long": t_long, "regular": t_reg, "cost": cost},
        (l_long, l_reg),
    )


def expected_lengths(scores: np.ndarray, recent_lengths: np.ndarray) -> np.ndarray:
    """f64[n]: prompt i's expected length, the recent distribution's quantile
    1 - (r + 1/2) / n at its score rank r (0 = highest); prompts with equal scores (a GRPO
    group, or no ranker at all) share the mean of their ranks' quantiles."""
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    order = np.argsort(-scores, kind="stable")
    q = np.quantile(np.asarray(recent_lengths, np.float64), 1 - (np.arange(n) + 0.5) / n)
    est = np.empty(n)
    est[order] = q
    _, inverse = np.unique(scores, return_inverse=True)
    sums = np.bincount(inverse, weights=est)
    return sums[inverse] / np.bincount(inverse)[inverse]


def list_schedule(
    lengths_desc: np.ndarray, caps: Sequence[int], step_s: Sequence[float]
) -> tuple[list[int], list[float]]:
    """Greedy list scheduling of jobs (longest first) onto instances' slots.

    Each job goes to the instance where it would finish first: the earliest free slot of
    instance k plus length x step_s[k] (ties: the lower index).

    Returns:
      (instance per job, predicted finish time per instance).
    """
    free = [np.zeros(c) for c in caps]
    where = []
    for length in lengths_desc:
        ends = [f.min() + float(length) * t for f, t in zip(free, step_s, strict=True)]
        k = int(np.argmin(ends))
        free[k][int(np.argmin(free[k]))] = ends[k]
        where.append(k)
    return where, [float(f.max()) for f in free]


def _deal(counts: Sequence[int]) -> list[int]:
    """Instance index per position of a descending order: round-robin, skipping full ones,
    so every instance gets a mix of longer and shorter prompts of its group."""
    left, out = list(counts), []
    while any(left):
        for i, c in enumerate(left):
            if c:
                out.append(i)
                left[i] -= 1
    return out


def weighted_deal(n: int, weights: Sequence[float]) -> list[int]:
    """Smooth weighted round-robin: instance per position, counts proportional to weights
    (equal weights give 0, 1, ..., N-1, 0, 1, ...)."""
    current = [0.0] * len(weights)
    total = float(sum(weights))
    out = []
    for _ in range(n):
        for i, w in enumerate(weights):
            current[i] += w
        pick = max(range(len(weights)), key=lambda i: (current[i], -i))
        current[pick] -= total
        out.append(pick)
    return out


class Dispatcher(Protocol):
    """Plans one global batch: `plan(prompts, num_instances, instance_slots) -> DispatchPlan`."""

    def plan(
        self, prompts: Sequence[Sequence[int]], num_instances: int, instance_slots: Sequence[int]
    ) -> DispatchPlan: ...


class RandomDispatcher:
    """Baseline: shuffled prompts dealt in proportion to slot counts, FIFO admission."""

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def plan(
        self, prompts: Sequence[Sequence[int]], num_instances: int, instance_slots: Sequence[int]
    ) -> DispatchPlan:
        _check_instances(num_instances, instance_slots)
        order = self._rng.permutation(len(prompts))
        target = [0] * len(prompts)
        for pos, inst in zip(order, weighted_deal(len(prompts), instance_slots), strict=True):
            target[int(pos)] = inst
        return DispatchPlan(target, [0.0] * len(prompts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """Skew-aware dispatch settings.

    Attributes:
      alpha: long-tail share of each batch.
      objective: "max" (makespan) or "sum" (the paper's pseudocode).
      long_quantile: quantile of recent lengths representing the long tail (P90).
      regular_quantile: quantile representing regular prompts (P50).
      history: recent output lengths kept for the quantiles.
      initial_length: representative length before any length was observed.
      kv_bytes_per_token: KV bytes per token (`kv_bytes_per_token(model_cfg)`); 0 = the
        slot count is the only batch cap.
      kv_memory_bytes: KV-cache memory per instance (used when kv_bytes_per_token > 0).
      prompt_tokens: prompt length added to L for the KV cap.
      static_batch: cost each instance's steps at its full slot count (an engine that
        decodes every slot every step, `decode_buckets=False`); False = at the active
        batch (the paper's model, and this repo's engine with decode buckets).
      planner: "groups" (Algorithm 2's long-tail / regular groups) or "lpt" (list
        scheduling of expected lengths; see the module docstring).
    """

    alpha: float = 0.2
    objective: str = "max"
    long_quantile: float = 0.9
    regular_quantile: float = 0.5
    history: int = 4096
    initial_length: float = 256.0
    kv_bytes_per_token: int = 0
    kv_memory_bytes: float = 0.0
    prompt_tokens: int = 0
    static_batch: bool = False
    planner: str = "groups"

    def __post_init__(self):
        if self.planner not in PLANNERS:
            raise ValueError(f"DispatchConfig.planner must be one of {PLANNERS}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"DispatchConfig.objective must be one of {OBJECTIVES}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"DispatchConfig.alpha must be in (0, 1), got {self.alpha}")
        if self.history < 1 or self.initial_length <= 0:
            raise ValueError("DispatchConfig.history and initial_length must be > 0")


class SkewAwareDispatcher:
    """Algorithm 2 with a ranker's scores and the recent length distribution.

    Args:
      score_fn: prompts -> scores (`Ranker.score`), higher = longer.
      ptl: PTL(batch, mean context) in seconds (`PTLProfile`).
      cfg: dispatch settings.
    """

    def __init__(
        self,
        score_fn: Callable[[Sequence[Sequence[int]]], np.ndarray],
        ptl: PTL,
        cfg: DispatchConfig = DispatchConfig(),
    ):
        self.score_fn, self.ptl, self.cfg = score_fn, ptl, cfg
        self._recent: collections.deque[int] = collections.deque(maxlen=cfg.history)

    def observe(self, lengths: Iterable[int]) -> None:
        """Records finished samples' output lengths (the P50 / P90 source)."""
        self._recent.extend(int(n) for n in lengths)

    def _caps(self, slots: Sequence[int]) -> Callable[[float], list[int]]:
        c = self.cfg
        if c.kv_bytes_per_token <= 0:
            return lambda _l: list(slots)
        return lambda l_rep: [
            min(s, kv_slot_cap(c.kv_bytes_per_token, c.kv_memory_bytes, c.prompt_tokens + l_rep))
            for s in slots
        ]

    def plan_scores(
        self, scores: np.ndarray, num_instances: int, instance_slots: Sequence[int]
    ) -> DispatchPlan:
        """The plan for given scores (the oracle passes true lengths)."""
        _check_instances(num_instances, instance_slots)
        recent = np.asarray(self._recent) if self._recent else np.array([self.cfg.initial_length])
        c = self.cfg
        return plan_from_scores(
            scores,
            recent,
            self._caps(instance_slots),
            self.ptl,
            alpha=c.alpha,
            objective=c.objective,
            long_quantile=c.long_quantile,
            regular_quantile=c.regular_quantile,
            static_batch=c.static_batch,
            planner=c.planner,
        )

    def plan(
        self, prompts: Sequence[Sequence[int]], num_instances: int, instance_slots: Sequence[int]
    ) -> DispatchPlan:
        """Scores `prompts` with the ranker and plans them (see the module docstring)."""
        return self.plan_scores(self.score_fn(prompts), num_instances, instance_slots)


def _check_instances(num_instances: int, instance_slots: Sequence[int]) -> None:
    if num_instances < 1 or len(instance_slots) != num_instances:
        raise ValueError(
            f"dispatch: num_instances={num_instances} needs one slot count per instance, "
            f"got {list(instance_slots)}"
        )
    if min(instance_slots) < 1:
        raise ValueError(f"dispatch: every instance needs >= 1 slot, got {list(instance_slots)}")
