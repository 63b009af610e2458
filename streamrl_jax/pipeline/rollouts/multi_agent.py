"""Multi-agent episodes: several roles acting in one episode, each in a conversation of
its own, each trained on the tokens it sampled (docs/multi_agent.md).

`pipeline.rollout="multi_agent+full"` with a multi-agent environment
(`environments.protocol.MultiAgentEnvironment`, e.g. `environment.name="solve_verify"`).
A group of `pipeline.group_size` = G x R members holds G episodes of its prompt, each
with R seats: member m plays role `roles[m % R]` in episode `m // R`. So each role has
its own group of G samples, and the advantages compare a role's return with the same
role's in the other episodes of the prompt (`micro_batches.pack_groups` splits a group
by `metadata["role"]`).

* **Seats.** The batch's seat-0 requests are the episodes' first turns (the prompt
  pipeline renders `start`'s messages); `open` holds back the others. When the
  environment first hands a role a turn, that role's conversation starts from the
  messages it names (`Turn.messages`, rendered by the chat template): a request of its
  own (id `<seat 0's id>/<role>`, its member's tag and seed), which keeps its KV. A
  role that acted before goes on in its own conversation: the environment's messages
  appended to its KV (`render.TurnRenderer`), as a single-agent episode's turn does.
  Every agent is the run's one policy in its role (self-play).
* **The turn graph.** Each episode records its turns in order, who acted, the weights
  version that sampled the turn and how many tokens it wrote; every role's sample
  carries it (`metadata["turn_graph"]`), with the role's own return
  (`metadata["episode"]`, its `return` the sum of the rewards the environment gave it).
* **The end.** Once the environment says done (or a limit ends it: `environment.
  max_turns` counts every agent's turns; a role's own conversation is bounded by
  `environment.max_episode_tokens`, and a first prompt longer than the engine's
  `generation.max_prompt_len` ends the episode as "context"), every seat's conversation
  is handed on as one sample: R samples for the episode, its own tokens trained, the
  other agents' words environment tokens (policy mask False). A role that never acted
  is handed on masked (`RewardResult.masked`): left out of its group, never trained.
  A held-out episode hands on its `evaluated` role's conversation (the others' kept KV
  released).

Only the `full` kind runs under it (config/rules.py): dynamic sampling's refills and
partial rollout's rounds do not place later seats' turns yet. A seat > 0 request that
reaches the service anyway (a lost generation process's groups generated again) is
dropped when it returns, its slot released: its role's conversation starts from the
environment, as above.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from streamrl_jax.data import sample_seed
from streamrl_jax.environments import EpisodeKit
from streamrl_jax.environments.protocol import roles_of
from streamrl_jax.generation.types import GenerationRequest, RequestTag, Sample, Timings
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.rollouts.episodes import (
    EpisodeRecord,
    episode_metrics,
    episode_outcome,
    question_of,
)
from streamrl_jax.pipeline.rollouts.protocol import (
    Returned,
    Rollout,
    RolloutContext,
    StepOutcome,
    Wrapper,
)


@dataclasses.dataclass
class _Seat:
    """One role's conversation in an episode."""

    role: str
    record: EpisodeRecord  # its turns, return and last answer (`state` unused)
    last: Sample | None = None  # its last turn that ended (None: it has not acted)
    request_id: Any = None  # its conversation's request id once started


@dataclasses.dataclass
class _Table:
    """One multi-agent episode in flight."""

    state: dict[str, Any]
    seats: list[_Seat]
    first: GenerationRequest  # seat 0's first turn, as its sample echoes it
    graph: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.graph)


class MultiAgent(Wrapper):
    """Multi-agent episodes over the rollout kind `inner` (module docstring)."""

    def __init__(self, ctx: RolloutContext, inner, kit: EpisodeKit | None):
        if kit is None and ctx.where != "trainer":
            raise ValueError("pipeline.rollout 'multi_agent' needs an environment")
        super().__init__(inner(ctx))
        self.kit, self.run_seed = kit, ctx.seed
        self.roles: tuple[str, ...] = ()
        if kit is not None:
            self.roles = roles_of(kit.environment)
            if not self.roles:
                raise ValueError(
                    f"pipeline.rollout 'multi_agent': environment {kit.environment.name!r} "
                    "has one role (a multi-agent environment names its roles)"
                )
            if ctx.pipeline.group_size % len(self.roles):
                raise ValueError(
                    f"pipeline.group_size={ctx.pipeline.group_size} is not a multiple of "
                    f"the {len(self.roles)} roles of {kit.environment.name!r}"
                )
        self._lock = threading.Lock()
        self._tables: dict[Any, _Table] = {}
        self._stats: dict[int, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------------ seats
    def _seat(self, tag: RequestTag, request_id: Any) -> tuple[Any, int]:
        """(the episode's key, the seat) of a request or sample."""
        n = len(self.roles)
        if tag.is_eval:  # one episode per held-out prompt: seat 0 is the request itself
            base, _, role = str(request_id).rpartition("/")
            if role in self.roles[1:] and base.startswith("eval/"):
                return base, self.roles.index(role)
            return request_id, 0
        return (tag.batch, tag.group, tag.member // n), tag.member % n

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """The batch's seat-0 requests: each episode's first turn (the other seats start
        when the environment hands their role a turn)."""
        n = len(self.roles)
        return [q for q in self.inner.open(batch, requests) if q.tag.member % n == 0]

    # ------------------------------------------------------------------ generation side
    def returned(self, sample: Sample) -> Returned:
        kit = self.kit
        assert kit is not None, "a trainer's half never gets a sample back"
        key, r = self._seat(sample.tag, sample.request_id)
        with self._lock:
            table = self._tables.get(key)
            if table is None and r == 0:
                start = kit.environment.start(question_of(sample.metadata), sample.metadata)
                seats = [_Seat(role, EpisodeRecord(state={})) for role in self.roles]
                seats[0].request_id = sample.request_id
                table = self._tables[key] = _Table(start.state, seats, _request_of(sample))
        if table is None or table.seats[r].request_id != sample.request_id:
            # A later seat's request generated as a first turn (a lost process's group
            # made again): its role's conversation starts from the environment instead.
            return Returned(None, [], release=sample.request_id)
        if sample.finish_reason == "paused":
            raise ValueError("multi-agent episodes do not run under partial rollout")
        seat = table.seats[r]
        seat.record.turns += 1
        if sample.finish_reason not in ("stop", "length"):
            return self._end(key, table, sample, r, "context")
        seat.record.cut_turns += sample.finish_reason == "length"
        return Returned(None, [], later=kit.submit(self._step, key, table, sample, r))

    def _step(self, key: Any, table: _Table, sample: Sample, r: int) -> Returned:
        """The environment's answer to seat r's turn (an `episode-env` thread)."""
        kit = self.kit
        env, limits, renderer = kit.environment, kit.limits, kit.renderer
        seat = table.seats[r]
        seat.last = sample
        message = renderer.tokenizer.decode(sample.response[seat.record.turn_start :])
        try:
            turn = env.step(table.state, seat.role, message, sample.metadata)
        except Exception as e:
            raise RuntimeError(
                f"environment {env.name!r}: episode {key!r}, {seat.role}'s turn "
                f"{seat.record.turns}: {e!r}"
            ) from e
        table.state = turn.state
        policy = 0 if sample.policy_mask is None else int(sample.policy_mask.sum())
        mine = len(sample.response) - seat.record.turn_start
        versions = sample.token_versions
        table.graph.append(
            {
                "turn": table.turns,
                "role": seat.role,
                "version": int(versions[-1]) if versions is not None else sample.policy_version,
                "tokens": int(mine),
                "policy_tokens": policy,
            }
        )
        for role, reward in turn.rewards.items():
            if role not in self.roles:
                raise ValueError(f"environment {env.name!r}: a reward for unknown role {role!r}")
            table.seats[self.roles.index(role)].record.ret += float(reward)
        seat.record.add(turn.info, 0.0)
        if turn.to is None:
            return self._end(key, table, sample, r, "done")
        if turn.to not in self.roles:
            raise ValueError(f"environment {env.name!r}: the next role {turn.to!r} is unknown")
        if table.turns >= limits.max_turns:
            return self._end(key, table, sample, r, "turn_limit")
        nxt = table.seats[self.roles.index(turn.to)]
        if nxt.last is not None:  # its conversation goes on
            ended = int(nxt.last.response[-1]) if nxt.last.finish_reason == "stop" else None
            env_tokens = renderer.observation(turn.messages, ended)
            used = nxt.last.num_tokens + len(env_tokens)
            left = limits.episode_tokens - used
            if left < 1:
                return self._end(key, table, sample, r, "episode_tokens")
            nxt.record.turn_start = used
            request = GenerationRequest.next_turn(
                nxt.last, env_tokens, min(left, limits.turn_tokens)
            )
        else:  # its conversation starts
            tokens = renderer.tokenizer.encode_chat(turn.messages)
            if len(tokens) > limits.prompt_tokens:
                return self._end(key, table, sample, r, "context")
            request = self._first_turn(table, self.roles.index(turn.to), tokens)
            nxt.request_id = request.request_id
        return Returned(None, [request])

    def _first_turn(self, table: _Table, r: int, tokens: list[int]) -> GenerationRequest:
        """Seat r's first request: its conversation's id and its member's tag and seed."""
        q, role = table.first, self.roles[r]
        tag, seed = q.tag, q.seed
        if not tag.is_eval:
            member = tag.member + r
            tag = dataclasses.replace(tag, member=member)
            seed = sample_seed(self.run_seed, tag.batch, tag.group, member)
        return dataclasses.replace(
            q,
            request_id=f"{q.request_id}/{role}",
            prompt=list(tokens),
            max_new_tokens=self.kit.limits.turn_tokens,
            seed=seed,
            tag=tag,
            continuation=None,
            keep_kv=True,
        )

    def _end(self, key: Any, table: _Table, sample: Sample, r: int, outcome: str) -> Returned:
        """Every seat's conversation handed on (a held-out episode: the evaluated role's),
        each with its own outcome and the episode's turn graph."""
        with self._lock:
            self._tables.pop(key, None)
        if outcome != "done":
            self.kit.environment.end(table.state)
        table.seats[r].last = sample
        whole = []
        for i, seat in enumerate(table.seats):
            if seat.last is None:
                done = self._stand_in(table, i)
            else:
                episode = episode_outcome(seat.last, seat.record, outcome, 0)
                done = dataclasses.replace(seat.last, metadata={**seat.last.metadata,
                                           "episode": episode})  # fmt: skip
            meta = {**done.metadata, "role": seat.role, "turn_graph": list(table.graph)}
            whole.append(dataclasses.replace(done, metadata=meta))
        if sample.tag.is_eval:
            i = self.roles.index(self.kit.environment.evaluated)
            others = tuple(s.request_id for j, s in enumerate(table.seats)
                           if j != i and s.last is not None)  # fmt: skip
            return Returned(whole[i], [], released=others)
        outs = [self.inner.returned(w) for w in whole]
        handed = [o.sample for o in outs if o.sample is not None]
        return Returned(
            handed[0] if handed else None,
            [q for o in outs for q in o.now],
            also=tuple(handed[1:]),
        )

    def _stand_in(self, table: _Table, r: int) -> Sample:
        """A seat that never acted, as a masked sample of one environment token (left
        out of its group and never trained: `EpisodeReward` masks it)."""
        q = self._first_turn(table, r, table.first.prompt)
        version = table.graph[-1]["version"] if table.graph else 0
        stand_in = Sample(
            request_id=q.request_id,
            prompt=np.asarray(q.prompt, np.int32),
            response=np.zeros((1,), np.int32),
            logprobs=np.zeros((1,), np.float32),
            sampling_logprobs=np.zeros((1,), np.float32),
            finish_reason="context",
            policy_version=version,
            last_policy_version=version,
            instance_id=-1,
            timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
            tag=q.tag,
            metadata=q.metadata,
            token_versions=np.full((1,), version, np.int32),
            policy_mask=np.zeros((1,), bool),
            sampling=q.sampling,
            seed=q.seed,
        )
        episode = episode_outcome(stand_in, EpisodeRecord(state={}), "unacted", 0)
        episode["masked"] = f"role {self.roles[r]} never acted"
        return dataclasses.replace(stand_in, metadata={**q.metadata, "episode": episode})

    # ------------------------------------------------------------------ ingest
    def scored(self, scored: Scored) -> None:
        """A scored conversation: counted for its step's per-role metrics."""
        x = scored.sample
        with self._lock:
            step = max(x.tag.round, x.tag.batch)
            self._stats.setdefault(step, []).append(
                {**x.metadata["episode"], "role": x.metadata["role"]}
            )
        self.inner.scored(scored)

    # ------------------------------------------------------------------ trainer side
    def finish(self, batch: int) -> StepOutcome:
        out = self.inner.finish(batch)
        with self._lock:
            seats = [e for q in sorted(self._stats) if q <= batch for e in self._stats.pop(q)]
        metrics = dict(out.metrics)
        acted = [e for e in seats if not e.get("masked")]
        if acted:
            firsts = [e for e in acted if e["role"] == acted[0]["role"]]
            metrics |= episode_metrics(firsts)  # per episode: its first seat's counts
        for role in sorted({e["role"] for e in acted}):
            mine = [e for e in acted if e["role"] == role]
            metrics[f"role/{role}/return"] = float(np.mean([e["return"] for e in mine]))
            metrics[f"role/{role}/correct"] = float(np.mean([e["correct"] for e in mine]))
            metrics[f"role/{role}/turns"] = float(np.mean([e["turns"] for e in mine]))
        metrics["multi_agent/unacted"] = float(len(seats) - len(acted))
        return dataclasses.replace(out, metrics=metrics)

    def plannable(self, start: int, steps: int) -> range | None:
        return None  # an episode's length depends on what is sampled and answered

    def fail(self, exc: BaseException) -> None:
        if self.kit is not None:
            self.kit.cancel()
        self.inner.fail(exc)


def _request_of(sample: Sample) -> GenerationRequest:
    """Seat 0's first request as its sample echoes it (what later seats' requests copy:
    tag, seed, sampling, metadata)."""
    return GenerationRequest(
        request_id=sample.request_id,
        prompt=sample.prompt.tolist(),
        max_new_tokens=1,
        sampling=sample.sampling,
        seed=sample.seed,
        tag=sample.tag,
        metadata=sample.metadata,
        keep_kv=True,
        adapter=sample.adapter,
    )


def make(ctx: RolloutContext, inner, kit: EpisodeKit | None) -> Rollout:
    return MultiAgent(ctx, inner, kit)
