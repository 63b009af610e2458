"""A run's generation requests: a batch's prompts as GRPO groups, the held-out prompts greedy.

`Requests` is made once from the config and turns prompts into `GenerationRequest`s:

* `train(batch, prompts, first_group)`: `pipeline.group_size` sampled requests per
  prompt (`data.make_requests`: per-sample seeds from (run seed, batch, group,
  member), so a sample depends only on weights, prompt and seed; forced lengths with
  `generation.length_replay`); groups are numbered from `first_group` (a batch's
  refills continue its numbering);
* `held_out(version, prompts)`: one greedy request per held-out prompt, tagged with
  the policy version it evaluates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from streamrl_jax.config import ExperimentConfig
from streamrl_jax.data import Prompt, make_requests
from streamrl_jax.generation.types import GenerationRequest, RequestTag, SamplingParams


@dataclasses.dataclass(frozen=True)
class Requests:
    """How a run's prompts become generation requests (module docstring)."""

    group_size: int
    max_new_tokens: int
    sampling: SamplingParams
    run_seed: int
    length_replay: bool
    episodes: bool = False  # each request is an episode's first turn (it keeps its KV)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> Requests:
        g = cfg.generation
        return cls(
            group_size=cfg.pipeline.group_size,
            max_new_tokens=g.max_new_tokens,
            sampling=SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p),
            run_seed=cfg.seed,
            length_replay=g.length_replay,
            episodes=bool(cfg.environment.name),
        )

    def train(
        self, batch: int, prompts: Sequence[Prompt], first_group: int = 0
    ) -> list[GenerationRequest]:
        """`group_size` requests for each prompt, as groups `first_group`.. of `batch`."""
        return make_requests(
            prompts,
            batch=batch,
            group_size=self.group_size,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            run_seed=self.run_seed,
            length_replay=self.length_replay,
            first_group=first_group,
            keep_kv=self.episodes,
        )

    def held_out(self, version: int, prompts: Sequence[Prompt]) -> list[GenerationRequest]:
        """One greedy request per held-out prompt, evaluating policy `version`."""
        return [
            GenerationRequest(
                request_id=f"eval/{version}/{i}",
                prompt=p.tokens,
                max_new_tokens=self.max_new_tokens,
                sampling=SamplingParams.greedy(),
                tag=RequestTag(group=i, prompt_id=p.problem.prompt_id, eval_version=version),
                metadata=p.problem.metadata,
                keep_kv=self.episodes,
            )
            for i, p in enumerate(prompts)
        ]
