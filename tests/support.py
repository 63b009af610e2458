"""Test support shared by several test files: builders, fakes and assertions.

Test files import what they share from here (or take a fixture from
`conftest.py`), never from another test file; `tests/layering_test.py` checks
that. Sections, in order: pipeline runs on `quickstart:tiny`, the tiny
generation engine and trainer micro-batches (the pod planner's tests have their
own, `tests/podplan/sim_schedules.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax import config as config_lib
from streamrl_jax.config import ExperimentConfig, PipelineSection
from streamrl_jax.data import Prompt
from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import (
    Continuation,
    GenerationRequest,
    RequestTag,
    Sample,
    SamplingParams,
    Timings,
)
from streamrl_jax.mailbox import FailureLatch
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.pipeline import RunResult
from streamrl_jax.pipeline.micro_batches import Scored, group_key, pack_groups
from streamrl_jax.pipeline.rollouts import RolloutContext
from streamrl_jax.pipeline.schedules import Schedule, VersionGate
from streamrl_jax.pipeline.shards import Alone, ownership
from streamrl_jax.rewards.base import RewardResult
from streamrl_jax.rewards.tasks import Problem
from streamrl_jax.stream.sample_stream import SampleStream
from streamrl_jax.trainer.batch import TrainBatch
from streamrl_jax.trainer.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------- pipeline runs


def tiny_config(**overrides: Any) -> ExperimentConfig:
    """`configs/quickstart.py:tiny` as a typed config, with overrides.

    Args:
      **overrides: `section__field=value`, e.g. `pipeline__mode="stream_sync"`.

    Returns:
      The validated experiment config.
    """
    return config_file("configs/quickstart.py", "tiny", **overrides)


def agent_config(**overrides: Any) -> ExperimentConfig:
    """`configs/agent.py:tiny` (episodes with the calculator) with overrides."""
    return config_file("configs/agent.py", "tiny", **overrides)


def config_file(path: str, arg: str, **overrides: Any) -> ExperimentConfig:
    """`path:arg` as a typed config, with `section__field=value` overrides."""
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cd = module.get_config(arg).to_dict()
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        cd[section][key] = value
    return config_lib.from_config_dict(cd)


def write_policy_checkpoint(
    root: Any, cfg: ExperimentConfig, change: Callable[[jax.Array], jax.Array]
) -> None:
    """A checkpoint of `cfg`'s starting policy with `change` applied to every weight, at
    step 1 under `root` (what a run's `resume.save` writes of a full fine-tuning run)."""
    from streamrl_jax import checkpoint as ckpt_lib
    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax.pipeline import components

    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    trainer, state = components.initial_policy(cfg, mesh)
    state = state.replace(params=jax.tree.map(change, state.params))
    fingerprint = ckpt_lib.model_fingerprint(trainer.spec.model_cfg)
    with ckpt_lib.Checkpointer(str(root), fingerprint=fingerprint) as ckpt:
        ckpt.save(1, state, force=True)
        ckpt.wait()


def drawn_prompt_ids(cfg: ExperimentConfig, batches: int) -> list[list[int]]:
    """The prompt ids each of batches 0 .. batches-1 of a run of `cfg` draws (the seeded
    prompt pipeline, replayed once)."""
    from streamrl_jax.pipeline import components, datasets

    tokenizer = components.describe_model(cfg).tokenizer
    eval_set, train_set = datasets.datasets(cfg)
    prompts, _ = datasets.prompts(cfg, tokenizer, train_set, eval_set)
    n = cfg.pipeline.prompts_per_step
    ids = [p.problem.prompt_id for p in prompts.next_prompts(n * batches)]
    return [ids[n * b : n * (b + 1)] for b in range(batches)]


def batch_prompt_ids(cfg: ExperimentConfig, batch: int) -> list[int]:
    """The prompt ids batch `batch` of a run of `cfg` draws: what a reward function can
    tell its samples' batch by."""
    return drawn_prompt_ids(cfg, batch + 1)[batch]


def assert_partial_rollout_kept_its_bound(
    steps: list[dict], ids: list, drawn: set, samples: int, group_size: int, seen: list
) -> None:
    """What partial rollout promises of a run of rounds of 6 tokens whose 16-token samples
    take 3 rounds (lag 3 = max_lag): steps 0 and 1 train nothing, later steps train
    carried groups, every drawn group at most once (`ids`: the consumed log's, of the
    `drawn` ones), every sample handed to training whole (`seen`), its versions within
    the bound."""
    assert len(ids) == len(set(ids)) and set(ids) <= drawn  # never twice
    assert [r["optimizer_steps"] for r in steps][:2] == [0.0, 0.0]
    assert len(ids) == samples // group_size > 0
    for s in seen:
        assert s.finish_reason != "paused" and len(s.versions()) == s.num_tokens
        assert np.all(np.diff(s.versions()) >= 0)
    trained_lag = [r["lag_max"] for r in steps if r["optimizer_steps"]]
    assert trained_lag and max(trained_lag) <= 3.0
    assert all(r["dropped_stale"] == 0.0 for r in steps)
    assert max(r["mixed_versions"] for r in steps if r["optimizer_steps"]) > 0


def param_arrays(result: RunResult) -> list[np.ndarray]:
    """The policy parameters a run ended with, as host arrays (leaf order)."""
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(result.state.params))]


def pipeline_threads() -> list[str]:
    """Names of the pipeline's threads still alive: empty once a run has ended."""
    names = ("generation-driver", "collector", "sgs-instance", "reward", "episode-env", "tool")
    return [t.name for t in threading.enumerate() if t.name.startswith(names)]


def consumed_log(workdir: str) -> tuple[list[int], collections.Counter]:
    """A run's consumed-prompt log: the steps it recorded, in order, and how many
    times each prompt id was trained."""
    from streamrl_jax.pipeline.resume import CONSUMED, read_consumed

    rows = read_consumed(os.path.join(workdir, CONSUMED))
    return [r["step"] for r in rows], collections.Counter(p for r in rows for p in r["prompt_ids"])


def launch_command(workdir, flags: list[str] = ()) -> list[str]:
    """`python -m streamrl_jax.launch` of the tiny quickstart into `workdir`, with `flags`."""
    return [sys.executable, "-m", "streamrl_jax.launch", "--config=configs/quickstart.py:tiny",
            f"--workdir={workdir}", *flags]  # fmt: skip


def _fail_on_call(n: int, exc: Exception) -> Callable[..., None]:
    """A side effect that raises on its n-th call (1-based), thread-safely."""
    calls, lock = [0], threading.Lock()

    def effect(*args, **kwargs):
        with lock:
            calls[0] += 1
            if calls[0] == n:
                raise exc

    return effect


def trainer_dies_on_call(n: int) -> Any:
    """A patch (a context manager) making `Trainer.accumulate` raise "trainer died" on
    its n-th call."""
    real, boom = Trainer.accumulate, _fail_on_call(n, RuntimeError("trainer died"))

    def accumulate(self, *args, **kwargs):
        boom()
        return real(self, *args, **kwargs)

    return mock.patch.object(Trainer, "accumulate", accumulate)


# --------------------------------------------------------------- tiny engine

CFG = model_config.tiny()
# service_test.py uses the same statics, so its instance 0 reuses these compiled functions.
ENGINE = EngineConfig(
    num_slots=4, max_prompt_length=16, max_total_length=48, chunk_steps=4, prefill_batch=2
)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)


def lively_model(seeds: tuple[int, ...]) -> tuple[Any, ...]:
    """Tiny random models with weights scaled x4: at the default init scale the
    residual stream is dominated by the input embedding and greedy decoding just
    repeats the last prompt token, which would make the engine's tests too weak.

    Returns:
      (graphdef, then one params state per seed).
    """
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.create(CFG)))

    @jax.jit
    def init(key):
        params = nnx.state(llama.Llama(CFG, rngs=nnx.Rngs(params=key)))
        return jax.tree.map(lambda x: 4.0 * x, params)

    return graphdef, *(init(jax.random.key(s)) for s in seeds)


def make_engine(
    model: tuple[Any, ...], on_chunk: Any = None, detokenize: Any = None, **overrides: Any
) -> Engine:
    """An engine on one device with the first weights of `model` (`conftest.model`),
    configured as `ENGINE` with `overrides` (`detokenize`: for stop strings)."""
    graphdef, params, _ = model
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    cfg = dataclasses.replace(ENGINE, **overrides)
    return Engine(graphdef, params, CFG, cfg, mesh, on_chunk=on_chunk, detokenize=detokenize)


def requests(n: int, sampling=SAMPLED, seed: int = 0, **kw: Any) -> list[GenerationRequest]:
    """`n` requests with random prompts (1-16 tokens) and budgets (1-24 new tokens),
    request ids 0..n-1, sampling seeds 100+i; `kw` overrides request fields."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 17))).tolist()
        fields = dict(max_new_tokens=int(rng.integers(1, 25)), sampling=sampling, seed=100 + i)
        fields.update(kw)
        out.append(GenerationRequest(request_id=i, prompt=prompt, **fields))
    return out


def by_id(samples: list[Sample]) -> dict[Any, Sample]:
    """Samples keyed by request id."""
    return {s.request_id: s for s in samples}


def assert_same(a: dict[Any, Sample], b: dict[Any, Sample]) -> None:
    """Same requests, same tokens and finish reasons, log-probs within 1e-5."""
    assert a.keys() == b.keys()
    for rid in a:
        np.testing.assert_array_equal(a[rid].response, b[rid].response, err_msg=f"request {rid}")
        np.testing.assert_allclose(a[rid].logprobs, b[rid].logprobs, atol=1e-5, rtol=1e-5)
        assert a[rid].finish_reason == b[rid].finish_reason


# ------------------------------------------------------------- micro-batches


def scored_sample(
    group: int,
    member: int,
    score: float,
    version: int = 0,
    length: int = 3,
    batch: int = 0,
    prompt_id: str = "",
):
    """A scored sample of `batch`: a 4-token prompt, `length` response tokens at
    log-prob -0.5, generated under W_`version`; correct when score >= 1."""
    sample = Sample(
        request_id=f"{group}/{member}",
        prompt=np.arange(1, 5, dtype=np.int32),
        response=np.full(length, 7, np.int32),
        logprobs=np.full(length, -0.5, np.float32),
        sampling_logprobs=np.full(length, -0.5, np.float32),
        finish_reason="stop",
        policy_version=version,
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=0.0, finish=0.0),
        tag=RequestTag(batch=batch, group=group, member=member, prompt_id=prompt_id),
    )
    reward = RewardResult(score=score, correct=score >= 1, extracted_answer=None, format_ok=True)
    return Scored(sample, "text", reward)


def pack_small(
    groups: list[list[Scored]],
    gate: VersionGate,
    stats: dict[str, list],
    shared_prompt: bool = False,
    pack: bool = False,
    seq_buckets: tuple[int, ...] = (16,),
    **kwargs: Any,
) -> TrainBatch | None:
    """`pack_groups` for step 2 with small buckets (batch 1 or 8), GRPO advantages."""
    return pack_groups(
        2,
        groups,
        gate=gate,
        advantage="grpo",
        seq_buckets=seq_buckets,
        batch_buckets=(1, 8),
        shared_prompt=shared_prompt,
        pack=pack,
        loss_chunk=128,
        pad_id=0,
        stats=stats,
        **kwargs,
    )


def sync_gate() -> VersionGate:
    """The version gate of stream_sync, counting (not raising on) stale samples."""
    return VersionGate(Schedule.from_config(PipelineSection(mode="stream_sync")), strict=False)


# ------------------------------------------------------------------ rollouts


class ListPrompts:
    """A `Prompts` over the prompt ids p0, p1, ... in order (`draw` records them by batch)."""

    def __init__(self, ids: list[str] | None = None, size: int = 1000):
        self.ids = ids or [f"p{i}" for i in range(size)]
        self.next = 0
        self.drawn: dict[int, list[str]] = collections.defaultdict(list)

    def draw(self, batch: int, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            pid = self.ids[self.next % len(self.ids)]
            self.next += 1
            problem = Problem(prompt_id=pid, question=pid, answer="", task="t", metadata={})
            out.append(Prompt(problem=problem, tokens=(1, 2, 3)))
            self.drawn[batch].append(pid)
        return out


def rollout_context(
    prompts: Any = None, timeout_s: float = 5.0, seed: int = 0, **pipeline: Any
) -> RolloutContext:
    """A rollout's context on a real sample stream and failure latch, one training
    process, over `ListPrompts` (or `prompts`); `pipeline` overrides `PipelineSection`."""
    p = PipelineSection(timeout_s=timeout_s, **pipeline)
    stream = SampleStream(group_size=p.group_size, group_key=group_key, capacity=1 << 12)
    return RolloutContext(
        pipeline=p,
        schedule=Schedule.from_config(p),
        stream=stream,
        prompts=prompts if prompts is not None else ListPrompts(),
        latch=FailureLatch("test"),
        overlong=None,
        trainers=Alone(ownership(p, 1)),
        seed=seed,
    )


def group_of_scores(
    batch: int, group: int, scores: list[float], prompt_id: str = ""
) -> list[Scored]:
    """The scored members of one group (`scored_sample`), one score each."""
    return [
        scored_sample(group, m, s, batch=batch, prompt_id=prompt_id or f"b{batch}g{group}")
        for m, s in enumerate(scores)
    ]


def run_recording(cfg: ExperimentConfig, workdir: Any, reward_fn: Any = None) -> tuple[Any, list]:
    """Runs `cfg` in `workdir` (reward: `vowel_reward` unless given); returns the result
    and every sample handed to training (ingest), in order."""
    from unittest import mock

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.pipeline.ingest import Ingest
    from streamrl_jax.rewards.vowels import vowel_reward

    seen, on_sample = [], Ingest.on_sample

    def record(self, sample, *args, **kwargs):
        seen.append(sample)
        return on_sample(self, sample, *args, **kwargs)

    with mock.patch.object(Ingest, "on_sample", record):
        return run_lib.run(cfg, str(workdir), reward_fn=reward_fn or vowel_reward), seen


def policy_run_lengths(mask: Any) -> list[int]:
    """The lengths of an episode's runs of policy tokens (its turns), in order."""
    import numpy as np

    edges = np.flatnonzero(np.diff(np.r_[0, np.asarray(mask, int), 0]))
    return [int(b - a) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def assert_whole_episodes(samples: list, turns: int, turn_tokens: int) -> None:
    """Every sample an episode ended by its environment after `turns` policy turns of
    `turn_tokens` tokens, its environment tokens counted and never given a log-prob."""
    import numpy as np

    for s in samples:
        ep = s.metadata["episode"]
        assert (ep["turns"], ep["outcome"]) == (turns, "done"), ep
        assert policy_run_lengths(s.policy_mask) == [turn_tokens] * turns
        assert ep["env_tokens"] == int((~s.policy_mask).sum()) > 0
        np.testing.assert_array_equal(s.logprobs[~s.policy_mask], 0.0)


# A tiny `transformers` config (its fields) for parity tests of the checkpoint families.
HF_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def hf_run_dir(d: Any, cfg_cls: str, model_cls: str, extra: dict[str, Any]) -> str:
    """A tiny random `transformers` checkpoint (`HF_TINY | extra`, `randomize_hf`) with
    SmolLM2's tokenizer and its vocabulary size, laid out in `d` as a user's directory
    is: config, safetensors, tokenizer files (what `model.source=<dir>` reads). Skips
    the calling test where torch is not installed (the test extra has none on 3.12)."""
    import json

    import pytest

    pytest.importorskip("torch")
    import transformers

    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    fields = HF_TINY | extra | dict(vocab_size=tok.vocab_size, max_position_embeddings=256)
    cfg = getattr(transformers, cfg_cls)(**fields)
    randomize_hf(getattr(transformers, model_cls)(cfg)).save_pretrained(d)
    tok.backend.save(os.path.join(d, "tokenizer.json"))
    eos = tok.backend.id_to_token(tok.eos_ids[0])
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "chat_template": tok.chat_template}, f)
    return str(d)


def randomize_hf(model: Any, seed: int = 0) -> Any:
    """A `transformers` model's weights made large enough that attention is far from
    uniform (so RoPE, norm and mask errors show): norms near 1, matrices at 0.15."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def random_adapters(model: Any, seed: int) -> Any:
    """`model` (a LoRA-adapted `llama.Llama`) with every adapter's B drawn: a new adapter's
    B is zero, which would leave the model as it was and A without a gradient."""
    key = jax.random.key(seed)
    for name in model.layers.adapted:
        b = getattr(model.layers, f"{name}_lora_b")
        key, sub = jax.random.split(key)
        b[...] = 0.05 * jax.random.normal(sub, b[...].shape, b[...].dtype)
    return model


def policy_samples(n: int = 4, seed: int = 0, vocab: int = 256, advantages=None) -> dict:
    """`trainer.make_batch` inputs of `n` random samples: prompts of 1-7 tokens, responses
    of 2-9, behaviour (= old = reference) log-probs near -4, the given per-sample
    `advantages` (random normal when None)."""
    rng = np.random.default_rng(seed)
    responses = [rng.integers(0, vocab, rng.integers(2, 10)) for _ in range(n)]
    behaviour = [rng.normal(-4.0, 0.3, len(r)).astype(np.float32) for r in responses]
    return dict(
        prompts=[rng.integers(0, vocab, rng.integers(1, 8)) for _ in range(n)],
        responses=responses,
        behaviour_logp=behaviour,
        old_logp=behaviour,
        ref_logp=behaviour,
        advantages=rng.normal(size=n).astype(np.float32) if advantages is None else advantages,
    )


def engine_turn(
    req: GenerationRequest, new_tokens: Any, end: int, reason: str = "stop", version: int = 0
) -> Sample:
    """What an engine returns for an episode's turn request: its continuation (if any),
    then `new_tokens` (and `end`, the end of turn, when it stopped)."""
    c = req.continuation
    if c is None:
        none = np.zeros(0, np.float32)
        c = Continuation(
            tokens=np.zeros(0, np.int32),
            logprobs=none,
            sampling_logprobs=none,
            versions=np.zeros(0, np.int32),
            policy_mask=np.zeros(0, bool),
        )
    new = [*new_tokens, end] if reason == "stop" else list(new_tokens)
    k = len(new)
    versions = np.concatenate([c.versions, np.full(k, version, np.int32)]).astype(np.int32)
    return Sample(
        request_id=req.request_id,
        prompt=np.asarray(req.prompt, np.int32),
        response=np.concatenate([c.tokens, np.asarray(new, np.int32)]),
        logprobs=np.concatenate([c.logprobs, np.full(k, -0.3, np.float32)]),
        sampling_logprobs=np.concatenate([c.sampling_logprobs, np.full(k, -0.2, np.float32)]),
        finish_reason=reason,
        policy_version=int(versions[0]),
        last_policy_version=version,
        instance_id=0,
        timings=Timings(enqueue=0.0, admit=c.admit, finish=3.0),
        tag=req.tag,
        metadata=req.metadata,
        token_versions=versions,
        policy_mask=np.concatenate([c.policy_mask, np.ones(k, bool)]),
        sampling=req.sampling,
        seed=req.seed,
    )
