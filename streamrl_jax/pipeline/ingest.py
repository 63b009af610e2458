"""Samples in: decode, reward, into the grouping sample stream; held-out evaluations.

`Ingest.on_sample(sample, done)` is what the generation side calls with every
finished sample (the local driver's collector thread, or a sample channel's
reader thread in a training process):

* **training samples**: decoded, logged to samples.jsonl (the ranker's data),
  scored on the reward pool and handed to the rollout (`Rollout.scored`: into the
  `SampleStream`, which releases complete GRPO groups to the trainer, or held until
  its group is judged). `done()` runs once the rollout took it (or it failed), so a
  channel's credit comes back only then: the stream's back-pressure reaches the
  generation processes. With a judge (`judge.model`), a training sample goes from
  the reward pool to the scoring stage (`pipeline/scoring.py`), which judges it and
  hands it to the rollout, then runs `done()`: its bound reaches them too.
* **evaluation samples** (tag `eval_version`): scored on the same pool; once
  every held-out prompt of a version is in, its accuracy / format / length are
  written as `eval/...` metrics at that policy version.

Scorers run inline or in confined worker processes with a deadline per call
(`data.reward_sandbox`, `rewards/sandbox.py`), so no scorer blocks this
process's threads. A reward call that raises, times out or loses its worker
fails the run naming "reward function" (or scores 0 with
`data.reward_errors="zero"`, counted: `rewards/pool.py`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
from absl import logging

from streamrl_jax.generation.types import Sample
from streamrl_jax.metrics import MetricsWriter, Tracer
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.pipeline.micro_batches import Scored
from streamrl_jax.pipeline.scoring import Direct, ScoringStage
from streamrl_jax.pipeline.step_metrics import GenerationMeter
from streamrl_jax.pipeline.supervisor import Supervisor
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.pool import RewardPool
from streamrl_jax.scheduling.sample_log import SampleLog
from streamrl_jax.stream.sample_stream import StreamError


class Evaluations:
    """Held-out evaluation results by policy version (thread-safe)."""

    def __init__(self, num_prompts: int, writer: MetricsWriter, supervisor: Supervisor):
        self.num_prompts = num_prompts
        self.writer, self.supervisor = writer, supervisor
        self.metrics: dict[int, dict[str, float]] = {}  # version -> eval metrics
        self._scored: dict[int, list[Scored]] = collections.defaultdict(list)
        self._cv = threading.Condition()
        supervisor.latch.add_listener(lambda component, exc: self._wake())

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def add(self, version: int, scored: Scored) -> None:
        with self._cv:
            group = self._scored[version]
            group.append(scored)
            if len(group) < self.num_prompts:
                return
            m = {
                "accuracy": float(np.mean([s.reward.correct for s in group])),
                "format_ok": float(np.mean([s.reward.format_ok for s in group])),
                "response_len": float(np.mean([len(s.sample.response) for s in group])),
                "num_problems": float(len(group)),
            }
            episodes = [s.sample.metadata.get("episode") for s in group]
            if all(e is not None for e in episodes):  # an episodes run: how they went
                m["tool_call_rate"] = float(np.mean([e["tool_calls"] > 0 for e in episodes]))
                m["turns"] = float(np.mean([e["turns"] for e in episodes]))
                m["truncated"] = float(np.mean([e["outcome"] != "done" for e in episodes]))
            self.metrics[version] = m
            self._cv.notify_all()
        self.writer.write(version, m, prefix="eval/")
        logging.info("eval at policy version %d: %s", version, m)

    def latest(self) -> dict[str, float] | None:
        """The newest complete evaluation's metrics and its version (`step`), or None."""
        with self._cv:
            if not self.metrics:
                return None
            version = max(self.metrics)
            return self.metrics[version] | {"step": float(version)}

    def wait(self, version: int, timeout: float) -> None:
        """Blocks until the evaluation of `version` is complete (or the run failed).

        Raises:
          PipelineError: the run failed meanwhile.
          TimeoutError: naming the version, after `timeout` seconds.
        """
        with self._cv:
            ok = self._cv.wait_for(
                lambda: version in self.metrics or self.supervisor.latch.failed, timeout
            )
        self.supervisor.raise_if_failed()
        if not ok:
            raise TimeoutError(
                f"evaluation: policy version {version} not scored within {timeout:.0f} s "
                "(generation stalled?)"
            )


class Ingest:
    """Finished samples into rewards, the rollout and the evaluations."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pool: RewardPool,
        onward: Direct | ScoringStage,
        evaluations: Evaluations,
        *,
        supervisor: Supervisor,
        meter: GenerationMeter,
        tracer: Tracer,
        sample_log: SampleLog | None,
    ):
        """Args:
        tokenizer: decodes responses for the reward function.
        pool: the reward workers.
        onward: where a scored training sample goes, with its `done`: `Direct` to the
          rollout (`Rollout.scored`), or through the scoring stage of a run with a judge.
        evaluations: where a scored held-out sample goes.
        supervisor, meter, tracer: the run's failure latch and progress ticks, its
          generation meter (each training sample widens its batch's span), its trace.
        sample_log: samples.jsonl (`log.samples`; None: off).
        """
        self.tokenizer, self.pool, self.onward = tokenizer, pool, onward
        self.evaluations, self.supervisor, self.meter = evaluations, supervisor, meter
        self.tracer, self.sample_log = tracer, sample_log

    def on_sample(self, sample: Sample, done: Callable[[], None] | None = None) -> None:
        """One finished sample (see the module docstring); `done()` runs once the rollout
        took it, it is scored (evaluation) or it failed."""
        text = self.tokenizer.decode(sample.response)
        if not sample.tag.is_eval:
            if self.sample_log is not None:
                self.sample_log.write(sample, sample.tag.batch)
            self.meter.sample(sample)
        t0 = self.tracer.now()
        future = self.pool.submit(text, sample.metadata)
        future.add_done_callback(lambda f, s=sample: self._scored(s, text, f, t0, done))

    def _scored(
        self,
        sample: Sample,
        text: str,
        future: Future[RewardResult],
        t0: float,
        done: Callable[[], None] | None,
    ) -> None:
        """A reward pool's callback: the scored sample to the rollout or the evaluations.
        `done` runs exactly once: by `onward` once the sample is in the rollout, or here
        (an evaluation, a failure before `onward` ran it)."""
        done = _once(done)
        try:
            reward = future.result()
            self.tracer.add("reward/pool", "score", t0, self.tracer.now())
            self.supervisor.tick("reward")
            scored = Scored(sample, text, reward)
            if sample.tag.is_eval:
                self.evaluations.add(sample.tag.eval_version, scored)
            else:
                self.onward.put(scored, done)
                done = None  # `onward` ran it, or runs it once the sample is in the rollout
        except StreamError:
            pass  # the stream already carries the first failure
        except BaseException as e:  # noqa: BLE001 - reported to the supervisor
            self.supervisor.fail("reward function", e)
        finally:
            if done is not None:
                done()

    def waiting(self) -> int:
        """Training samples in the scoring stage, not yet judged (0 without a judge)."""
        return self.onward.waiting()

    def pop_row(self) -> dict[str, float]:
        """The scoring stage's figures since the last call (none without a judge)."""
        return self.onward.pop_row()

    def close(self) -> None:
        self.onward.close()
        self.pool.close(cancel_pending=True)
        if self.sample_log is not None:
            self.sample_log.close()


def _once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """`fn`, run at most once however often it is called (None stays None)."""
    if fn is None:
        return None
    first = threading.Lock()  # taken by the first call, never released

    def once() -> None:
        if first.acquire(blocking=False):
            fn()

    return once
