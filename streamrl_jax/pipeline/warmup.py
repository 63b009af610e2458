"""Supervised warm-up on an environment's demonstrations, before RL (docs/episodes.md).

A policy that never writes a well-formed tool call never sees a tool result, and RL
only sharpens what the policy samples (the measured rate: BENCHMARKS.md "Agent").
With `warmup.steps > 0` a fresh run (not a resumed one) first trains on synthetic
episodes: for training problems drawn from the train split (seeded), the
environment's `demonstration` (for the calculator: the call on the task's expression,
the tool's result, the task's answer), rendered exactly as an episode is: the first
prompt, then each assistant message's tokens and end-of-turn token (trained), the
environment's tokens between them (`render.TurnRenderer`, loss mask 0).

The step is the run's own policy step with advantage 1 and the old and behaviour
log-probs set to the current policy's (ratio 1, importance weight 1): its gradient
is the mean negative log-likelihood of the assistant tokens, the supervised
objective, through the same jitted step, buckets and sharding. It runs on a trainer
of its own (`warmup.learning_rate`, constant), and RL starts from its weights with a
fresh optimizer (no moments or step count carried over). Its wall time is part of
the run's (launch times both).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.learner.demonstrations import demonstrations
from streamrl_jax.model.config import ModelConfig
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import Problem
from streamrl_jax.trainer import TrainState, make_batch, make_policy_trainer, trainer_config


def warm_up(
    cfg: ExperimentConfig,
    model_cfg: ModelConfig,
    mesh: Mesh,
    params: object,
    tokenizer: Tokenizer,
    problems: Sequence[Problem],
) -> tuple[object, dict[str, float]]:
    """`warmup.steps` supervised steps from `params` (module docstring).

    Returns:
      (the warmed-up params, {"warmup_s", "warmup_nll_first", "warmup_nll_last",
      "warmup_examples"}): the mean negative log-likelihood per assistant token of the
      first and last step.

    Raises:
      ValueError: the environment has no demonstration for any training problem.
    """
    w = cfg.warmup
    t0 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(problems))[: w.steps * w.batch]
    demos = demonstrations(cfg, tokenizer, [problems[int(i)] for i in order])
    if not demos:
        raise ValueError(
            f"warmup.steps={w.steps}: environment {cfg.environment.name!r} has no "
            "demonstration for the training problems"
        )
    sft = dataclasses.replace(
        cfg,
        optimizer=dataclasses.replace(
            cfg.optimizer, learning_rate=w.learning_rate, schedule="constant", warmup_steps=0
        ),
        algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.0, entropy_coef=0.0),
        pipeline=dataclasses.replace(cfg.pipeline, steps=w.steps, mini_batches=1),
    )
    tcfg = trainer_config(sft, fsdp=mesh.shape["fsdp"])
    trainer = make_policy_trainer(model_cfg, tcfg, mesh, model_seed=cfg.seed)
    state: TrainState = trainer.state_from_params(params, cfg.seed)
    micro = tcfg.batch_buckets[-1]
    losses: list[float] = []
    nll_sum, tokens = 0.0, 0
    for step in range(w.steps):
        chosen = [demos[(step * w.batch + i) % len(demos)] for i in range(w.batch)]
        acc = trainer.init_accumulator()
        for lo in range(0, len(chosen), micro):
            part = chosen[lo : lo + micro]
            host = make_batch(
                [d.prompt for d in part],
                [d.response for d in part],
                behaviour_logp=[np.zeros(len(d.response), np.float32) for d in part],
                advantages=np.ones(len(part), np.float32),
                policy_masks=[d.policy_mask for d in part],
                pad_id=tokenizer.pad_id,
                **tcfg.layout,
            )
            dev = trainer.place_batch(host)
            logp = trainer.logprobs(state.params, dev)  # ratio 1: the NLL gradient
            dev = dev.replace(old_logp=logp, behaviour_logp=logp)
            acc, _ = trainer.accumulate(state, acc, dev, trainer.scalar(1.0))
            nll_sum += -(logp * dev.loss_mask).sum()
            tokens += int(host.loss_mask.sum())
        state, acc, _ = trainer.apply(state, acc)
        if step == 0 or step == w.steps - 1 or (step + 1) % 10 == 0:
            nll = float(jax.device_get(nll_sum)) / tokens  # a deliberate sync, to log it
            losses.append(nll)
            logging.info("warm-up step %d/%d: nll %.4f", step + 1, w.steps, nll)
        nll_sum, tokens = 0.0, 0
    out = {
        "warmup_s": time.perf_counter() - t0,
        "warmup_nll_first": losses[0],
        "warmup_nll_last": losses[-1],
        "warmup_examples": float(len(demos)),
    }
    return state.params, out
