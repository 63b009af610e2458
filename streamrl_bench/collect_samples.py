"""Real SmolLM2 output lengths for the ranker: `tools/bench_scheduling.py --collect`.

SmolLM2-135M-Instruct on `VARIED_MIXTURE` through the repo's own generation engine, several
samples per prompt, one SampleLog line per sample (what `ranker_eval.read_logs` reads);
the mixture is also `tools/build_length_dataset.py`'s.
"""

from __future__ import annotations

import json
import time

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, RequestTag, SamplingParams
from streamrl_jax.model.loader import single_device_mesh

# The --collect mixture: reasoning-gym tasks whose size parameters vary widely, so the
# expected output length varies from prompt to prompt (and the size is visible in the
# prompt text: the number of terms, numbers or words). Weights are equal.
VARIED_MIXTURE = {
    "chain_sum": {"min_terms": 2, "max_terms": 10, "min_digits": 1, "max_digits": 3},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 3},
    "countdown": {"min_numbers": 3, "max_numbers": 5},
    "gsm_symbolic": {},
    "word_sorting": {"min_words": 3, "max_words": 16, "min_word_length": 3, "max_word_length": 8},
    "word_sequence_reversal": {"min_words": 3, "max_words": 20},
    "spell_backward": {},
    "letter_counting": {"min_words": 5, "max_words": 15},
}


def collect(
    n: int,
    out: str,
    *,
    max_new: int,
    samples: int,
    temperature: float,
    budget_s: float,
    slots: int = 32,
    seed: int = 0,
    model: str | None = None,
) -> None:
    """Real generations of `model` (a GGUF file or HF directory; default SmolLM2) on
    `VARIED_MIXTURE`, `samples` per prompt, one SampleLog line each. Prompts are fed to
    the engine as slots free, all samples of a prompt together; after `budget_s` no new
    prompt is started and the running ones finish, so every logged prompt has all its
    samples."""
    from streamrl_jax.data import tokenize
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained
    from streamrl_jax.rewards.tasks import TaskDataset
    from streamrl_jax.scheduling.sample_log import SampleLog

    t0 = time.time()
    mesh = single_device_mesh()
    pre = load_pretrained(model or smollm2_gguf_path(), mesh=mesh)
    ds = TaskDataset(
        {k: 1.0 for k in VARIED_MIXTURE}, seed=seed, size=n, task_configs=VARIED_MIXTURE
    )
    prompts = [tokenize(p, pre.tokenizer) for p in ds]
    # A KV cache no longer than needed: on this CPU every decode step reads all of it.
    maxp = -(-max(len(p.tokens) for p in prompts) // 16) * 16
    ecfg = EngineConfig(
        num_slots=slots, max_prompt_length=maxp, max_total_length=maxp + max_new, chunk_steps=8,
        prefill_batch=8, min_bucket=64, stop_ids=tuple(pre.cfg.eos_token_ids)[:4],
    )  # fmt: skip
    engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
    nxt = done = 0
    with SampleLog(out, flush_every=1) as log:
        while True:
            # Keep about one batch of requests queued beyond the slots.
            while (
                nxt < len(prompts) and engine.queue_length < slots and time.time() - t0 < budget_s
            ):
                p = prompts[nxt]
                meta = {"task": p.problem.task}
                tag = RequestTag(prompt_id=p.problem.prompt_id)
                engine.submit(
                    [
                        GenerationRequest(
                            request_id=nxt * samples + j,
                            prompt=list(p.tokens),
                            max_new_tokens=max_new,
                            sampling=SamplingParams(temperature=temperature),
                            seed=1000 + nxt * samples + j,
                            tag=tag,
                            metadata=meta,
                        )
                        for j in range(samples)
                    ]
                )
                nxt += 1
            if not engine.has_work():
                break
            for s in engine.step():
                log.write(s, step=0)
                done += 1
    print(
        json.dumps(
            {"collected_prompts": nxt, "samples": done, "out": out, "wall_s": time.time() - t0}
        )
    )
