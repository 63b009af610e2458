"""A generative judge: a chat model reads a rubric and a sample, its verdict is the
probability it gives its score tokens, or the score it writes.

The judge's prompt is `template` (config `judge.template`) with `{rubric}`,
`{question}`, `{response}` and `{answer}` (the task's reference answer) filled in,
sent as one user message through the judge's own chat template, ending with the
assistant header. One forward over that prompt gives the judge's next-token
distribution; with score tokens `s_0 .. s_{K-1}` (`judge.scores`, each one token of
the judge's vocabulary) and `p_k` their probabilities,

    mass    = sum_k p_k
    verdict = sum_k (p_k / mass) * k / (K - 1)        in [0, 1]

the expected grade, normalised. A judge that puts less than `min_mass` on its score
tokens did not answer in the rubric's format: the verdict is *unparsable*
(`Verdict.failure`), never a made-up score; the scoring stage masks such a sample
(pipeline/scoring.py).

`judge.verdict="parsed"`: the judge writes its answer instead (greedy, up to
`judge.verdict_tokens` tokens, until its end of turn) and the verdict is the last score
it wrote: the last of `judge.scores` found in its text as a whole word (the longest
first where one score begins another, "10" before "1"; case-insensitive unless two
scores differ only in case), graded k / (K - 1). A text with none is unparsable. The
answer is decoded by this package's generation engine (`generation/engine.py`: the
prefill, the KV cache and the decode loop the policy's instances run), built once on
the scoring mesh with `judge.batch` slots; a sample's text is its row's alone (the
engine's rows do not read each other). Scores may then be any strings (a reasoning
judge's "Score: 7" reads with scores "1".."10"), and `Verdict.mass` is NaN.

Shapes are fixed so the forward compiles a handful of times: a power of two of rows up
to `batch` (padding rows repeat nothing: they are all padding and their verdicts are
dropped), and a row length from `buckets(max_tokens)` (every 32 tokens up to 256) picked
by each row alone (so a sample's verdict does not depend on which samples share its
forward). Prompts are left-padded, so the last column is every row's last token. A
prompt longer than `max_tokens` keeps the response's end (where the answer is): its head
is cut and replaced by "...", counted in `Judge.truncated`.

The judge is any model this package loads: "smollm2" (the embedded GGUF, the default:
it runs on CPU), "tiny" (random weights with SmolLM2's tokenizer, for tests), or a
Hugging Face directory or GGUF file. Its params sit on the scoring mesh in the
generation rule table (tensor parallel over the mesh's "tp" axis).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from streamrl_jax import sharding
from streamrl_jax.config.sections import JUDGE_RUBRIC, JUDGE_SCORES, JUDGE_TEMPLATE
from streamrl_jax.errors import UserError
from streamrl_jax.generation.engine import Engine
from streamrl_jax.generation.engine_config import EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model import config as model_config
from streamrl_jax.model import llama
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained
from streamrl_jax.model.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The judge's reading of one sample.

    Attributes:
      score: the normalised expected grade in [0, 1]; None when the verdict failed.
      mass: the probability the judge gave its score tokens together.
      failure: None, or why there is no score ("unparsable: ...", "timeout: ...",
        "error: ...").
    """

    score: float | None
    mass: float
    failure: str | None = None
    text: str | None = None  # what a parsed-verdict judge wrote


@dataclasses.dataclass(frozen=True)
class Item:
    """What the judge reads of one sample."""

    question: str
    response: str
    answer: str = ""


class Scorer(Protocol):
    """What the scoring stage calls (`pipeline/scoring.py`): a `Judge` here, or one served
    from scoring processes (`distributed/judge_channel.RemoteJudge`)."""

    batch: int  # samples per forward
    parallel: int  # forwards it runs side by side (its calls may overlap this many)

    def __call__(self, items: Sequence[Item]) -> list[Verdict]:
        """The verdicts of `items`, in order."""
        ...


def buckets(max_tokens: int) -> tuple[int, ...]:
    """The row lengths the judge compiles: every 32 tokens from 64 to 256 (a judge's
    prompt is its template plus a response: padding to the next power of two would cost
    up to twice the forward), then powers of two, then `max_tokens`."""
    out, n = [], 64
    while n < max_tokens:
        out.append(n)
        n = n + 32 if n < 256 else 2 * n
    return (*out, max_tokens)


def score_pattern(scores: Sequence[str]) -> re.Pattern:
    """The scores as whole words, the longest first (module docstring); case-insensitive
    unless two scores differ only in case."""
    alternatives = "|".join(re.escape(s) for s in sorted(scores, key=len, reverse=True))
    folded = len({s.casefold() for s in scores}) == len(scores)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE if folded else 0)


def parse_score(text: str, scores: Sequence[str], pattern: re.Pattern) -> int | None:
    """The index in `scores` of the last score written in `text` (None: no score)."""
    found = pattern.findall(text)
    if not found:
        return None
    last = found[-1]
    exact = [i for i, s in enumerate(scores) if s == last]
    if exact:
        return exact[0]
    return next(i for i, s in enumerate(scores) if s.casefold() == last.casefold())


def _score_logprobs(
    graphdef: nnx.GraphDef, score_ids: tuple[int, ...], params, tokens_BxT, mask_BxT
) -> jax.Array:
    """log p(score token k | row's prompt), f32[B, K], at each row's last column."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(tokens_BxT, mask_BxT)
    logits = model.logits(hidden[:, -1:, :])[:, 0, :]
    return jax.nn.log_softmax(logits, axis=-1)[:, jnp.asarray(score_ids)]


class Judge:
    """A chat model scoring samples against a rubric (module docstring).

    Args:
      graphdef, params: the judge model, its params placed on `mesh`.
      tokenizer: the judge's own tokenizer (and chat template).
      mesh: the scoring mesh the params live on.
      model_cfg: the judge model's config (a parsed verdict's engine needs it).
      template, rubric, scores, min_mass, max_tokens, batch, verdict, verdict_tokens: as
        `JudgeSection`.

    Raises:
      UserError: a score that is not one token of the judge's vocabulary (probability
        verdicts), a template with an unknown field, or limits that cannot hold a prompt
        and its written verdict.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        tokenizer: Tokenizer,
        mesh: Mesh,
        *,
        template: str = JUDGE_TEMPLATE,
        rubric: str = JUDGE_RUBRIC,
        scores: Sequence[str] = JUDGE_SCORES,
        min_mass: float = 0.1,
        max_tokens: int = 512,
        batch: int = 8,
        model_cfg: model_config.ModelConfig | None = None,
        verdict: str = "probability",
        verdict_tokens: int = 64,
    ):
        if len(scores) < 2:
            raise UserError(f"judge.scores={tuple(scores)!r}: need at least two score tokens")
        if len(set(scores)) != len(scores) or not all(s.strip() for s in scores):
            raise UserError(f"judge.scores={tuple(scores)!r}: scores must be distinct, not blank")
        ids = []
        for s in scores if verdict == "probability" else ():
            got = tokenizer.encode(s)
            if len(got) != 1:
                raise UserError(
                    f"judge.scores: {s!r} is {len(got)} tokens of the judge's vocabulary "
                    "(each score must be exactly one token; judge.verdict='parsed' reads "
                    "scores of any length from the judge's text)"
                )
            ids.append(got[0])
        if len(set(ids)) != len(ids):
            raise UserError(f"judge.scores={tuple(scores)!r}: two scores are the same token")
        try:
            template.format(rubric="", question="", response="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(
                f"judge.template: {e!r}; its fields are {{rubric}}, {{question}}, "
                "{response} and {answer}"
            ) from None
        if max_tokens < 64:
            raise UserError(f"judge.max_tokens={max_tokens} must be >= 64")
        self._built = dict(
            graphdef=graphdef, tokenizer=tokenizer, template=template, rubric=rubric,
            scores=scores, min_mass=min_mass, max_tokens=max_tokens, batch=batch,
            model_cfg=model_cfg, verdict=verdict, verdict_tokens=verdict_tokens,
        )  # fmt: skip
        self.tokenizer, self.mesh = tokenizer, mesh
        self.template, self.rubric, self.scores = template, rubric, tuple(scores)
        self.min_mass, self.max_tokens, self.batch = min_mass, max_tokens, batch
        self.parallel = 1  # one mesh: one forward at a time
        self.buckets = buckets(max_tokens)
        self.params = params
        self.truncated = 0
        self.verdict = verdict
        if verdict == "probability":
            self._forward = jax.jit(functools.partial(_score_logprobs, graphdef, tuple(ids)))
        elif verdict == "parsed":
            self._pattern = score_pattern(self.scores)
            self._engine = _writer(graphdef, params, model_cfg, mesh, tokenizer, max_tokens,
                                   verdict_tokens, batch)  # fmt: skip
            self._sampling = SamplingParams(temperature=0.0, stop_ids=tokenizer.stop_ids)
            self.verdict_tokens = verdict_tokens
        else:
            raise UserError(f"judge.verdict={verdict!r}: one of 'probability', 'parsed'")
        self._pad = tokenizer.pad_id

    def on(self, mesh: Mesh) -> Judge:
        """This judge with its params on `mesh` (another mesh of this one's shape and axis
        names: a generation instance's, `pipeline/tenant.py`), so the same bits."""
        if mesh.devices.shape != self.mesh.devices.shape or mesh.axis_names != self.mesh.axis_names:
            raise ValueError(
                f"Judge.on: a mesh of shape {dict(mesh.shape)} for a judge on "
                f"{dict(self.mesh.shape)}"
            )
        params = jax.tree.map(
            lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, x.sharding.spec)),
            self.params,
        )
        return Judge(params=params, mesh=mesh, **self._built)

    # ------------------------------------------------------------------ prompts
    def _render(self, item: Item, response: str) -> list[int]:
        text = self.template.format(
            rubric=self.rubric, question=item.question, response=response, answer=item.answer
        )
        return self.tokenizer.encode_chat([{"role": "user", "content": text}])

    def tokens(self, item: Item) -> list[int]:
        """The judge's prompt for `item`, at most `max_tokens` (module docstring)."""
        ids = self._render(item, item.response)
        if len(ids) <= self.max_tokens:
            return ids
        self.truncated += 1
        response = self.tokenizer.encode(item.response)
        over = len(ids) - self.max_tokens
        for extra in (8, 32, 128):  # "..." and re-tokenising the seam cost a few tokens
            cut = min(len(response), over + extra)
            ids = self._render(item, "..." + self.tokenizer.decode(response[cut:]))
            if len(ids) <= self.max_tokens:
                return ids
        bare = len(self._render(item, ""))
        raise UserError(
            f"judge.max_tokens={self.max_tokens}: the judge's prompt without its response is "
            f"{bare} tokens (rubric and question too long)"
        )

    # ------------------------------------------------------------------ verdicts
    def __call__(self, items: Sequence[Item]) -> list[Verdict]:
        """The verdicts of `items`, in order (several forwards when they need several
        row lengths or more than `batch` rows)."""
        prompts = [self.tokens(it) for it in items]
        if self.verdict == "parsed":
            return [self._parsed(text) for text in self._write(prompts)]
        out: list[Verdict | None] = [None] * len(items)
        by_bucket: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            width = next(b for b in self.buckets if b >= len(p))
            by_bucket.setdefault(width, []).append(i)
        for width, rows in sorted(by_bucket.items()):
            for start in range(0, len(rows), self.batch):
                chunk = rows[start : start + self.batch]
                logp = self._run(width, [prompts[i] for i in chunk])
                for i, row in zip(chunk, logp, strict=True):
                    out[i] = self._verdict(row)
        return out  # type: ignore[return-value]

    def _run(self, width: int, prompts: list[list[int]]) -> np.ndarray:
        # Rows: the next power of two (at most `batch`): a stage that finds 2 samples
        # waiting computes 2 rows, not `batch`.
        rows = min(1 << (len(prompts) - 1).bit_length(), self.batch)
        tokens = np.full((rows, width), self._pad, np.int32)
        mask = np.zeros((rows, width), np.int32)
        for r, p in enumerate(prompts):
            tokens[r, width - len(p) :] = p
            mask[r, width - len(p) :] = 1
        mask[len(prompts) :, -1] = 1  # padding rows: one token, so no row is empty
        put = functools.partial(jax.device_put, device=_replicated(self.mesh))
        logp = self._forward(self.params, put(tokens), put(mask))
        return np.asarray(jax.device_get(logp))[: len(prompts)]

    def _write(self, prompts: list[list[int]]) -> list[str]:
        """The judge's greedy answers to `prompts`, in order (the engine takes `batch` at a
        time into its slots)."""
        requests = [
            GenerationRequest(
                request_id=i,
                prompt=p,
                max_new_tokens=self.verdict_tokens,
                sampling=self._sampling,
                seed=i,
            )
            for i, p in enumerate(prompts)
        ]
        texts = [""] * len(prompts)
        for s in self._engine.run(requests):
            end = s.num_tokens - 1 if s.finish_reason == "stop" else s.num_tokens
            texts[s.request_id] = self.tokenizer.decode(s.response[:end].tolist())
        return texts

    def _parsed(self, text: str) -> Verdict:
        k = parse_score(text, self.scores, self._pattern)
        if k is None:
            shown = text if len(text) <= 80 else "..." + text[-77:]
            return Verdict(
                None,
                float("nan"),
                f"unparsable: no score of {self.scores} in the judge's answer {shown!r}",
                text,
            )
        return Verdict(k / (len(self.scores) - 1), float("nan"), None, text)

    def _verdict(self, logp_K: np.ndarray) -> Verdict:
        p = np.exp(logp_K.astype(np.float64))
        mass = float(p.sum())
        if not np.isfinite(mass):
            return Verdict(None, mass, "error: the judge's probabilities are not finite")
        if mass < self.min_mass:
            return Verdict(
                None,
                mass,
                f"unparsable: the score tokens got {mass:.3f} of the judge's probability "
                f"(judge.min_mass={self.min_mass})",
            )
        grades = np.arange(len(p), dtype=np.float64) / (len(p) - 1)
        return Verdict(float(np.dot(p / mass, grades)), mass)


def _writer(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cfg: model_config.ModelConfig | None,
    mesh: Mesh,
    tokenizer: Tokenizer,
    max_tokens: int,
    verdict_tokens: int,
    batch: int,
) -> Engine:
    """The engine a parsed-verdict judge writes with: `batch` slots, prompts up to
    `max_tokens`, `verdict_tokens` more."""
    if cfg is None:
        raise ValueError("a parsed-verdict judge needs its model config (judge.load's)")
    if verdict_tokens < 1:
        raise UserError(f"judge.verdict_tokens={verdict_tokens} must be >= 1")
    total = max_tokens + verdict_tokens
    if total > cfg.max_position_embeddings:
        raise UserError(
            f"judge.max_tokens + judge.verdict_tokens = {total} exceeds the judge model's "
            f"{cfg.max_position_embeddings} positions"
        )
    ecfg = EngineConfig(
        num_slots=batch,
        max_prompt_length=max_tokens,
        max_total_length=total,
        prefill_batch=batch,
        min_bucket=min(64, max_tokens),
        max_stop_ids=max(len(tokenizer.stop_ids), 1),
    )
    return Engine(graphdef, params, cfg, ecfg, mesh)


def _replicated(mesh: Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def load(source: str, mesh: Mesh, *, max_context: int, seed: int = 0):
    """(graphdef, params on `mesh`, tokenizer, model config) of the judge model `source`
    (module docstring: "smollm2", "tiny" or a path).

    Raises:
      UserError / FileNotFoundError: a source that does not load, naming `judge.model`.
    """
    if source == "tiny":
        tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
        cfg = model_config.tiny(
            vocab_size=tokenizer.vocab_size, max_position_embeddings=max_context
        )
        graphdef, params = sharding.init_sharded(
            lambda: llama.create(cfg, seed=seed), mesh, "generate"
        )
        return graphdef, params, tokenizer, cfg
    path = smollm2_gguf_path() if source == "smollm2" else source
    try:
        pre = load_pretrained(path, mesh=mesh, role="generate")
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"judge.model={source!r}: {e}") from e
    if pre.tokenizer is None:
        raise UserError(f"judge.model={source!r}: the checkpoint has no tokenizer")
    if pre.cfg.max_position_embeddings < max_context:
        logging.warning(
            "judge.model=%r: %d positions, fewer than judge.max_tokens=%d",
            source,
            pre.cfg.max_position_embeddings,
            max_context,
        )
    return pre.graphdef, pre.params, pre.tokenizer, pre.cfg
