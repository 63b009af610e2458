"""What the benchmarks and probes in `tools/` share, importable by them and the tests.

* `curves`: accuracy against wall time (a config read as the launcher reads it, the
  main job run for a budget with checkpoints, the time a curve reaches a target).
* `makespan`: the makespan of a generation batch's dispatch plan on modelled instances
  (the scheduling bench's cross-check).
* `ranker_eval`: the output-length ranker trained and judged on logged samples
  (`tools/train_ranker.py`, the scheduling bench, `tools/ranker_probe.py`).
* `collect_samples`: real output lengths for the ranker (the scheduling bench's
  `--collect`, `tools/build_length_dataset.py`).
* `bad_frames`: hostile or broken peers of the cross-process channels (the network
  cases of the bad-input corpus).

Layering: this package imports `streamrl_jax`; `streamrl_jax` never imports it
(`tests/layering_test.py`). Library logic a tool needs lives in `streamrl_jax`; what
is here is a bench's own machinery.
"""
