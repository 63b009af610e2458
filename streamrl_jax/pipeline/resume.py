"""Resume: a run's checkpoints at step boundaries, and the exact restart from one
(docs/checkpoint.md).

`RunCheckpoints` ties `checkpoint.Checkpointer` to the pipeline's state:

* **save(k)** right after the optimizer step of batch k-1 (a step boundary):
  the learner's states (`Learner.checkpoint`: the policy's TrainState, W_k and the
  optimizer state, of its params what its kind saves, the LoRA adapters alone; every
  trained target's, e.g. the critic's), the generation weights
  W_v for v in [g(k), k) that batches >= k still need (the published
  generation copies, from the weight board), the prompt-iterator state at the
  start of batch k, the run seed and the prompt ids of the drawn but untrained
  batches (`in_flight`), with partial rollout the work carried into round k (the
  paused samples: tokens, per-token versions and log-probs; the finished members of
  groups not complete yet), plus a config snapshot.
* **restore()** puts all of that back: the states into this run's trainer
  shardings (any mesh shape), the generation weights onto every generation
  instance (republished on the board under their versions), the prompt
  iterator at batch k, the rollout's state; the driver and trainer then start at
  batch k and the untrained batches are regenerated bit for bit (a sample depends
  only on weights, prompt and per-sample seed).
* **consumed.jsonl** in the workdir records the prompt ids each trained step
  consumed; a resume truncates it to the restored steps, so every prompt
  appears once per epoch however often the run was killed
  (`tools/fault_drill.py` checks it).

The ranker (scheduling) is saved when the run has one; it changes where and
when a request runs, never its sample, so it does not affect exactness.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import logging

from streamrl_jax import checkpoint as ckpt_lib
from streamrl_jax.config import ExperimentConfig
from streamrl_jax.errors import UserError
from streamrl_jax.generation.types import Sample
from streamrl_jax.learner import saved_entries
from streamrl_jax.pipeline.components import Components
from streamrl_jax.pipeline.prompts import PromptSource
from streamrl_jax.pipeline.rollouts import Rollout
from streamrl_jax.pipeline.schedules import Schedule, WeightBoard
from streamrl_jax.scheduling.ranker import Ranker
from streamrl_jax.weight_sync import Published

CONSUMED = "consumed.jsonl"


@dataclasses.dataclass
class ResumePoint:
    """Where a restored run starts.

    Attributes:
      batch: the first batch to generate and train (= optimizer steps... of whole batches).
      gen_weights: version -> per-instance `Published` for the versions batches >= batch need.
      expected_ids: batch -> prompt ids it must draw again (the saved `in_flight`).
      step: the checkpoint's step.
      prompts: the prompt iterator's state at the start of `batch` (already set on
        this process's iterator; a multi-controller run hands it to its generation
        processes).
      carried: finished samples the rollout hands to ingest again (partial rollout: the
        finished members of incomplete groups; its paused samples are back in it).
      rollout: the checkpoint's rollout state (a multi-controller run hands it to its
        generation processes: partial rollout's names the carried work's shares).
    """

    batch: int
    gen_weights: dict[int, list[Published]]
    expected_ids: dict[int, list[str]]
    step: int
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)
    carried: list[Sample] = dataclasses.field(default_factory=list)
    rollout: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def fresh(cls) -> ResumePoint:
        """A run that starts at batch 0 (no checkpoint)."""
        return cls(batch=0, gen_weights={}, expected_ids={}, step=0)

    @property
    def resumed(self) -> bool:
        return self.batch > 0 or bool(self.gen_weights)


class ResumeMismatch(UserError):
    """The run's schedule or data differ from the checkpoint's (named, old -> new)."""


def run_identity(cfg: ExperimentConfig) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint: the fields that change the
    schedule (which weights generate which batch, how batches are cut) or the data (which
    prompts, in which order). `pipeline.steps` may grow: a resumed run can go further."""
    p, d, g = cfg.pipeline, cfg.data, cfg.generation
    return {
        "mode": p.mode,
        "staleness": p.staleness,
        "prompts_per_step": p.prompts_per_step,
        "group_size": p.group_size,
        "mini_batches": p.mini_batches,
        "weight_update": p.weight_update,
        "max_lag": p.max_lag,
        "rollout": p.rollout,
        "partial_budget_tokens": p.partial_budget_tokens,
        "lag_policy": p.lag_policy,
        # Before pipeline.rollout, dynamic sampling had a switch of its own.
        "dynamic_sampling": p.rollout.endswith("dynamic_sampling"),
        "dynamic_sampling_max_draws": p.dynamic_sampling_max_draws,
        "curriculum_decay": p.curriculum_decay,
        "curriculum_floor": p.curriculum_floor,
        "data.tasks": d.tasks,
        "data.task_config": d.task_config,
        "data.train_seed": d.train_seed,
        "data.train_size": d.train_size,
        "data.jsonl_path": d.jsonl_path,
        "data.system_prompt": d.system_prompt,
        "data.overlong_prompts": d.overlong_prompts,
        "generation.max_prompt_len": g.max_prompt_len,
    }


class RunCheckpoints:
    """Checkpoints of one run in `directory` (see the module docstring).

    A multi-controller run's training processes all save into the run's one directory
    (`processes`: the training processes, orbax's active set: each saves its own shards).
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        c: Components,
        workdir: str,
        *,
        directory: str,
        processes: tuple[int, ...] | None,
        schedule: Schedule,
        prompts: PromptSource,
        rollout: Rollout,
        ranker: Ranker | None,
    ):
        """Args:
        cfg, c: the run's config and components (their states are what is saved).
        workdir: where consumed.jsonl is kept.
        directory, processes: the checkpoint directory and orbax's active set (None: this
          process alone).
        schedule: g(k): which generation weights a checkpoint keeps.
        prompts, rollout, ranker: whose state a checkpoint saves and a resume restores.
        """
        self.cfg, self.c, self.workdir, self.sched = cfg, c, workdir, schedule
        self.prompts, self.rollout, self.ranker = prompts, rollout, ranker
        ck = cfg.checkpoint
        self.directory = directory
        self.enabled = ck.every > 0
        self.ckpt: ckpt_lib.Checkpointer | None = None
        if self.enabled or os.path.isdir(self.directory):
            self.ckpt = ckpt_lib.Checkpointer(
                self.directory,
                keep=ck.keep,
                save_every=max(ck.every, 1),
                async_save=ck.async_save,
                fingerprint=ckpt_lib.model_fingerprint(c.model_cfg),
                timeout_s=cfg.pipeline.timeout_s,
                processes=processes,
            )
        self.saved: list[int] = []

    # ------------------------------------------------------------------ save
    def due(self, k: int, force: bool = False) -> bool:
        return self.ckpt is not None and (force or (self.enabled and self.ckpt.should_save(k)))

    def save(self, k: int, board: WeightBoard, *, force: bool = False) -> bool:
        """Checkpoint k (after the optimizer step of batch k-1); False if not due."""
        if not self.due(k, force):
            return False
        needed = range(self.sched.generation_version(k), k)
        learner = self.c.learner
        gen = {}
        for v in needed:
            published = board.get(v)
            if published is None:
                raise RuntimeError(
                    f"checkpoint {k}: generation weights W_{v} are no longer on the weight board"
                )
            gen[str(v)] = learner.saved_weights(published[0].params)
        prompts = self.prompts.state_at(k)
        in_flight = {str(b): ids for b, ids in self.prompts.drawn_from(k).items()}
        self.prompts.forget_below(k)
        metadata = {
            "next_batch": k,
            "run_seed": self.cfg.seed,
            "mode": self.cfg.pipeline.mode,
            # The learner's trained targets' entries: one is not resumed without them.
            "entries": learner.entries(),
            "identity": run_identity(self.cfg),
            "staleness": self.cfg.pipeline.staleness,
            "gen_versions": sorted(int(v) for v in gen),
            "prompts": prompts,
            "in_flight": in_flight,
            # Prompts the pipeline dealt before batch k: trained, skipped or passed over.
            "consumed": prompts.get("consumed", 0),
            # The rollout's work carried across boundary k (partial rollout: paused
            # samples, finished members of incomplete groups), continued by the resumed run.
            "rollout": self.rollout.state(k),
            # The KL reference never changes: a pointer to where it is reloaded from.
            "ref": {"init_from": self.cfg.init_from, "model_source": self.cfg.model.source},
            "config": str(self.cfg),
            # LoRA: the state's params are the adapters alone; the frozen base is the
            # model's source (and init_from), loaded again when the run resumes.
            "adapters_only": learner.policy.adapters_only,
            "policy": learner.policy.name,
        }
        state, extra = learner.checkpoint()
        if gen:
            extra["gen_weights"] = gen
        started = self.ckpt.save(
            k,
            state,
            extra_arrays=extra or None,
            ranker=self.ranker.state() if self.ranker is not None else None,
            metadata=metadata,
            force=force,
        )
        if started:
            self.saved.append(k)
            logging.info("checkpoint %d started (%s)", k, self.directory)
        return started

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    # ------------------------------------------------------------------ consumption log
    def log_consumed(self, batch: int, prompt_ids: list[str]) -> None:
        with open(os.path.join(self.workdir, CONSUMED), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": batch, "prompt_ids": prompt_ids}) + "\n")

    def _truncate_consumed(self, k: int) -> None:
        path = os.path.join(self.workdir, CONSUMED)
        if not os.path.exists(path):
            return
        keep = [row for row in read_consumed(path) if row["step"] < k]
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for row in keep:
                f.write(json.dumps(row) + "\n")
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------------ restore
    def restore(self) -> ResumePoint:
        """Restores the newest complete checkpoint into the components
        (`ResumePoint.fresh()` when there is none: the rollout starts at batch 0). A
        checkpoint that does not read back (corrupt, truncated) is skipped with a
        warning naming it and the older one tried next; a run whose schedule or data
        differ from the checkpoint's is refused (`ResumeMismatch`), never skipped."""
        if self.ckpt is None or self.ckpt.latest_step() is None:
            self.rollout.restore(0, {})
            return ResumePoint.fresh()
        steps = sorted(self.ckpt.all_steps(), reverse=True)
        first: BaseException | None = None
        for i, step in enumerate(steps):
            try:
                return self._restore(step)
            except ResumeMismatch:
                raise
            except (ValueError, OSError) as e:
                first = first or e
                if i + 1 < len(steps):
                    logging.warning(
                        "checkpoint %s does not read back (%s); trying the previous one, %s",
                        self.ckpt.step_directory(step),
                        e,
                        self.ckpt.step_directory(steps[i + 1]),
                    )
        raise UserError(f"no checkpoint in {self.directory} reads back: {first}") from first

    def _restore(self, step: int) -> ResumePoint:
        where = self.ckpt.step_directory(step)
        meta = self.ckpt.read_metadata(step)
        for key in ("next_batch", "prompts"):
            if key not in meta:
                raise UserError(f"checkpoint {where}: its metadata has no {key!r}")
        learner = self.c.learner
        saved = {"mode": meta.get("mode"), "run_seed": meta.get("run_seed")}
        now = {"run_seed": self.cfg.seed}
        # Each trained target's entry (the critic's state): saved with it, resumed with it.
        entries = saved_entries(meta)
        for name in sorted({*entries, *learner.entries()}):
            saved[name] = name in entries
            now[name] = name in learner.entries()
        saved |= meta.get("identity", {})
        now |= run_identity(self.cfg)
        changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in saved if saved[k] != now.get(k)]
        if changed:
            raise ResumeMismatch(
                f"checkpoint {where} was written by another schedule or data "
                f"({'; '.join(changed)}): resume with the same settings, or use a fresh "
                "--workdir (init_from=... to start from its weights)"
            )
        versions = [int(v) for v in meta.get("gen_versions", [])]
        # What `save` wrote: of the policy, what its kind saves (LoRA: the adapters; the
        # base is loaded, not restored); every trained target's entries.
        saved_state, saved_extra = learner.checkpoint()
        abstract_extra = {k: ckpt_lib.abstract_tree(v) for k, v in saved_extra.items()}
        if versions:
            gen_params = learner.saved_weights(self.c.initial_weights[0].params)
            gen_abstract = ckpt_lib.abstract_tree(gen_params)
            abstract_extra["gen_weights"] = {str(v): gen_abstract for v in versions}
        r = self.ckpt.restore(
            step,
            abstract_state=ckpt_lib.abstract_tree(saved_state),
            abstract_extra=abstract_extra or None,
            abstract_ranker=self.ranker.state() if self.ranker is not None else None,
        )
        learner.restore(r.state, r.extra or {})
        if self.ranker is not None and r.ranker is not None:
            self.ranker.load_state(r.ranker)
        gen: dict[int, list[Published]] = {}
        for v in versions:  # on each instance, in its own placement (LoRA: on its base)
            tree = r.extra["gen_weights"][str(v)]
            gen[v] = learner.published(tree, self.c.initial_weights, v)
        k = int(meta["next_batch"])
        expected = {int(b): ids for b, ids in meta.get("in_flight", {}).items()}
        self.prompts.restore(meta["prompts"], expected)
        carried = self.rollout.restore(k, meta.get("rollout") or {})
        self._truncate_consumed(k)
        logging.info(
            "resumed from checkpoint %d (%s): next batch %d, generation versions %s",
            step,
            self.ckpt.step_directory(step),
            k,
            versions,
        )
        return ResumePoint(
            batch=k,
            gen_weights=gen,
            expected_ids=expected,
            step=step,
            prompts=meta["prompts"],
            carried=carried,
            rollout=meta.get("rollout") or {},
        )


def read_consumed(path: str) -> list[dict[str, Any]]:
    """Rows of a consumed.jsonl (a torn last line from a kill is skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last line, cut by a kill
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
    return rows
