"""The pod planner: what a run of `streamrl_jax` needs and does on a pod, before any
accelerator hour (`plan`, `simulate`, `simulation/`). It imports `streamrl_jax`;
`streamrl_jax` never imports it.
"""
