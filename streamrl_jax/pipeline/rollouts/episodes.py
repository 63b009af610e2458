"""Episodes: every sample is a multi-turn episode with an environment (DESIGN.md §9).

`pipeline.rollout="episodes+KIND"` with `environment.name` set. The kind decides what
a step trains exactly as for single-turn samples (`full`: every group of batch b;
`dynamic_sampling`: groups with reward variance); this wrapper turns each request into
an episode, held-out evaluations included:

* a request's sample ends a **turn** (the policy's end-of-turn token). The turn's
  message goes to the environment (`Environment.step`) on the kit's threads
  (`episode-env`, `environment.workers` of them: a tool call waits on the sandbox, not
  on the collector): the collector takes the outcome later (`Returned.later`), counting
  the episode as a request still out, so a weight swap between batches waits for it.
* not done: the environment's tokens (`render.TurnRenderer`) are appended and the next
  turn is a continuation of the same request id with `keep_kv`: the engine extends
  the slot's KV in place (or re-prefills, counted, when the slot was given up). The
  sampling counter goes on from the policy-token count, so an episode depends only on
  (weights, prompt, seed, environment).
* done, or a limit hit: the episode is handed on as **one sample**: the prompt, then
  every token after it (the policy's with their behaviour log-probs and versions; the
  environment's with policy mask False, never trained), ending with the last policy
  token, and its outcome in `metadata["episode"]` (return, correct, turns, tool calls,
  failures, how it ended), which `environments.EpisodeReward` scores.

Limits (`environments.EpisodeLimits`) and how an episode ends (`outcome`):
"done" (the environment), "turn_limit" (`environment.max_turns` turns), "context"
(the model's context), "episode_tokens" (the next turn would not fit
`environment.max_episode_tokens`), "lag" (partial rollout: dropped past `max_lag`).
Every outcome but "done" counts as truncated; the return is the sum of the turn
rewards so far. A turn that reaches
`generation.max_new_tokens` without its end-of-turn token is cut there and still goes
to the environment (the chat template's closing is appended with the observation);
such turns are counted (`cut_turns`).

Advantage: the episode's return is the sample's reward, so the kind's group-relative
estimator compares the G episodes of a task and every policy token of an episode gets
its episode's advantage (no per-turn credit; docs/episodes.md). Shared-prompt rows and
packing work unchanged: a group's episodes share their first prompt.

Versions: every policy token keeps the version that sampled it; an environment token
records the version of the policy turn before it (its KV is computed at the next
turn's admission, under whatever weights the engine holds then) and is ignored by the
lag (`Sample.oldest_version` reads policy tokens only). Checkpoints: over `full` or
`dynamic_sampling` an episode lives within its batch, which a resumed run regenerates
from its start (the same seeds, the restored W_g(b), a deterministic environment), so
the checkpoint holds no episode state.

Over `partial` (`protocol.Rounds`; docs/episodes.md "Partial rollout of episodes") the
round budget is the episode's: a turn pauses at what is left of it; a turn's next turn
joins the open round with the rest (`Rounds.next_turn`) or is carried into the next
round, its kept slot given up (it re-prefills there under that round's weights). A
paused episode is handed to the rounds with its record kept for the round it is
carried into (`state(k)` puts those of round k in the checkpoint; `restore` takes
them back) and with the outcome it ends with should `max_lag` drop it ("lag").
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from streamrl_jax.environments import EpisodeKit, TurnInfo
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    Rollout,
    RolloutContext,
    Rounds,
    StepOutcome,
    Wrapper,
)

OUTCOMES = ("done", "turn_limit", "context", "episode_tokens", "lag")


@dataclasses.dataclass
class EpisodeRecord:
    """One episode in flight (touched by one thread at a time: the collector, then the
    environment thread stepping it)."""

    state: dict[str, Any]
    turn_start: int = 0  # where the current turn's policy tokens begin in the response
    turns: int = 0
    ret: float = 0.0
    tool_calls: int = 0
    tool_failures: int = 0
    malformed_calls: int = 0
    cut_turns: int = 0  # turns that reached generation.max_new_tokens without ending
    last: TurnInfo = TurnInfo()

    def to_json(self) -> dict[str, Any]:
        """A copy as JSON (the environment's state is JSON by contract: TypeError or
        ValueError when it is not)."""
        return json.loads(json.dumps(dataclasses.asdict(self), allow_nan=False))

    @classmethod
    def from_json(cls, x: dict[str, Any]) -> EpisodeRecord:
        return cls(**{**x, "last": TurnInfo(**x["last"])})

    def add(self, info: TurnInfo, reward: float) -> None:
        self.ret += reward
        self.tool_calls += info.tool_calls
        self.tool_failures += info.tool_failures
        self.malformed_calls += info.malformed_calls
        if info.answered:
            self.last = info


def question_of(metadata: dict[str, Any]) -> str:
    """The task's question text (a reasoning-gym or JSONL entry's)."""
    entry = metadata.get("entry")
    if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
        raise ValueError(f"prompt {metadata.get('prompt_id', '?')}: no question in its metadata")
    return entry["question"]


def answer(kit: EpisodeKit, sample: Sample, ep: EpisodeRecord) -> GenerationRequest | str:
    """The environment's answer to the policy turn `sample` ended (its episode `ep`, the
    turn counted): the episode's next turn (the environment's tokens appended, the turn
    capped by `turn_tokens` and what is left of the episode's budget), or how the
    episode ended ("done", "turn_limit", "episode_tokens"). Steps the environment;
    updates `ep`.

    Raises:
      RuntimeError: the environment's step raised (naming the episode and the turn).
    """
    env, limits = kit.environment, kit.limits
    message = kit.renderer.tokenizer.decode(sample.response[ep.turn_start :])
    try:
        result = env.step(ep.state, message, sample.metadata)
    except Exception as e:
        raise RuntimeError(
            f"environment {env.name!r}: episode {sample.request_id!r}, turn {ep.turns}: {e!r}"
        ) from e
    ep.state = result.state
    ep.add(result.info, result.reward)
    if result.done:
        return "done"
    if ep.turns >= limits.max_turns:
        return "turn_limit"
    ended = int(sample.response[-1]) if sample.finish_reason == "stop" else None
    env_tokens = kit.renderer.observation(result.observation, ended)
    used = sample.num_tokens + len(env_tokens)
    left = limits.episode_tokens - used
    if left < 1:
        return "episode_tokens"
    ep.turn_start = used
    return GenerationRequest.next_turn(sample, env_tokens, min(left, limits.turn_tokens))


def episode_outcome(
    sample: Sample, ep: EpisodeRecord, outcome: str, in_turn: int
) -> dict[str, Any]:
    """`metadata["episode"]` of `sample`, ending now with `outcome` (`in_turn`: a turn
    under way counts)."""
    env_tokens = 0 if sample.policy_mask is None else int((~sample.policy_mask).sum())
    return {
        "return": ep.ret,
        "correct": ep.last.correct,
        "format_ok": ep.last.format_ok,
        "answer": ep.last.answer,
        "turns": ep.turns + in_turn,
        "tool_calls": ep.tool_calls,
        "tool_failures": ep.tool_failures,
        "malformed_calls": ep.malformed_calls,
        "cut_turns": ep.cut_turns,
        "env_tokens": env_tokens,
        "outcome": outcome,
    }


class Episodes(Wrapper):
    """Episodes over the rollout kind `inner`, with the run's environment `kit` (module
    docstring)."""

    def __init__(
        self,
        ctx: RolloutContext,
        inner: Callable[[RolloutContext], Rollout],
        kit: EpisodeKit | None,
    ):
        # A training process of a multi-controller run holds the trainer's half only:
        # the episodes arrive whole, and no environment runs there.
        if kit is None and ctx.where != "trainer":
            raise ValueError("pipeline.rollout 'episodes' needs an environment (environment.name)")
        self.kit = kit
        super().__init__(inner(ctx))
        self._lock = threading.Lock()
        self._live: dict[Any, EpisodeRecord] = {}
        self._stats: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        # Partial rollout: round -> {request id: the record of an episode carried into
        # it, as it was then} (what a checkpoint at that round holds).
        self._rounds = isinstance(self.inner, Rounds)
        self._records: dict[int, dict[Any, dict[str, Any]]] = collections.defaultdict(dict)

    # ------------------------------------------------------------------ generation side
    def returned(self, sample: Sample) -> Returned:
        """A turn ended: its episode goes on (the environment's step, off this thread)
        or is handed on whole."""
        assert self.kit is not None, "a trainer's half never gets a sample back"
        with self._lock:
            ep = self._live.get(sample.request_id)
            if ep is None:
                start = self.kit.environment.start(question_of(sample.metadata), sample.metadata)
                ep = self._live[sample.request_id] = EpisodeRecord(state=start.state)
        if sample.finish_reason == "paused":  # partial rollout: on in a later round
            return self._carried(self.inner.returned(self._as_paused(sample, ep, 1)), ep)
        ep.turns += 1
        if sample.finish_reason not in ("stop", "length"):
            return self._end(sample, ep, "context")
        ep.cut_turns += sample.finish_reason == "length"
        return Returned(None, [], later=self.kit.submit(self._step, sample, ep))

    def _step(self, sample: Sample, ep: EpisodeRecord) -> Returned:
        """The environment's answer to the turn (an `episode-env` thread)."""
        request = answer(self.kit, sample, ep)
        if isinstance(request, str):
            return self._end(sample, ep, request)
        if not self._rounds or sample.tag.is_eval:
            return Returned(None, [request])
        turn = dataclasses.replace(sample, finish_reason="paused")
        return self._carried(self.inner.next_turn(self._as_paused(turn, ep, 0), request), ep)

    def _as_paused(self, paused: Sample, ep: EpisodeRecord, in_turn: int) -> Sample:
        """Partial rollout: a paused episode (`in_turn` = 1 mid-turn, 0 between turns),
        its record kept for the round it may be carried into, its metadata what it is
        handed on with should the lag bound drop it."""
        try:
            record = ep.to_json()
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"environment {self.kit.environment.name!r}: episode {paused.request_id!r}'s "
                f"state is not JSON, so a checkpoint cannot hold it: {e}"
            ) from e
        with self._lock:
            self._records[paused.tag.round + 1][paused.request_id] = record
        metadata = {**paused.metadata, "episode": episode_outcome(paused, ep, "lag", in_turn)}
        return dataclasses.replace(paused, metadata=metadata)

    def _carried(self, placed: Returned, ep: EpisodeRecord) -> Returned:
        """The rounds' answer for a paused episode: it goes on, or (past the lag bound) is
        handed on as it is, to be dropped with its group."""
        if placed.sample is not None:
            with self._lock:
                self._live.pop(placed.sample.request_id, None)
        return placed

    def _end(self, sample: Sample, ep: EpisodeRecord, outcome: str) -> Returned:
        """The episode, whole, with its outcome in its metadata."""
        with self._lock:
            self._live.pop(sample.request_id, None)
        if outcome != "done":
            self.kit.environment.end(ep.state)
        episode = episode_outcome(sample, ep, outcome, 0)
        whole = dataclasses.replace(sample, metadata={**sample.metadata, "episode": episode})
        if sample.tag.is_eval:
            return Returned(whole, [])
        return self.inner.returned(whole)

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        """A scored episode: counted for its step's metrics (here, where it is trained),
        then where the kind puts it."""
        tag = scored.sample.tag
        with self._lock:  # (partial rollout: by the round it ended in)
            self._stats[max(tag.round, tag.batch)].append(scored.sample.metadata["episode"])
        self.inner.scored(scored)

    # ------------------------------------------------------------------ trainer side
    def finish(self, batch: int) -> StepOutcome:
        out = self.inner.finish(batch)
        with self._lock:  # every episode scored since the last step, of rounds up to b
            episodes = [e for q in sorted(self._stats) if q <= batch for e in self._stats.pop(q)]
            for q in [q for q in self._records if q < batch]:
                del self._records[q]
        return dataclasses.replace(out, metrics={**out.metrics, **episode_metrics(episodes)})

    def plannable(self, start: int, steps: int) -> range | None:
        return None  # an episode's length depends on what is sampled and answered

    # ------------------------------------------------------------------ checkpoints
    def state(self, k: int) -> dict[str, Any]:
        """The kind's state, and (partial rollout) the records of the episodes carried
        into round k, as they were when carried."""
        out = self.inner.state(k)
        if self._rounds and out.get("paused"):
            with self._lock:
                records = self._records.get(k, {})
                ids = [x["request_id"] for x in out["paused"]]
                out["episodes"] = [[rid, records[rid]] for rid in ids]
        return out

    def restore(self, k: int, state: dict[str, Any]) -> list[Sample]:
        finished = self.inner.restore(k, state)
        with self._lock:
            for rid, record in state.get("episodes", []):
                self._live[rid] = EpisodeRecord.from_json(record)
                self._records[k][rid] = record
        return finished

    def fail(self, exc: BaseException) -> None:
        if self.kit is not None:
            self.kit.cancel()  # the kit closes with the run
        self.inner.fail(exc)


def episode_metrics(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """A step's episode figures: means per episode, rates over episodes."""
    if not episodes:
        return {}
    mean = lambda key: float(np.mean([e[key] for e in episodes]))  # noqa: E731
    return {
        "episode_turns": mean("turns"),
        "episode_tool_calls": mean("tool_calls"),
        "episode_tool_call_rate": float(np.mean([e["tool_calls"] > 0 for e in episodes])),
        "episode_tool_failures": float(sum(e["tool_failures"] for e in episodes)),
        "episode_malformed_calls": float(sum(e["malformed_calls"] for e in episodes)),
        "episode_env_tokens": mean("env_tokens"),
        "episode_cut_turns": mean("cut_turns"),
        "episode_truncated": float(np.mean([e["outcome"] != "done" for e in episodes])),
    }
