"""Multi-agent: a solver and a verifier, one SmolLM2-135M-Instruct in two roles, trained
together on the quickstart's arithmetic (docs/multi_agent.md).

Run (from the repository root):
  python -m streamrl_jax.launch --config=configs/multi_agent.py --workdir=/tmp/multi_agent
Every sample is a seat of a two-agent episode (`environment.name="solve_verify"`): the
solver answers in <answer></answer> tags; the verifier, in a conversation of its own,
reads the question and that answer and starts its reply with Yes or No, then what is
wrong; a solver told No reads the critique and answers again. The ground truth rewards each:
the solver its final answer, the verifier a right decision. A group of 8 holds 4
episodes of its prompt, each role compared with itself in the others (`role/<role>/*`
in the metrics, each role's return on the console). The agent job's settings
(configs/agent.py: task, algorithm, optimizer, evaluation) but for what follows.
Variants:
  configs/multi_agent.py:short  10 steps (a first look)
  configs/multi_agent.py:tiny   tiny random model, a few seconds a step (tests)
Any field can be overridden: --config.pipeline.steps=20
"""

import importlib.util
import os


def _agent(arg: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")
    spec = importlib.util.spec_from_file_location("agent_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str | None = None):
    if arg not in (None, "", "short", "tiny"):
        raise ValueError(f"configs/multi_agent.py: unknown variant {arg!r} (short | tiny)")
    c = _agent(arg or "")
    c.pipeline.rollout = "multi_agent+full"
    c.environment.name = "solve_verify"
    c.environment.max_turns = 3  # answer, check, answer again
    c.warmup.steps = 0  # a two-agent episode has no single conversation to demonstrate
    # A role's KV waits while the other role acts; when requests wait for slots, the
    # least recently used kept KV is given up at once (re-prefilled on its next turn).
    c.generation.kv_hold_s = 0.0
    if arg == "tiny":
        c.pipeline.prompts_per_step = 2
        c.pipeline.group_size = 4  # 2 episodes x 2 roles
        c.eval.num_problems = 2
        return c
    # A first prompt (the solver's: instructions and question; the verifier's: its
    # instructions, the question and the proposed answer) fits 160 tokens; a role's
    # conversation after it (answer, critique, answer again) 160 more.
    c.model.max_context = 320
    c.generation.max_prompt_len = 160
    c.generation.max_new_tokens = 48  # each turn's cap
    c.environment.max_episode_tokens = 160
    c.pipeline.group_size = 8  # 4 episodes x 2 roles
    return c
