"""`pipeline.precompile`: the executables a run will meet, compiled before its first step.

A mid-run compilation is not steady state: the trainer compiles for seconds (3-8 s
for the tiny model on CPU-2) whenever the data first produces a new micro-batch
shape, and an engine compiles a decode shape the first time its running slots
need it. With `pipeline.precompile`:

* each generation instance compiles everything it can run before it serves
  (`Engine.compile_shapes`: every decode (batch, length) bucket, prefill for every
  prompt bucket, the shared-prefill fork), on padding rows that write nothing;
* with `generation.length_replay` (every response length is fixed by the run's seed
  before anything is generated: `data.replay_lengths`) the trainer runs each
  micro-batch shape its remaining batches can produce (`micro_batch_shapes`) once,
  before its first step, on an all-padding batch into a throwaway accumulator: the
  same calls the loop makes (policy accumulate, pi_old and reference log-probs, the
  critic's targets and accumulate), so the loop's calls find them compiled and the
  state is untouched. Without length replay the shapes depend on what is sampled,
  and the trainer precompiles nothing (logged).

Reachable shapes. A micro-batch is some groups of one batch (`GroupTaker`):

* `pipeline.deterministic`: exactly the consecutive groups of each micro-batch;
* otherwise whichever groups are ready: every subset of the batch's groups of
  each size the taker can take (from `min_groups` up to `micro_batch_groups`,
  following what remains of the mini-batch);
* several training processes: each process's slice (`shards.Ownership`) the same
  way, then every combination of the processes' shapes through the agreement
  rule (`TrainingGroup.agree`: the largest rows, columns and loss width);
* partial rollout: a round trains finished groups of any batch it may hold,
  [b - max_lag, b + staleness], so subsets of that pool.

Each subset's shape is `trainer.packing.shape` of its prompt and response lengths
(held equal to `make_batch` by a test). Dynamic sampling draws replacement prompts
by reward, so its shapes are not known in advance: the trainer part is skipped
(logged). A plan over `_MAX_SUBSETS` subsets is an error naming the fields.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

from absl import logging

from streamrl_jax import data as data_lib
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.pipeline.schedules import Schedule
from streamrl_jax.pipeline.shards import Ownership
from streamrl_jax.trainer import packing

# One subset costs ~0.1 ms of host planning; past this the plan itself would be slow.
_MAX_SUBSETS = 200_000

Group = tuple[int, tuple[int, ...]]  # (prompt length, response lengths)
Shape = tuple[int, int, int]  # (rows fed by this process, columns, loss width)


def group_lengths(
    cfg: ExperimentConfig, prompt_lens: dict[int, Sequence[int]]
) -> dict[int, list[Group]]:
    """Per batch, each group's (prompt length, forced response lengths), from the prompt
    lengths of the batch's draw (`prompt_lens`: batch -> one length per group)."""
    p, g = cfg.pipeline, cfg.generation
    out = {}
    for b, lens in prompt_lens.items():
        n = len(lens) * p.group_size
        forced = data_lib.replay_lengths(cfg.seed, b, n, g.max_new_tokens)
        out[b] = [
            (int(lens[i]), tuple(forced[i * p.group_size : (i + 1) * p.group_size]))
            for i in range(len(lens))
        ]
    return out


def _sizes(p, schedule: Schedule, per_mini: int) -> set[int]:
    """Group counts a non-deterministic single-process taker can put in one micro-batch."""
    sizes, seen, todo = set(), set(), [per_mini]
    while todo:
        remaining = todo.pop()
        if remaining in seen:
            continue
        seen.add(remaining)
        hi = min(p.micro_batch_groups, remaining)
        lo = min(schedule.min_groups(p, remaining), hi)
        for size in range(lo, hi + 1):
            sizes.add(size)
            if remaining - size:
                todo.append(remaining - size)
    return sizes


def _subsets(pool: Sequence[int], sizes: set[int]) -> list[tuple[int, ...]]:
    return [c for size in sorted(sizes) for c in itertools.combinations(pool, size)]


def _count(pool: int, sizes: set[int]) -> int:
    return sum(math.comb(pool, size) for size in sizes)


def micro_batch_shapes(
    cfg: ExperimentConfig,
    layout: dict,
    schedule: Schedule,
    groups: dict[int, list[Group]],
    batches: Sequence[int],
    count: int = 1,
) -> list[Shape]:
    """The distinct micro-batch shapes training batches `batches` can produce (module
    docstring), sorted: (rows each of the `count` training processes feeds, columns,
    loss width). `groups`: batch -> its groups' lengths (`group_lengths`), covering the
    partial-rollout pool. `layout`: `TrainerConfig.layout`.

    Raises:
      ValueError: more than `_MAX_SUBSETS` subsets to plan (names the fields).
    """
    if count > 1:
        return _multi_process_shapes(cfg, layout, schedule, groups, batches, count)
    p = cfg.pipeline
    per_mini = p.prompts_per_step // p.mini_batches
    shape_of = _shape_fn(layout)
    rollout = p.partial_budget_tokens > 0
    plans: list[tuple[list[Group], list[tuple[int, ...]]]] = []  # (pool, subsets)
    total = 0
    for b in batches:
        if rollout:
            pool = [
                x
                for j in range(b - schedule.max_lag, b + p.staleness + 1)
                for x in groups.get(j, [])
            ]
            sizes = set(range(1, p.micro_batch_groups + 1))
            total += _count(len(pool), sizes)
            _check(total, p)
            plans.append((pool, _subsets(range(len(pool)), sizes)))
        elif p.deterministic:
            pool = groups[b]
            subsets = [
                tuple(
                    range(
                        k * per_mini + j,
                        min(k * per_mini + j + p.micro_batch_groups, (k + 1) * per_mini),
                    )
                )
                for k in range(p.mini_batches)
                for j in range(0, per_mini, p.micro_batch_groups)
            ]
            plans.append((pool, subsets))
        else:  # whichever groups of the batch are ready (any mini-batch's)
            pool = groups[b]
            sizes = _sizes(p, schedule, per_mini)
            total += _count(len(pool), sizes)
            _check(total, p)
            plans.append((pool, _subsets(range(len(pool)), sizes)))
    shapes = set()
    for pool, subsets in plans:
        for subset in subsets:
            b_rows, t, width, _ = shape_of([pool[i] for i in subset])
            shapes.add((b_rows, t, width))
    return sorted(shapes)


def _multi_process_shapes(cfg, layout, schedule, groups, batches, count) -> list[Shape]:
    """Several training processes: each process's local shapes per micro-batch, then every
    combination of them through `TrainingGroup.agree` (module docstring)."""
    p = cfg.pipeline
    if p.partial_budget_tokens > 0:
        raise ValueError(
            "pipeline.precompile with partial rollout (pipeline.partial_budget_tokens > 0) "
            f"and {count} training processes is not planned: run one training process"
        )
    own = Ownership(count, p.prompts_per_step // p.mini_batches, p.micro_batch_groups)
    shape_of = _shape_fn(layout)
    buckets = layout["batch_buckets"]
    shapes, total = set(), 0
    # Each process is sent only the groups it owns; it takes any of them that are ready.
    mine = {
        t: [
            i
            for k in range(p.mini_batches)
            for j in range(own.micro_batches())
            for i in own.local_groups(k, j, t)
        ]
        for t in range(count)
    }
    for b in batches:
        for k in range(p.mini_batches):
            for j in range(own.micro_batches()):
                local: list[set[tuple[int, int, int]]] = []
                for t in range(count):
                    want = own.local_groups(k, j, t)
                    if p.deterministic:
                        subsets = [tuple(want)]
                    else:
                        total += math.comb(len(mine[t]), len(want))
                        _check(total, p)
                        subsets = list(itertools.combinations(mine[t], len(want)))
                    local.append(
                        {
                            (rows, t_cols, width)
                            for _, t_cols, width, rows in (
                                shape_of([groups[b][i] for i in s]) for s in subsets
                            )
                        }
                    )
                for combo in itertools.product(*local):
                    rows = max(c[0] for c in combo) * count
                    fits = packing.bucket(rows, buckets, "micro-batch size (rows)")
                    shapes.add((fits // count, max(c[1] for c in combo), max(c[2] for c in combo)))
    return sorted(shapes)


def _shape_fn(layout: dict) -> Callable[[list[Group]], tuple[int, int, int, int]]:
    def shape_of(chosen: list[Group]) -> tuple[int, int, int, int]:
        prompt_lens, response_lens, group_ids = [], [], []
        for gi, (plen, resp) in enumerate(chosen):
            prompt_lens += [plen] * len(resp)
            response_lens += list(resp)
            group_ids += [gi] * len(resp)
        return packing.shape(prompt_lens, response_lens, group_ids, **layout)

    return shape_of


def _check(total: int, p) -> None:
    if total > _MAX_SUBSETS:
        raise ValueError(
            f"pipeline.precompile: over {_MAX_SUBSETS} candidate micro-batches to plan "
            f"(pipeline.prompts_per_step={p.prompts_per_step}, micro_batch_groups="
            f"{p.micro_batch_groups}, min_groups={p.min_groups}, steps={p.steps}); set "
            "pipeline.deterministic (one subset per micro-batch) or turn precompile off"
        )


def timed(what: str, fn: Callable[[], int]) -> float:
    """Runs `fn` (returns how many executables it compiled) and logs it; seconds taken."""
    t0 = time.perf_counter()
    n = fn()
    took = time.perf_counter() - t0
    logging.info("pipeline.precompile: %s: %d executables in %.1f s", what, n, took)
    return took
