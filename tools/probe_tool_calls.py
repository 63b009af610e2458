"""How often the base model writes a well-formed tool call, under prompt variants.

  python tools/probe_tool_calls.py                 # configs/agent.py, eval seed 2
  python tools/probe_tool_calls.py --problems=64 --k=4

Issue 36's learning goal needs the policy to call the calculator. RL can only sharpen
what the policy samples: if the base model never writes a parseable call, GRPO never
sees a tool result. This measures, per system-prompt variant, the share of first-turn
samples (k per problem at the config's temperature, one turn of
`generation.max_new_tokens`) with at least one well-formed call, with malformed call
markup, and that answer correctly without a tool. Variants:

* `env`: the calculator environment's own system prompt (the `simple` format);
* `fewshot`: the same, with one worked episode (call, result, answer) as earlier turns;
* `hermes`: the Hermes JSON format's description (the Qwen convention), parsed as such;
* `nudge`: `env` with "Use the calculator." appended to the question.

Last line: JSON with the rates per variant.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

_CONFIG = flags.DEFINE_string("config", os.path.join(_ROOT, "configs", "agent.py"), "Config.")
_PROBLEMS = flags.DEFINE_integer("problems", 32, "Held-out problems (eval seed's).")
_K = flags.DEFINE_integer("k", 4, "Samples per problem and variant.")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine batch (slots).")
_VARIANTS = flags.DEFINE_string("variants", "env,fewshot,hermes,nudge", "Variants to run.")
_DUMP = flags.DEFINE_string("dump", "", "Write every response (JSONL) to this path.")


def _config():
    from streamrl_jax import config as config_lib

    path, _, arg = _CONFIG.value.partition(":")
    spec = importlib.util.spec_from_file_location("probe_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return config_lib.from_config_dict(module.get_config(arg or None).to_dict())


def conversations(variant: str, question: str) -> tuple[list[dict[str, str]], str]:
    """The first messages of `variant` for `question`, and the format that parses it."""
    from streamrl_jax.environments.calculator import INSTRUCTIONS
    from streamrl_jax.environments.tool_calls import FORMATS
    from streamrl_jax.environments.tools import CALCULATOR

    fmt = "hermes" if variant == "hermes" else "simple"
    system = INSTRUCTIONS + "\n" + FORMATS[fmt].describe([CALCULATOR])
    msgs = [{"role": "system", "content": system}]
    if variant == "fewshot":
        msgs += [
            {"role": "user", "content": "Calculate 38 - 54."},
            {"role": "assistant", "content": "<tool_call>calculator: 38 - 54</tool_call>"},
            {"role": "tool", "content": "-16"},
            {"role": "assistant", "content": "<answer>-16</answer>"},
        ]
    suffix = " Use the calculator." if variant == "nudge" else ""
    return [*msgs, {"role": "user", "content": question + suffix}], fmt


def main(argv):
    del argv
    import dataclasses

    import jax
    from jax.sharding import AxisType, Mesh

    from streamrl_jax.config import task_configs
    from streamrl_jax.environments.tool_calls import FORMATS
    from streamrl_jax.environments.tools import CALCULATOR
    from streamrl_jax.generation.engine import Engine
    from streamrl_jax.generation.types import GenerationRequest, SamplingParams
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained
    from streamrl_jax.pipeline.components import engine_config
    from streamrl_jax.rewards.tasks import TaskDataset

    cfg = _config()
    d, g = cfg.data, cfg.generation
    mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",), axis_types=(AxisType.Auto,))
    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    tok = pre.tokenizer
    ecfg = engine_config(cfg, tok, _SLOTS.value)
    ecfg = dataclasses.replace(
        ecfg, prefill_batch=min(_SLOTS.value, 16), max_prompt_length=256, max_total_length=320
    )
    engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
    tasks = [t.strip() for t in d.tasks.split(",") if t.strip()]
    problems = TaskDataset(
        tasks, seed=d.eval_seed, size=_PROBLEMS.value, task_configs=task_configs(d)
    )
    reward = problems.reward_fn()
    sampling = SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
    dump = open(_DUMP.value, "w", encoding="utf-8") if _DUMP.value else None  # noqa: SIM115
    out = {"bench": "probe_tool_calls", "config": os.path.relpath(_CONFIG.value, _ROOT)}
    out.update(k=_K.value, problems=len(problems), temperature=g.temperature, variants={})
    for variant in _VARIANTS.value.split(","):
        requests, fmt = [], "simple"
        for i, p in enumerate(problems):
            msgs, fmt = conversations(variant, p.question)
            tokens = tok.encode(tok.apply_chat_template(msgs))
            requests += [
                GenerationRequest(
                    request_id=(i, j),
                    prompt=tokens,
                    max_new_tokens=g.max_new_tokens,
                    sampling=sampling,
                    seed=7919 * i + j,
                )
                for j in range(_K.value)
            ]
        t0 = time.perf_counter()
        samples = engine.run(requests)
        calls = malformed = solved = 0
        for s in samples:
            i, j = s.request_id
            text = tok.decode(s.response)
            parsed = FORMATS[fmt].parse(text, {"calculator": CALCULATOR})
            calls += bool(parsed.calls)
            malformed += parsed.malformed > 0
            ok = not parsed.any and reward(text, problems[i].metadata).correct
            solved += ok
            if dump is not None:
                row = {"variant": variant, "problem": i, "sample": j, "response": text}
                row.update(call=bool(parsed.calls), malformed=parsed.malformed, correct=bool(ok))
                dump.write(json.dumps(row) + "\n")
        n = len(samples)
        r = {
            "well_formed_call": round(calls / n, 4),
            "malformed_call": round(malformed / n, 4),
            "answered_correctly_without_tool": round(solved / n, 4),
            "prompt_tokens": len(requests[0].prompt),
            "generate_s": round(time.perf_counter() - t0, 1),
        }
        out["variants"][variant] = r
        print(f"{variant}: {r}", file=sys.stderr, flush=True)
    if dump is not None:
        dump.close()
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
