"""A policy's held-out episodes outside a run: in-process, or played by an agent framework
through an OpenAI-compatible endpoint (a served checkpoint).

A run evaluates its episodes in-process: the held-out requests (`Requests.held_out`:
greedy, `generation.max_new_tokens` a turn), each ended turn answered by the run's
environment (`rollouts.answer`: `environment.max_turns`, the episode budget).
`HeldOutEpisodes(cfg, tokenizer)` holds that evaluation's problems and environment as the
run builds them: the first `eval.num_problems` problems of `data.eval_seed`, their
prompts as the run tokenises them (`datasets.eval_prompts`), the run's environment (its
tools in their sandbox, answers scored on a reward pool of the run's scorer). Then:

* `in_process(engine)`: every problem's episode on `engine`, the episodes rollout's
  held-out path (the same requests, `rollouts.answer` on each ended turn, the next turn
  continued in its slot), driven here turn by turn.
* `served(url, token, model)`: every problem played by an OpenAI Agents SDK agent
  (`endpoint.agents_sdk.openai_agents_scaffold`) through the endpoint at `url` (`python
  -m streamrl_jax.serve`): one endpoint episode each (`X-Episode-Id`), temperature 0,
  the run's per-turn cap (`max_tokens`) and turn limit. The environment's steps run
  here, so scores and tool counts are the environment's; each turn's tokens are read
  off its response (the endpoint's `token_ids`, `usage.prompt_tokens`).

Both give an `EpisodeEvaluation`: per problem, correct, return, turns, tool calls, how
it ended, and each turn's policy tokens with the count of tokens before it; the accuracy.

When the two agree token for token. Greedy decoding is a function of the weights, the
tokens read and the shapes the engine computes with. The engines must hold the same
weights (the checkpoint read as a run reads it: `components.served`, what `serve`
builds) and decode with the same shapes: one decode shape (`pipeline.deterministic`;
decode buckets size each chunk by what else is running, which moves logits by float
rounding and can flip a near-tie) and the same slots (`serve --slots`). No turn may
re-prefill (a prefilled history is not bitwise a KV extended turn by turn): the served
evaluation plays at most `concurrency` episodes at once, no more than the server's
slots, so no request waits on a slot an idle episode keeps. The episode budget is the
same on both sides: `serve` holds an environment's episodes to the run's
(`Limits.episode_tokens`), so a served turn gets what is left of it as an in-process
one does, and the request past it is refused where the in-process episode ends
"episode_tokens" (the agent's episode then ends so too).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import Prompt
from streamrl_jax.endpoint.api import EPISODE_HEADER
from streamrl_jax.endpoint.client import EndpointClient
from streamrl_jax.endpoint.scaffolds import AgentTask
from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.types import GenerationRequest
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.pipeline import components, datasets, parts
from streamrl_jax.pipeline.requests import Requests
from streamrl_jax.pipeline.rollouts import (
    EpisodeRecord,
    answer,
    episode_outcome,
    question_of,
)
from streamrl_jax.rewards.pool import RewardPool

if TYPE_CHECKING:
    import openai


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
    """How one held-out episode went."""

    prompt_id: str
    correct: bool  # its last answer's score
    ret: float  # its return (the sum of its turns' rewards)
    turns: int  # policy turns
    tool_calls: int
    outcome: str  # how it ended: done, turn_limit, episode_tokens (context: in-process)
    tokens: tuple[tuple[int, ...], ...]  # each turn's policy tokens, as sampled
    read: tuple[int, ...]  # each turn: the tokens before it (prompt, turns, environment)

    def same_outcome(self, other: EpisodeOutcome) -> bool:
        """Whether `other` scored and called alike (correct, return, turns, tool calls)."""
        keys = ("correct", "ret", "turns", "tool_calls")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    def same_tokens(self, other: EpisodeOutcome) -> bool:
        """Whether `other` read and sampled the same tokens, turn by turn."""
        return (self.tokens, self.read) == (other.tokens, other.read)


@dataclasses.dataclass(frozen=True)
class EpisodeEvaluation:
    """The held-out episodes of one evaluation, in problem order, and its wall time."""

    episodes: tuple[EpisodeOutcome, ...]
    wall_s: float

    @property
    def accuracy(self) -> float:
        """The fraction of the problems answered correctly (4 decimals)."""
        return round(sum(e.correct for e in self.episodes) / max(len(self.episodes), 1), 4)

    def agreement(self, other: EpisodeEvaluation) -> dict[str, int]:
        """Problems whose outcome (`EpisodeOutcome.same_outcome`) and whose tokens
        (`same_tokens`) are the same in `other`, an evaluation of the same problems."""
        pairs = list(zip(self.episodes, other.episodes, strict=True))
        if any(a.prompt_id != b.prompt_id for a, b in pairs):
            raise ValueError("the two evaluations are not of the same problems")
        return {
            "outcomes": sum(a.same_outcome(b) for a, b in pairs),
            "tokens": sum(a.same_tokens(b) for a, b in pairs),
        }


def policy_engine(
    cfg: ExperimentConfig, *, checkpoint: str = "", slots: int = 16, top_logprobs: int = 20
) -> tuple[Engine, Tokenizer]:
    """One engine holding the policy `serve` serves with these flags
    (`components.served`), on the first generation instance's devices."""
    served, params, tokenizer = components.served(
        cfg, checkpoint=checkpoint, slots=slots, top_logprobs=top_logprobs
    )
    engine = Engine(
        served.graphdef, params[0], served.model_cfg, served.engine_cfgs[0], served.instances[0]
    )
    return engine, tokenizer


class HeldOutEpisodes:
    """A run's held-out problems and environment, played in-process or through an
    endpoint (module docstring); `close` ends the environment's tools and scorer."""

    def __init__(self, cfg: ExperimentConfig, tokenizer: Tokenizer):
        """Args:
        cfg: the run's config (`environment.name` set; `data.eval_seed` and
          `eval.num_problems` choose the problems: `evaluation.with_eval_seed`).
        tokenizer: the policy's.

        Raises:
          UserError: no environment (single responses: `evaluation.Evaluator`).
        """
        if not cfg.environment.name:
            raise UserError(
                "environment.name is empty: held-out episodes need the run's environment "
                "(single responses: pipeline/evaluation.py's Evaluator)"
            )
        self.cfg = cfg
        eval_set = datasets.eval_set(cfg)
        self.prompts: list[Prompt] = datasets.eval_prompts(cfg, tokenizer, eval_set)
        task = datasets.reward_fn(cfg, eval_set)
        self.pool = RewardPool(
            datasets.episode_reward(cfg, task),
            num_workers=2,
            on_error=cfg.data.reward_errors,
            sandbox=datasets.reward_sandbox(cfg),
        )
        self.kit = parts.episode_kit(cfg, tokenizer, self.pool)

    def close(self) -> None:
        self.kit.close()
        self.pool.close(cancel_pending=True)

    def in_process(self, engine: Engine) -> EpisodeEvaluation:
        """Every problem's episode on `engine`, greedy, as a run evaluates them."""
        t0 = time.perf_counter()
        env = self.kit.environment
        requests = Requests.from_config(self.cfg).held_out(0, self.prompts)
        records, turns, ended = {}, collections.defaultdict(list), {}
        for r in requests:
            start = env.start(question_of(r.metadata), r.metadata)
            records[r.request_id] = EpisodeRecord(state=start.state)
        engine.submit(requests)
        while engine.has_work():
            for s in engine.step():
                ep, rid = records[s.request_id], s.request_id
                ep.turns += 1
                turns[rid].append((len(s.prompt) + ep.turn_start, s.response[ep.turn_start :]))
                how: GenerationRequest | str = "context"  # past the engine's context
                if s.finish_reason in ("stop", "length"):
                    ep.cut_turns += s.finish_reason == "length"
                    how = answer(self.kit, s, ep)
                if isinstance(how, GenerationRequest):
                    engine.submit([how])
                    continue
                engine.release(rid)
                if how != "done":
                    env.end(ep.state)
                ended[rid] = episode_outcome(s, ep, how, 0)
        episodes = []
        for r, p in zip(requests, self.prompts, strict=True):
            e, played = ended[r.request_id], turns[r.request_id]
            episodes.append(
                EpisodeOutcome(
                    prompt_id=str(p.problem.prompt_id),
                    correct=bool(e["correct"]),
                    ret=float(e["return"]),
                    turns=int(e["turns"]),
                    tool_calls=int(e["tool_calls"]),
                    outcome=e["outcome"],
                    tokens=tuple(tuple(t.tolist()) for _, t in played),
                    read=tuple(int(n) for n, _ in played),
                )
            )
        return EpisodeEvaluation(tuple(episodes), time.perf_counter() - t0)

    def served(
        self,
        url: str,
        token: str,
        model: str = "policy",
        *,
        concurrency: int = 8,
        timeout_s: float = 300.0,
    ) -> EpisodeEvaluation:
        """Every problem played by an OpenAI Agents SDK agent through the endpoint at
        `url` (its base URL, `http://host:port`), greedy, `concurrency` episodes at once
        (at most the server's slots for token-exact agreement: module docstring), each
        request within `timeout_s`.

        Raises:
          ImportError: the SDK is not installed (`pip install openai-agents`).
          TimeoutError: the episodes did not end in time (naming how many).
        """
        from streamrl_jax.endpoint.agents_sdk import openai_agents_scaffold

        g, e = self.cfg.generation, self.cfg.environment
        seen = _Responses()
        scaffold = openai_agents_scaffold(
            self.kit.environment, model, e.max_turns, g.max_new_tokens,
            temperature=0.0, http_client=seen.client,
        )  # fmt: skip
        client = EndpointClient(url.removesuffix("/v1"), token, timeout=timeout_s)

        def play(p: Prompt) -> EpisodeOutcome:
            eid = client.open()
            oc = client.openai(eid)
            try:
                task = AgentTask(question_of(p.problem.metadata), p.problem.metadata)
                result = scaffold(task, oc)
            finally:
                oc.close()
                counts = client.close(eid)
            played = seen.turns(eid)
            if len(played) != counts["turns"]:
                raise RuntimeError(
                    f"episode {eid}: {len(played)} responses read, the endpoint recorded "
                    f"{counts['turns']} turns"
                )
            return EpisodeOutcome(
                prompt_id=str(p.problem.prompt_id),
                correct=bool(result.correct),
                ret=float(result.reward),
                turns=len(played),
                tool_calls=result.tool_calls,
                outcome=result.outcome,
                tokens=tuple(t for _, t in played),
                read=tuple(n for n, _ in played),
            )

        t0 = time.perf_counter()
        n = len(self.prompts)
        # every request of an episode has its deadline; this bounds the whole evaluation
        bound = e.max_turns * (timeout_s + 10.0) * -(-n // concurrency)
        pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="served-eval")
        try:
            futures = [pool.submit(play, p) for p in self.prompts]
            done, late = concurrent.futures.wait(futures, timeout=bound)
            if late:
                raise TimeoutError(
                    f"served evaluation: {len(late)} of {n} episodes not ended in {bound:.0f} s"
                )
            episodes = tuple(f.result() for f in futures)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            client.close_client()
        return EpisodeEvaluation(episodes, time.perf_counter() - t0)


class _Responses:
    """Each episode's chat completions as the endpoint returned them (its `token_ids` and
    `usage.prompt_tokens`), read off the agents' HTTP responses."""

    def __init__(self):
        self._lock = threading.Lock()
        self._turns: dict[str, list[tuple[int, tuple[int, ...]]]] = collections.defaultdict(list)

    def client(self) -> openai.DefaultAsyncHttpxClient:
        """An episode's HTTP client (the `openai` client's, with its defaults) that reads
        them."""
        import openai

        return openai.DefaultAsyncHttpxClient(event_hooks={"response": [self._read]})

    async def _read(self, response: Any) -> None:  # the client's Response
        request = response.request
        if not request.url.path.endswith("/chat/completions") or response.status_code != 200:
            return
        await response.aread()
        body: dict[str, Any] = response.json()
        (choice,) = body["choices"]
        turn = (int(body["usage"]["prompt_tokens"]), tuple(int(t) for t in choice["token_ids"]))
        with self._lock:
            self._turns[request.headers[EPISODE_HEADER]].append(turn)

    def turns(self, eid: str) -> list[tuple[int, tuple[int, ...]]]:
        with self._lock:
            return list(self._turns.pop(eid, []))
