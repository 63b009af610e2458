"""Trainer cost of one GRPO group: trained tokens and fwd+bwd time per micro-batch layout.

    python tools/bench_group.py                  # quickstart shape, SmolLM2-135M
    python tools/bench_group.py --mixed --repeats=5

One group of `--group` samples of one `--prompt`-token prompt, responses of
`--response` tokens (`--mixed`: uniform in 13 .. `--response`), laid out by
`make_batch` with the quickstart config's buckets (`trainer_config`) as

* `plain`: one sample per row (`trainer.shared_prompt=False, trainer.pack=False`),
* `shared`: the prompt once, then the responses (`trainer.shared_prompt=True`, `pack`),

and timed through the policy trainer's jitted `accumulate` (forward, backward,
gradient accumulation; response-only log-probs in both) on one CPU device with
the embedded SmolLM2-135M weights. Per layout: the padded shape, real / padded /
loss tokens, the first call (compile) and the best of `--repeats` calls, wall
and process CPU seconds (CPU time is the steadier figure on a shared machine).
The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from streamrl_jax import config as config_lib
from streamrl_jax import mesh as mesh_lib
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.loader import load_pretrained
from streamrl_jax.trainer import make_batch, make_policy_trainer, trainer_config

_GROUP = flags.DEFINE_integer("group", 8, "Samples per group (G).")
_PROMPT = flags.DEFINE_integer("prompt", 100, "Prompt tokens (P).")
_RESPONSE = flags.DEFINE_integer("response", 48, "Response tokens R (the longest, --mixed).")
_MIXED = flags.DEFINE_bool("mixed", False, "Response lengths uniform in 13 .. --response.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per layout (best reported).")
_LAYOUTS = {"plain": (False, False), "shared": (True, True)}


def _quickstart():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "quickstart.py")
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def main(argv) -> None:
    del argv
    pre = load_pretrained(smollm2_gguf_path())
    mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), jax.devices()[:1]).train
    rng = np.random.default_rng(0)
    g, r = _GROUP.value, _RESPONSE.value
    lens = rng.integers(13, r + 1, g) if _MIXED.value else np.full(g, r)
    prompt = rng.integers(0, pre.cfg.vocab_size, _PROMPT.value)
    samples = dict(
        prompts=[prompt] * g,
        responses=[rng.integers(0, pre.cfg.vocab_size, n) for n in lens],
        behaviour_logp=[rng.normal(-2.0, 0.5, n).astype(np.float32) for n in lens],
        advantages=rng.normal(size=g).astype(np.float32),
        group_ids=[0] * g,
    )
    out = {}
    for name, (shared, pack) in _LAYOUTS.items():
        cd = _quickstart()
        cd.trainer.update(shared_prompt=shared, pack=pack)
        tc = trainer_config(config_lib.from_config_dict(cd), fsdp=1)
        host = make_batch(**samples, **tc.layout)
        trainer = make_policy_trainer(pre.cfg, tc, mesh)
        state = trainer.state_from_params(pre.params)
        batch, one = trainer.place_batch(host), trainer.scalar(1.0)
        acc = trainer.init_accumulator()
        walls, cpus = [], []
        for _ in range(_REPEATS.value + 1):  # the first call compiles
            t0, c0 = time.perf_counter(), time.process_time()
            acc, _ = trainer.accumulate(state, acc, batch, one)
            jax.block_until_ready(acc)  # deliberate sync: end of the timed region
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        out[name] = {
            "shape": list(host.tokens.shape),
            "real_tokens": int(host.attention_mask.sum()),
            "padded_tokens": int(host.tokens.size),
            "loss_tokens": int(host.loss_mask.sum()),
            "first_call_s": round(walls[0], 2),
            "best_wall_s": round(min(walls[1:]), 3),
            "best_cpu_s": round(min(cpus[1:]), 2),
        }
        print(name, out[name], flush=True)
        del trainer, state, acc, batch
    result = {
        "group": g,
        "prompt": _PROMPT.value,
        "responses": [int(n) for n in lens],
        "layouts": out,
        "speedup_wall": round(out["plain"]["best_wall_s"] / out["shared"]["best_wall_s"], 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
