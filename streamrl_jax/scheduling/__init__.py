"""Skewness-aware scheduling: output-length ranker, dispatch (Alg. 2), balance (Alg. 1).

Modules (imported directly; this package imports nothing so that the numpy-only parts,
`dispatch`, `balance`, `rank_metrics`, `sample_log`, load without JAX or Flax):

* `ranker`: the Flax NNX output-length ranker (pairwise ranking loss, online refresh).
* `rank_metrics`: recall of the true longest share, Kendall tau.
* `dispatch`: the skew-aware dispatch plan, LPT priorities, random and oracle baselines.
* `balance`: the profiler-based generation / training device split and the elastic rule.
* `sample_log`: the per-sample JSONL the ranker trains on.
* `lengths`: output-length distributions (the paper's long-tail trace; length replay).
* `live`: the scheduling state of a running pipeline (dispatch, online ranker, elastic).
"""
