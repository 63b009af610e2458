"""Agents: every training episode played by a scaffold through the run's OpenAI-compatible
endpoint (docs/endpoint.md "Training through the endpoint").

`pipeline.rollout="agents+KIND"` (KIND: `full` or `dynamic_sampling`) with
`environment.name` set. For each request of batch b the rollout opens an episode of
the run's endpoint (`endpoint/kit.py`) and starts the scaffold on an `agent` thread (a
group scaffold, `scaffolds.GroupScaffold`: one per GRPO group, given its episodes in
member order; its first request may ask `n=G`, whose choices are those episodes'
first turns: `PipelineBackend.choices`);
the scaffold talks to the policy with the official `openai` client, and the endpoint
records what the policy sampled. Its requests reach the engine through the run's
driver (`endpoint.backend.PipelineBackend`): an episode's first request is submitted
with its batch (`open` waits for them, each within `Limits.timeout_s`); each later one
is the outcome of the turn before it (`Returned.later`), so the driver counts the
episode as a request out and a weight swap waits for whole episodes. Each turn keeps
its run identity (the request id, tag, seed and the run's sampling settings; the
request's own temperature and top_p are not used in training).

When the scaffold returns (`scaffolds.AgentResult`), the episode is closed and handed
on whole, as an `episodes` episode is: the recorded tokens (the policy's with their
behaviour log-probs and versions, the chat template's around the scaffold's messages
with policy mask False) and `metadata["episode"]` with the scaffold's reward as the
return; the kind's group-relative advantage goes to every policy token. A scaffold
that raises fails the run naming the episode.

Held-out evaluations are the `episodes` rollout's: the run's environment in-process,
greedy. Checkpoints: as `episodes+full`, a batch's episodes are replayed from their
start by a resumed run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamrl_jax.endpoint.scaffolds import AgentResult, AgentTask, GroupScaffold
from streamrl_jax.environments import EpisodeKit, TurnInfo
from streamrl_jax.generation.types import GenerationRequest, Sample
from streamrl_jax.pipeline.rollouts.episodes import (
    EpisodeRecord,
    Episodes,
    episode_outcome,
    question_of,
)
from streamrl_jax.pipeline.rollouts.protocol import Returned, Rollout, RolloutContext

if TYPE_CHECKING:  # (the endpoint's server and fastapi: imported where a run builds its kit)
    from streamrl_jax.endpoint.kit import AgentKit


class Agents(Episodes):
    """Episodes played by scaffolds through the endpoint `agents` (module docstring);
    `kit`: the run's environment (its held-out episodes)."""

    def __init__(
        self,
        ctx: RolloutContext,
        inner: Callable[[RolloutContext], Rollout],
        kit: EpisodeKit | None,
        agents: AgentKit | None,
    ):
        super().__init__(ctx, inner, kit)
        if agents is None and ctx.where != "trainer":
            raise ValueError("pipeline.rollout 'agents' needs the run's endpoint kit")
        self.agents = agents

    def open(self, batch: int, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """Starts a scaffold per request (a group scaffold: per group, with its episodes
        in member order); the batch's requests are their first ones."""
        kit = self.agents
        assert kit is not None, "a trainer's half opens no batch"
        eids = []
        for q in requests:
            eid = kit.endpoint.book.open(q.metadata, seed=q.seed)
            kit.backend.expect(eid, q)
            eids.append(eid)
        played: dict[tuple[int, int], list[tuple[str, GenerationRequest]]] = {}
        for eid, q in zip(eids, requests, strict=True):
            per = (q.tag.batch, q.tag.group) if isinstance(kit.scaffold, GroupScaffold) else eid
            played.setdefault(per, []).append((eid, q))
        for episodes in played.values():
            episodes.sort(key=lambda e: e[1].tag.member)
            kit.workers.submit(self._play, [e for e, _ in episodes], [q for _, q in episodes])
        firsts = [kit.backend.first(eid, kit.timeout_s) for eid in eids]
        return self.inner.open(batch, firsts)

    def returned(self, sample: Sample) -> Returned:
        if sample.tag.is_eval:  # held-out episodes run in-process
            return super().returned(sample)
        assert self.agents is not None
        return Returned(None, [], later=self.agents.backend.returned(sample))

    def _play(self, eids: list[str], qs: list[GenerationRequest]) -> None:
        """One scaffold's episodes (one; a group scaffold's: a group's), on an `agent`
        thread: the scaffold, then each episode handed on."""
        kit = self.agents
        clients = [kit.client.openai(eid) for eid in eids]
        left = dict(zip(eids, qs, strict=True))  # episodes not handed on yet
        try:
            task = AgentTask(question_of(qs[0].metadata), qs[0].metadata)
            if isinstance(kit.scaffold, GroupScaffold):
                results = kit.scaffold.play(task, clients)
                if len(results) != len(eids):
                    raise ValueError(f"the group scaffold returned {len(results)} results "
                                     f"for {len(eids)} episodes")  # fmt: skip
            else:
                results = [kit.scaffold(task, clients[0])]
            for eid, q, result in zip(eids, qs, results, strict=True):
                whole = self._episode(eid, q, result)
                del left[eid]
                kit.backend.finish(eid, whole)
        except BaseException as e:  # noqa: BLE001 - the run fails with it, named
            for eid, q in left.items():
                error = RuntimeError(f"agent scaffold: episode {q.request_id} ({eid}): {e!r}")
                kit.backend.finish(eid, error=error)
        finally:
            for client in clients:
                client.close()

    def _episode(self, eid: str, q: GenerationRequest, result: AgentResult) -> Returned:
        """Episode `eid` (of request `q`) closed, as its scaffold's `result` ended it: the
        rollout's outcome of it whole."""
        kit = self.agents
        if result.outcome not in ("done", "turn_limit", "episode_tokens"):
            raise ValueError(f"the scaffold's outcome {result.outcome!r} is not one of "
                             "done, turn_limit, episode_tokens")  # fmt: skip
        rec = kit.endpoint.book.close(eid, "its scaffold ended")
        if rec.sample is None:
            raise RuntimeError("the scaffold ended without a completion")
        ep = EpisodeRecord(
            state={},
            turns=rec.turns,
            ret=float(result.reward),
            tool_calls=result.tool_calls,
            tool_failures=result.tool_failures,
            malformed_calls=result.malformed_calls,
            cut_turns=rec.cut,
            last=TurnInfo(correct=result.correct, format_ok=result.format_ok,
                          answer=result.answer),
        )  # fmt: skip
        episode = episode_outcome(rec.sample, ep, result.outcome, 0)
        whole = dataclasses.replace(rec.sample, metadata={**q.metadata, "episode": episode})
        return self.inner.returned(whole)

    def fail(self, exc: BaseException) -> None:
        if self.agents is not None:
            self.agents.cancel()
            self.agents.backend.fail(exc)
        super().fail(exc)
