"""A dense stand-in reward for untrained models (`data.reward="vowels"`).

A random tiny model never solves a task, so every sample of a group scores 0,
advantages are 0 and nothing trains. The fraction of vowels in the decoded
response differs between samples, is verifiable and cheap, so the pipeline's
tests (and runs across processes that must match them bit for bit) see
non-zero advantages and parameter updates.
"""

from typing import Any

from streamrl_jax.rewards.base import RewardResult


def vowel_reward(sample_text: str, metadata: dict[str, Any]) -> RewardResult:
    """score = (# of a, e, i, o, u in either case) / max(len(text), 1); correct = score > 0.5."""
    del metadata
    score = sum(ch in "aeiouAEIOU" for ch in sample_text) / max(len(sample_text), 1)
    return RewardResult(score=score, correct=score > 0.5, extracted_answer=None, format_ok=True)
