"""An endpoint request as a generation request of its episode, and the turn it made.

Template boundaries (docs/endpoint.md): the first chat request is rendered whole with
the checkpoint's chat template (`Tokenizer.encode_chat`, ending in the assistant
header). A later request must repeat the episode's recorded conversation (the
assistant turns as the endpoint returned them); only its new messages are tokenised,
as the chat template frames them after an assistant turn (`TurnRenderer.observation`:
the closing the policy did not sample, the messages, the next assistant header), and
appended to the recorded tokens with policy mask False. The engine continues the
episode's slot with them (KV extended in place when the slot is still kept). A
completions episode works the same on text: a later prompt must extend the recorded
text (prompt and completions so far), and only the extension is tokenised.

Episode budget (`Limits.episode_tokens`, a run's `environment.max_episode_tokens`): the
rule of in-process episodes (`pipeline/rollouts/episodes.answer`). The tokens after the
episode's first prompt (its turns and every appended token, the new request's
included) count; a turn samples at most min(`max_tokens`, what is left), and a request
that leaves no token is refused with `context_length_exceeded`, exactly where the
episode in-process ends "episode_tokens". Without a budget (0) a turn is bounded by
`max_tokens` and the engine's context only.

Stop strings are the engine's `SamplingParams.stop_texts`: it ends a turn with the
token that completed one (the tokens recorded are exactly those sampled, through that
token), and the turn's text is cut before the first stop string (OpenAI's: the text
returned does not contain it). The next turn goes on from the recorded tokens, with the
template's closing of a turn the policy did not end itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from streamrl_jax.endpoint.api import ApiError, Chat, Sampling
from streamrl_jax.endpoint.book import Record
from streamrl_jax.environments.render import TurnRenderer
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.generation.types import (
    Continuation,
    GenerationRequest,
    Sample,
    SamplingParams,
)
from streamrl_jax.model import function_calls
from streamrl_jax.model.tokenizer import Tokenizer

# OpenAI's error code for a conversation past the model's context (scaffolds end the
# episode on it: `scaffolds.environment_scaffold`).
CONTEXT_EXCEEDED = "context_length_exceeded"


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one completion sampled (the response's tokens, as recorded)."""

    token_ids: np.ndarray  # i32[K] the policy's new tokens
    logprobs: np.ndarray  # f32[K] their behaviour log-probs
    versions: np.ndarray  # i32[K] the weights version that sampled each
    text: str  # the completion text (stop tokens and stop strings not included)
    finish_reason: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int  # tokens the model read before this completion
    episode: str = ""  # the episode's id
    # chat: the message's text outside its tool calls (the whole message, a required
    # call's opening included, when it made no call), and its calls
    content: str | None = None
    calls: tuple[function_calls.Call, ...] = ()
    malformed: bool = False  # call markup that could not be read (returned as text)
    # i32[K, k], f32[K, k] each token's k most likely alternatives and their log-probs
    # (an engine with `EngineConfig.top_logprobs` k); None otherwise
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Context:
    """The engine's bounds and the tokenizer."""

    tokenizer: Tokenizer
    max_prompt_length: int
    max_total_length: int
    top_logprobs: int = 0  # alternatives per token the engine keeps

    @classmethod
    def of(cls, tokenizer: Tokenizer, engine: EngineConfig) -> Context:
        return cls(
            tokenizer, engine.max_prompt_length, engine.max_total_length, engine.top_logprobs
        )


class Turns:
    """Requests of episodes -> generation requests; samples -> recorded turns."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.renderer = TurnRenderer(ctx.tokenizer)
        self._stops = tuple(ctx.tokenizer.stop_ids)
        self.convention = function_calls.of_tokenizer(ctx.tokenizer)

    # ------------------------------------------------------------------ requests
    def chat(
        self, rec: Record, chat: Chat, s: Sampling, params: SamplingParams, budget: int
    ) -> GenerationRequest:
        """The generation request of a chat completion of episode `rec` (`params`:
        `sampling(s)`; `budget`: the episode's tokens after its first prompt,
        `Limits.episode_tokens`, 0: none)."""
        self._kind(rec, "chat")
        tok, convention = self.ctx.tokenizer, self.convention
        opening = tok.encode(convention.opening(chat.choice)) if chat.tools else []
        if rec.sample is None:
            prompt = tok.encode(function_calls.chat_text(tok, chat.messages, chat.tools))
            rec.tools = list(chat.tools)
            return self._first(rec, prompt + opening, s, params, budget)
        messages, n = chat.messages, len(rec.messages)
        if len(messages) <= n or messages[:n] != rec.messages:
            pairs = enumerate(zip(messages, rec.messages, strict=False))
            i = next((i for i, (a, b) in pairs if a != b), min(len(messages), n))
            raise ApiError(
                400,
                f"messages: the history does not repeat episode {rec.id}'s recorded "
                f"conversation ({n} messages; first difference at messages[{i}]): send it "
                "as returned, then the new messages",
                "messages",
            )
        if chat.tools != rec.tools:
            raise ApiError(
                400,
                f"tools: episode {rec.id} was started with other tools (they are in its "
                "prompt); send the same tools with every request of an episode",
                "tools",
            )
        new = messages[n:]
        for i, m in enumerate(new, start=n):
            if m["role"] == "assistant":
                why = f"messages[{i}]: an assistant turn this endpoint did not sample"
                raise ApiError(400, why, "messages")
        last = rec.sample
        ended = int(last.response[-1]) if last.finish_reason == "stop" else None
        observed = function_calls.template_messages(convention, new)
        env_tokens = self.renderer.observation(observed, ended) + opening
        return self._next(rec, env_tokens, s, params, budget)

    def completion(
        self, rec: Record, prompt: str, s: Sampling, params: SamplingParams, budget: int
    ) -> GenerationRequest:
        """The generation request of a text completion of episode `rec` (`budget`: as
        `chat`'s)."""
        self._kind(rec, "completion")
        if rec.sample is None:
            return self._first(rec, self.ctx.tokenizer.encode(prompt), s, params, budget)
        if not prompt.startswith(rec.text) or len(prompt) == len(rec.text):
            raise ApiError(
                400,
                f"prompt: episode {rec.id}'s next prompt must extend its recorded text (the "
                "prompt and completions so far) with new text",
                "prompt",
            )
        suffix = self.ctx.tokenizer.encode(prompt[len(rec.text) :])
        return self._next(rec, suffix, s, params, budget)

    def _kind(self, rec: Record, kind: str) -> None:
        if rec.kind and rec.kind != kind:
            raise ApiError(400, f"episode {rec.id} is a {rec.kind} episode, not a {kind} one")
        rec.kind = kind

    def _first(
        self, rec: Record, prompt: list[int], s: Sampling, params: SamplingParams, budget: int
    ) -> GenerationRequest:
        if not 1 <= len(prompt) <= self.ctx.max_prompt_length:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens; at most {self.ctx.max_prompt_length}",
                "messages",
            )
        if rec.seed is None:
            rec.seed = s.seed if s.seed is not None else _seed_of(rec.id)
        elif s.seed is not None and s.seed != rec.seed:
            raise ApiError(400, f"seed={s.seed}: episode {rec.id} samples with its own", "seed")
        rec.prompt = prompt
        cap = min(s.max_tokens, budget) if budget else s.max_tokens
        return GenerationRequest(
            request_id=rec.id,
            prompt=prompt,
            max_new_tokens=cap,
            forced_length=cap if s.ignore_eos else None,
            sampling=params,
            seed=rec.seed,
            metadata=rec.metadata,
            keep_kv=True,
        )

    def _next(
        self,
        rec: Record,
        env_tokens: list[int],
        s: Sampling,
        params: SamplingParams,
        budget: int,
    ) -> GenerationRequest:
        if s.seed is not None and s.seed != rec.seed:
            raise ApiError(
                400, f"seed={s.seed}: episode {rec.id} samples with its first seed", "seed"
            )
        if not env_tokens:
            raise ApiError(400, "the request adds nothing after the recorded turn")
        cont = Continuation.after(rec.sample, env_tokens)
        used = len(rec.prompt) + len(cont.tokens)
        if used + 1 > self.ctx.max_total_length:
            raise ApiError(
                400,
                f"episode {rec.id} has used {used} of its {self.ctx.max_total_length} tokens "
                "of context; start a new episode",
                code=CONTEXT_EXCEEDED,
            )
        cap = s.max_tokens
        if budget:
            left = budget - len(cont.tokens)  # as in-process: `rollouts.episodes.answer`
            if left < 1:
                raise ApiError(
                    400,
                    f"episode {rec.id} has used {len(cont.tokens)} of its {budget} tokens "
                    "after its first prompt (the episode's budget); start a new episode",
                    code=CONTEXT_EXCEEDED,
                )
            cap = min(cap, left)
        # Not `GenerationRequest.next_turn`: the endpoint's turn carries the record's
        # identity (its episode id `ep-...`, prompt, seed, metadata), which the backend
        # keys on and maps back to the run's (`Backend.submit`); the sample holds the
        # run's id, which the backend refuses.
        return GenerationRequest(
            request_id=rec.id,
            prompt=rec.prompt,
            max_new_tokens=cont.policy_tokens + cap,
            forced_length=cont.policy_tokens + cap if s.ignore_eos else None,
            sampling=params,
            seed=rec.seed,
            metadata=rec.metadata,
            continuation=cont,
            keep_kv=True,
        )

    def sampling(self, s: Sampling) -> SamplingParams:
        """The engine's sampling of `s` (its stop strings read by the engine on text).

        Raises:
          ApiError: more alternatives per token than the engine keeps.
        """
        if s.top_logprobs > self.ctx.top_logprobs:
            raise ApiError(
                400,
                f"top_logprobs={s.top_logprobs}: this endpoint returns at most "
                f"{self.ctx.top_logprobs} alternatives per token (its engine's top_logprobs)",
                "top_logprobs",
            )
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            stop_ids=self._stops,
            stop_texts=tuple(dict.fromkeys(s.stop)),
        )

    # ------------------------------------------------------------------ samples
    def commit(
        self, rec: Record, request: GenerationRequest, sample: Sample, said: Chat | str
    ) -> Turn:
        """Records `sample` as the episode's latest turn (`said`: the chat or the prompt
        text of the request) and returns what it sampled."""
        start = request.history
        new = sample.response[start:]
        finish = "stop" if sample.finish_reason == "stop" else "length"
        text = _before_stop(self.ctx.tokenizer.decode(new), request.sampling.stop_texts)
        top = (None, None)
        if sample.top_ids is not None and sample.top_logprobs is not None:
            top = (sample.top_ids[start:], sample.top_logprobs[start:])
        turn = Turn(
            token_ids=np.asarray(new, np.int32),
            logprobs=np.asarray(sample.logprobs[start:], np.float32),
            versions=sample.versions()[start:],
            text=text,
            finish_reason=finish,
            prompt_tokens=len(request.prompt) + start,
            episode=rec.id,
            top_ids=top[0],
            top_logprobs=top[1],
        )
        if isinstance(said, Chat):
            turn = self._message(rec, turn, said)
            message = {"role": "assistant", "content": turn.content or ""}
            if turn.calls:
                message["tool_calls"] = [
                    {"id": c.id, "name": c.name, "arguments": c.arguments} for c in turn.calls
                ]
            rec.messages = [*said.messages, message]
        else:
            rec.text = said + text
        rec.sample = sample
        rec.turns += 1
        rec.cut += finish == "length"
        return turn

    def _message(self, rec: Record, turn: Turn, chat: Chat) -> Turn:
        """`turn` read as a chat message: its tool calls (a view of the sampled text, the
        call's opening before it when one was required) or its text."""
        full = turn.text
        if chat.tools:
            full = self.convention.opening(chat.choice) + full
        read = function_calls.interpret(self.convention, full, chat.tools, chat.choice)
        if not read.calls:
            return dataclasses.replace(turn, content=full, malformed=read.malformed)
        calls = tuple(
            function_calls.Call(
                function_calls.call_id(rec.id, rec.turns, i), name, json.dumps(args)
            )
            for i, (name, args) in enumerate(read.calls)
        )
        return dataclasses.replace(
            turn, content=read.content, calls=calls, finish_reason="tool_calls"
        )


def _before_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to its first stop string (all of it when it holds none)."""
    at = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(at)] if at else text


def _seed_of(eid: str) -> int:
    """An episode's default sampling seed: from its id (31 bits)."""
    return int.from_bytes(hashlib.sha256(eid.encode()).digest()[:4], "little") >> 1
