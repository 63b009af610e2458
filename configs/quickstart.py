"""Quickstart: SmolLM2-135M-Instruct learns arithmetic with GRPO on a 2-core CPU.

Run (from the repository root):
  python -m streamrl_jax.launch --config=configs/quickstart.py --workdir=/tmp/quickstart
The default is the 30-minute recipe (240 steps; its wall time and accuracy on a quiet
2-core CPU: BENCHMARKS.md "The main job"). Variants:
  configs/quickstart.py:short  the same recipe for 20 steps (a first look, minutes)
  configs/quickstart.py:sync   the recipe in stream_sync mode
  configs/quickstart.py:tiny   tiny random model, a few seconds a step (tests, smoke runs)
Any field can be overridden: --config.pipeline.steps=40 --config.pipeline.mode=stream_sync
"""

from streamrl_jax import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.defaults()
    c.seed = 0
    # Model: the embedded SmolLM2-135M-Instruct GGUF (dequantised to float32).
    c.model.source = "smollm2"
    c.model.max_context = 176  # prompt (<= 128) + response (<= 48)
    # One generation device and one training device: the disaggregated split.
    c.mesh.generate_devices = 1
    c.mesh.train_devices = 1
    c.mesh.instance_slots = (16,)  # one instance with 16 slots
    c.generation.max_prompt_len = 128
    c.generation.max_new_tokens = 48  # the answer fits; rambling past it is truncated
    # 0.7: sampling at 1.0 ended lower (docs/benchmarks/quickstart.md, "Sampling at
    # temperature 1.0"); the trainer's ratio is still against temperature-1 log-probs.
    c.generation.temperature = 0.7
    c.generation.decode_chunk = 8
    # StreamRL-Async, one step stale, 4 prompts x 8 samples per step (8 per group so
    # that most groups hold both right and wrong answers).
    c.pipeline.mode = "stream_async"
    c.pipeline.staleness = 1
    c.pipeline.steps = 240
    c.pipeline.prompts_per_step = 4
    c.pipeline.group_size = 8
    c.pipeline.min_groups = 1
    c.pipeline.micro_batch_groups = 2
    # DAPO dynamic sampling: groups with no reward variance give GRPO no gradient; skip
    # them and draw replacement prompts (at most 8 a step, twice prompts_per_step).
    c.pipeline.rollout = "dynamic_sampling"
    c.pipeline.dynamic_sampling_max_draws = 8
    # GRPO with DAPO's clip-higher (1 - 0.2, 1 + 0.28: slows the entropy collapse); no
    # reference model (KL 0) to keep a CPU step short.
    c.algorithm.advantage = "grpo"
    c.algorithm.policy_loss = "dapo"
    c.algorithm.aggregation = "token_mean"
    # DAPO soft overlong punishment over the last third of the 48-token cap, at most half
    # a correct answer: a correct truncated answer (0.5) stays above a wrong short one.
    c.algorithm.overlong_buffer = 16
    c.algorithm.overlong_penalty = 0.5
    # 2e-5 decaying to 2e-6 at the last step: 4e-5 was unstable, and the decay holds the
    # end of the curve (docs/benchmarks/quickstart.md, "Levers").
    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_steps = 2
    c.optimizer.schedule = "cosine"
    # Arithmetic from reasoning-gym; eval problems from another seed.
    c.data.tasks = "basic_arithmetic"
    # Two-term addition/subtraction of 1-2 digit numbers: within reach of a 135M model
    # (it solves some at the start), so GRPO groups carry signal from step 0.
    c.data.task_config = (
        '{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, '
        '"max_digits": 2, "operators": ["+", "-"], "allow_parentheses": false, '
        '"allow_negation": false}}'
    )
    c.data.train_seed = 1
    c.data.eval_seed = 2
    c.data.format_reward = 0.1
    # A short system prompt: prompt tokens dominate the trainer's cost here.
    c.data.system_prompt = "Solve it. End with: The answer is <answer>N</answer>."
    c.eval.every = 40
    c.eval.num_problems = 64
    # A save every 240 steps: the default run's final weights only (a longer run set with
    # --config.pipeline.steps also saves at each multiple of 240; --config.checkpoint.every=N).
    c.checkpoint.every = c.pipeline.steps

    if arg in (None, "", "async"):
        pass
    elif arg == "sync":
        c.pipeline.mode = "stream_sync"
    elif arg == "short":
        c.pipeline.steps = 20
        c.eval.every = 10
        c.checkpoint.every = 0
    elif arg == "tiny":
        c.model.source = "tiny"
        c.model.max_context = 144
        c.generation.max_prompt_len = 128
        c.generation.max_new_tokens = 16
        c.mesh.instance_slots = (8,)
        c.pipeline.steps = 2
        c.pipeline.prompts_per_step = 4
        c.pipeline.group_size = 2
        c.pipeline.min_groups = 1
        c.pipeline.micro_batch_groups = 2
        c.pipeline.timeout_s = 300.0  # a stall bound; failures propagate at once
        c.data.train_size = 200
        c.optimizer.learning_rate = 1e-3
        c.eval.every = 0
        c.eval.num_problems = 4
        c.checkpoint.every = 0
        # The plain GRPO path: the levers above stay off in tests and smoke runs.
        c.pipeline.rollout = "full"
        c.algorithm.policy_loss = "ppo_clip"
        c.algorithm.overlong_buffer = 0
        c.optimizer.schedule = "constant"
        c.log.progress = False
    else:
        raise ValueError(
            f"configs/quickstart.py: unknown variant {arg!r} (async | sync | short | tiny)"
        )
    return c
