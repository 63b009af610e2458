"""Agent: SmolLM2-135M-Instruct learns the quickstart's arithmetic with a calculator tool.

Run (from the repository root):
  python -m streamrl_jax.launch --config=configs/agent.py --workdir=/tmp/agent
Every sample is an episode (docs/episodes.md): the model may call the calculator,
`<tool_call>calculator: 12 - 7</tool_call>`, any number of times (the result comes back
as a tool message) before answering in <answer></answer> tags. Variants:
  configs/agent.py:endpoint  training episodes played by a scaffold through the run's
                            OpenAI-compatible endpoint (docs/endpoint.md)
  configs/agent.py:openenv  the same through the endpoint with a third-party (OpenEnv)
                            environment: environments/openenv_arithmetic.py
  configs/agent.py:short  10 steps (a first look)
  configs/agent.py:tiny   tiny random model, a few seconds a step (tests, smoke runs)
  configs/agent.py:chained  the chained calculator (environments/chained_calculator.py):
                          sums of 4-5 three-digit numbers with `calculate(a, op, b)`, an
                          OpenAI function taking two numbers a call, so the model must
                          chain its calls; below its goal yet (docs/episodes.md);
                          chained_endpoint through the endpoint with OpenAI tool calling,
                          chained_tiny on the tiny model
Any field can be overridden: --config.environment.max_turns=3
"""

from streamrl_jax import config as config_lib


def _chained(c) -> None:
    """The chained calculator: sums of 4-5 three-digit numbers, an OpenAI function taking
    two numbers a call; it does not meet its goal on 2 cores yet (docs/episodes.md: the
    runs so far and the ceiling a step's cost sets)."""
    # The first prompt (instructions, the function's schema, the question) fits 344
    # tokens; an episode's turns (each the terms left and a call, at most 66 tokens), the
    # tool's results and the answer fit 352 (5 terms: 4 calls).
    c.model.max_context = 704
    c.generation.max_prompt_len = 344
    c.generation.max_new_tokens = 72  # the terms left and a call, or the answer
    c.generation.temperature = 1.0
    c.environment.name = "chained_calculator"
    c.environment.max_turns = 5  # 4 calls and the answer for 5 terms
    c.environment.max_episode_tokens = 360
    c.environment.step_credit = 1.0  # each correct call earns its share as it is taken
    # reasoning-gym's chain_sum (its basic_arithmetic without parentheses scores against
    # answers that do not follow operator precedence: 111 of 200 wrong at 4-5 terms)
    c.data.tasks = "chain_sum"
    c.data.task_config = (
        '{"chain_sum": {"min_terms": 4, "max_terms": 5, "min_digits": 3, "max_digits": 3}}'
    )
    c.pipeline.prompts_per_step = 2
    # a group a micro-batch: the backward's saved activations for 16 episodes of ~700
    # tokens passed the 2-core machine's 23 GB (the run was killed for memory)
    c.pipeline.micro_batch_groups = 1
    # Every episode weighs the same: at token_mean the many long episodes of a below-average
    # return pushed the calls down until the policy stopped calling (learning rate 1e-4)
    c.algorithm.aggregation = "seq_mean_token_mean"
    c.optimizer.learning_rate = 5e-5
    c.optimizer.schedule = "constant"  # a shorter run's steps are a longer run's first ones
    c.warmup.steps = 4  # 32 demonstrations


def get_config(arg: str | None = None):
    c = config_lib.defaults()
    c.seed = 0
    c.model.source = "smollm2"
    # The first prompt (system prompt with the tool, question) fits 128 tokens; the
    # episode's turns and tool results after it share 96 more.
    c.model.max_context = 224
    c.mesh.generate_devices = 1
    c.mesh.train_devices = 1
    c.mesh.instance_slots = (16,)
    c.generation.max_prompt_len = 128
    c.generation.max_new_tokens = 32  # each turn's cap: a call or an answer fits
    c.generation.temperature = 0.7
    c.generation.decode_chunk = 8
    c.pipeline.mode = "stream_async"
    c.pipeline.staleness = 1
    c.pipeline.steps = 40
    c.pipeline.prompts_per_step = 4
    c.pipeline.group_size = 8
    c.pipeline.min_groups = 1
    c.pipeline.micro_batch_groups = 2
    c.pipeline.rollout = "episodes+full"
    # The calculator environment: at most 4 turns (calls, then the answer) and 96 tokens
    # after the first prompt; tools run in the sandbox.
    c.environment.name = "calculator"
    c.environment.max_turns = 4
    c.environment.max_episode_tokens = 96
    c.algorithm.advantage = "grpo"
    c.algorithm.policy_loss = "dapo"
    c.algorithm.aggregation = "token_mean"
    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_steps = 2
    c.optimizer.schedule = "cosine"
    c.data.tasks = "basic_arithmetic"
    c.data.task_config = (
        '{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, '
        '"max_digits": 2, "operators": ["+", "-"], "allow_parentheses": false, '
        '"allow_negation": false}}'
    )
    c.data.train_seed = 1
    c.data.eval_seed = 2
    # SmolLM2 writes no well-formed call on its own (tools/probe_tool_calls.py): one
    # supervised step on 8 demonstrations (call, result, answer) before RL makes it call
    # the tool in about half its sampled episodes; RL does the rest (3 such steps solve
    # the task outright and leave RL nothing to learn: BENCHMARKS.md "The agent job").
    c.warmup.steps = 1
    c.warmup.batch = 8
    c.warmup.learning_rate = 1e-4
    c.eval.every = 10
    c.eval.num_problems = 64
    c.checkpoint.every = c.pipeline.steps  # the final weights (eval seed 3: init_from)

    if arg in ("chained", "chained_endpoint", "chained_tiny"):
        _chained(c)
        if arg == "chained_endpoint":
            c.pipeline.rollout = "agents+full"
        arg = "tiny" if arg == "chained_tiny" else ""
    if arg in (None, ""):
        pass
    elif arg == "endpoint":
        # The same job, every training episode played by a scaffold through the run's
        # OpenAI-compatible endpoint (docs/endpoint.md): the calculator environment
        # driven with the official openai client; held-out episodes run in-process.
        c.pipeline.rollout = "agents+full"
    elif arg in ("openenv", "openenv_short"):
        # A third-party environment through the endpoint: an OpenEnv (openenv-core) MCP
        # environment, unchanged (environments/openenv_arithmetic.py: reasoning-gym tasks,
        # a calculator tool, answers scored by its submit_answer tool), played by
        # scaffolds with the official openai client; no demonstrations (OpenEnv gives
        # none), so RL starts from the instruct model.
        c.pipeline.rollout = "agents+full"
        c.environment.name = "openenv"
        c.environment.openenv = (
            "streamrl_jax.environments.openenv_arithmetic:ArithmeticToolsEnvironment"
        )
        # its MCP tool is an OpenAI function: the first prompt (instructions, the
        # function's JSON schema in the model's convention, the question) fits 288 tokens
        c.generation.max_prompt_len = 288
        c.model.max_context = 288 + 96
        c.warmup.steps = 0
        if arg == "openenv_short":
            c.pipeline.steps = 10
            c.eval.every = 5
            c.checkpoint.every = 0
    elif arg == "short":
        c.pipeline.steps = 10
        c.eval.every = 5
        c.checkpoint.every = 0
    elif arg == "tiny":
        c.model.source = "tiny"
        c.generation.max_new_tokens = 16
        c.mesh.instance_slots = (8,)
        c.pipeline.steps = 2
        c.pipeline.prompts_per_step = 4
        c.pipeline.group_size = 2
        c.pipeline.timeout_s = 300.0
        c.data.train_size = 200
        c.optimizer.learning_rate = 1e-3
        c.optimizer.schedule = "constant"
        c.eval.every = 0
        c.eval.num_problems = 4
        c.checkpoint.every = 0
        c.algorithm.policy_loss = "ppo_clip"
        c.environment.tool_sandbox = False  # no worker processes in smoke runs
        c.warmup.steps = 0
        c.log.progress = False
    else:
        raise ValueError(
            f"configs/agent.py: unknown variant {arg!r} "
            "(endpoint | openenv | openenv_short | short | tiny | chained | chained_endpoint | "
            "chained_tiny)"
        )
    return c
