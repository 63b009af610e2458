"""The pod planner: what a run of `streamrl_jax` needs and does on a pod, before any
accelerator hour. It imports `streamrl_jax`; `streamrl_jax` never imports it
(`tests/layering_test.py`).

* `plan` (`python -m streamrl_podplan.plan`): the project's own programs compiled ahead
  of time for a TPU topology or H100 nodes that are not attached, their memory per
  device against the chip's (`programs`, `reports`), and a knob search simulated with
  the compiled costs (`search`).
* `simulate` (`python -m streamrl_podplan.simulate`): the pod-scale discrete-event
  simulator of the pipeline's modes (`simulation/`), its calibration and measured
  profiles; `figures` draws its plots.
* `shapes`: the models planned, as shapes with no weights: presets or a user's own
  `config.json`.
* `device_check` (`python -m streamrl_podplan.device_check`): a plan's prediction
  against one real device's count.

See docs/podplan.md.
"""
