"""Prompt pipeline: reasoning-gym problems → chat-templated token ids → generation requests.

`PromptPipeline` is a grain `MapDataset` over a `TaskDataset`, shuffled with
a seed and reshuffled every epoch (`repeat`), mapped through the tokenizer's
chat template. Its iterator state (`get_state` / `set_state`) is a small dict,
saved with checkpoints so a resumed run continues with the next prompt.

A prompt longer than `max_prompt_len` tokens is an error by default (it would
otherwise fail deep in the engine); with `overlong="drop"` it is skipped and
counted in `dropped_overlong`, with `"truncate"` its start is cut (left truncation
keeps the assistant header the model continues from) and it is counted in
`truncated_overlong`; never silently.

`make_requests` turns one global batch of prompts into `group_size` sampled
requests each, with deterministic per-sample seeds, the pipeline's routing in a
typed `RequestTag` (batch, group, member, prompt id) and the problem's payload for
the reward function in `metadata`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from streamrl_jax.errors import UserError
from streamrl_jax.generation.types import GenerationRequest, RequestTag, SamplingParams
from streamrl_jax.model import function_calls
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards.tasks import Problem, TaskDataset, chat_messages
from streamrl_jax.scheduling import lengths


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A problem and its tokenised chat prompt."""

    problem: Problem
    tokens: tuple[int, ...]


Messages = Callable[[Problem], list[dict[str, str]]]


def tokenize(
    problem: Problem,
    tokenizer: Tokenizer,
    system_prompt: str = "",
    messages: Messages | None = None,
    tools: Sequence[function_calls.Tool] = (),
) -> Prompt:
    """The chat-templated prompt: `messages(problem)` (an environment's first messages),
    else the question after `system_prompt` ("" uses `rewards.tasks`' default); `tools`:
    the OpenAI functions an environment offers, shown as the endpoint shows a request's
    (`function_calls.chat_text`)."""
    if messages is not None:
        convo = messages(problem)
    else:
        convo = chat_messages(problem.question, *([system_prompt] if system_prompt else []))
    if tools:
        text = function_calls.chat_text(tokenizer, convo, tools)
    else:
        text = tokenizer.apply_chat_template(convo)
    return Prompt(problem=problem, tokens=tuple(tokenizer.encode(text)))


class PromptPipeline:
    """Endless, seeded, epoch-reshuffled stream of tokenised prompts."""

    def __init__(
        self,
        dataset: TaskDataset,
        tokenizer: Tokenizer,
        *,
        max_prompt_len: int,
        seed: int,
        overlong: str = "error",
        system_prompt: str = "",
        messages: Messages | None = None,
        tools: Sequence[function_calls.Tool] = (),
    ):
        if overlong not in ("error", "drop", "truncate"):
            raise ValueError(f"overlong={overlong!r}; expected 'error', 'drop' or 'truncate'")
        if len(dataset) == 0:
            raise ValueError("prompt dataset is empty")
        self.dataset = dataset
        self.max_prompt_len = max_prompt_len
        self.overlong = overlong
        self.dropped_overlong = 0
        self.truncated_overlong = 0
        self.consumed = 0
        length = lambda p: len(tokenize(p, tokenizer, system_prompt, messages, tools).tokens)  # noqa: E731
        if overlong == "drop" and not any(length(p) <= max_prompt_len for p in dataset):
            # Drawing would spin for ever: fail at start-up (the scan stops at the first
            # prompt that fits, so a usable dataset costs one tokenisation here).
            raise UserError(
                f"none of the {len(dataset)} prompts fits generation.max_prompt_len="
                f"{max_prompt_len} (the shortest has {min(map(length, dataset))} tokens); with "
                "data.overlong_prompts='drop' every one would be dropped"
            )
        ds = grain.MapDataset.range(len(dataset)).shuffle(seed=seed).repeat()
        ds = ds.map(lambda i: tokenize(dataset[int(i)], tokenizer, system_prompt, messages, tools))
        self._iter = ds.to_iter_dataset().__iter__()

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next `n` prompts within the length limit."""
        out: list[Prompt] = []
        while len(out) < n:
            prompt = next(self._iter)
            if len(prompt.tokens) > self.max_prompt_len:
                if self.overlong == "error":
                    raise UserError(
                        f"prompt {prompt.problem.prompt_id} has {len(prompt.tokens)} tokens, "
                        f"over generation.max_prompt_len={self.max_prompt_len} "
                        f"(raise the limit, or drop long prompts)"
                    )
                if self.overlong == "truncate":
                    # Left truncation: the end of a chat prompt (the assistant header the
                    # model continues from) is kept; the start of the question is cut.
                    prompt = dataclasses.replace(
                        prompt, tokens=prompt.tokens[-self.max_prompt_len :]
                    )
                    self.truncated_overlong += 1
                else:
                    self.dropped_overlong += 1
                    continue
            out.append(prompt)
        self.consumed += n
        return out

    def get_state(self) -> dict[str, Any]:
        return {
            "iterator": self._iter.get_state(),
            "dropped_overlong": self.dropped_overlong,
            "truncated_overlong": self.truncated_overlong,
            "consumed": self.consumed,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._iter.set_state(state["iterator"])
        self.dropped_overlong = int(state["dropped_overlong"])
        self.truncated_overlong = int(state.get("truncated_overlong", 0))
        self.consumed = int(state["consumed"])


def sample_seed(run_seed: int, batch: int, group: int, member: int) -> int:
    """A stable 31-bit seed per sample (independent of slot, instance or timing)."""
    digest = hashlib.blake2b(f"{run_seed}/{batch}/{group}/{member}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


def replay_lengths(
    run_seed: int, batch: int, n: int, max_new_tokens: int, first_group: int = 0
) -> list[int]:
    """Length replay's forced response lengths of the n samples (groups from `first_group`,
    members in order) of batch `batch`: drawn from the paper's long-tail trace scaled to
    `max_new_tokens`, seeded by run and batch, so known before anything is generated."""
    if max_new_tokens <= 1:
        return [max_new_tokens] * n
    # At least 16 tokens (a quarter of the cap below 64: the window must stay open).
    shortest = min(16, max(1, max_new_tokens // 4))
    trace = lengths.paper_trace(max_new_tokens, min_len=shortest)
    rng = np.random.default_rng([run_seed, batch] + ([first_group] if first_group else []))
    return [int(k) for k in lengths.sample_lengths(trace, n, rng)[1]]


def make_requests(
    prompts: Sequence[Prompt],
    *,
    batch: int,
    group_size: int,
    max_new_tokens: int,
    sampling: SamplingParams,
    run_seed: int,
    id_prefix: str = "train",
    length_replay: bool = False,
    first_group: int = 0,
    keep_kv: bool = False,
) -> list[GenerationRequest]:
    """`group_size` requests per prompt of global batch `batch`.

    With `length_replay`, every response is forced to a length drawn from the
    paper's long-tail trace scaled to `max_new_tokens` (seeded by run and batch),
    as the paper's length-replay benchmarks do.

    Each request's tag: `batch`, `group` (index of the prompt in the batch),
    `member`, `prompt_id`; its metadata: the problem's (`task`, `entry`: what the
    reward function scores against). Groups are numbered from `first_group` (dynamic
    sampling's replacement prompts continue a batch's numbering). `keep_kv`: each
    request is an episode's first turn (`GenerationRequest.keep_kv`).
    """
    forced = [None] * (len(prompts) * group_size)
    if length_replay:
        forced = replay_lengths(run_seed, batch, len(forced), max_new_tokens, first_group)
    out = []
    for i, prompt in enumerate(prompts):
        g = first_group + i
        for m in range(group_size):
            out.append(
                GenerationRequest(
                    request_id=f"{id_prefix}/{batch}/{g}/{m}",
                    prompt=prompt.tokens,
                    max_new_tokens=max_new_tokens,
                    sampling=sampling,
                    seed=sample_seed(run_seed, batch, g, m),
                    forced_length=forced[i * group_size + m],
                    tag=RequestTag(
                        batch=batch, group=g, member=m, prompt_id=prompt.problem.prompt_id
                    ),
                    metadata=prompt.problem.metadata,
                    keep_kv=keep_kv,
                )
            )
    return out
