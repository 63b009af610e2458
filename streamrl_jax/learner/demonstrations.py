"""An environment's demonstrations as the trainer sees them (docs/episodes.md).

For the calculator: the call on the task's expression, the tool's result, the task's
answer, rendered exactly as an episode is: the first prompt, then each assistant
message's tokens and end-of-turn token (trained), the environment's tokens between them
(`render.TurnRenderer`, loss mask 0). The supervised warm-up (pipeline/warmup.py) and
the `supervised` target (`supervised.py`) train on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from streamrl_jax import environments
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import Prompt, tokenize
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import Problem


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One synthetic episode as the trainer sees it."""

    prompt: list[int]
    response: list[int]
    policy_mask: np.ndarray  # bool[R]: the assistant's tokens


def demonstrations(
    cfg: ExperimentConfig, tokenizer: Tokenizer, problems: Sequence[Problem]
) -> list[Demonstration]:
    """The environment's demonstrations of `problems` (those it has one for), tokenised
    as episodes are."""
    messages = environments.first_messages(cfg.environment, tokenizer)
    env = environments.demonstrator(cfg.environment, tokenizer)
    renderer = environments.renderer(cfg.environment, tokenizer)
    tools = environments.functions(cfg.environment, tokenizer)
    end = tokenizer.eos_id if tokenizer.template_style is None else tokenizer.stop_ids[0]
    out = []
    for problem in problems:
        turns = env.demonstration(problem.question, problem.metadata)
        if not turns:
            continue
        prompt: Prompt = tokenize(problem, tokenizer, messages=messages, tools=tools)
        response: list[int] = []
        mask: list[bool] = []
        pending: list[dict[str, str]] = []
        for m in turns:
            if m["role"] != "assistant":
                pending.append(m)
                continue
            if pending:
                env_tokens = renderer.observation(pending, end)
                response += env_tokens
                mask += [False] * len(env_tokens)
                pending = []
            policy = [*tokenizer.encode(m["content"]), end]
            response += policy
            mask += [True] * len(policy)
        out.append(Demonstration(list(prompt.tokens), response, np.asarray(mask, bool)))
    return out
