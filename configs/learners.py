"""Two learners at once on one generation service (docs/learners.md).

Run (from the repository root):
  python -m streamrl_jax.launch --config=configs/learners.py --workdir=/tmp/learners
Both learners train a rank-8 LoRA adapter of SmolLM2-135M-Instruct on the quickstart's
arithmetic (configs/quickstart.py) and share one generation instance of twice the
quickstart's slots (the same per learner), whose engine keeps the base once and decodes
both adapters in one batch:

* `grpo`: the quickstart's recipe (GRPO with DAPO's clip-higher, dynamic sampling and
  overlong punishment; stream_async, one step stale);
* `ppo`: PPO with a critic (GAE), plain clipping, every group trained, stream_sync, on
  prompts of another train seed.

Each writes its metrics, samples and checkpoints under <workdir>/<name>. Variants:
  configs/learners.py:short      20 steps each (a first look)
  configs/learners.py:tiny       the tiny random model (tests, smoke runs)
  configs/learners.py:short/ppo  one learner alone, as a run of its own (the baseline of
                                 tools/bench_learners.py); likewise /grpo, and after any variant
The learning rates are LoRA's usual ~10x full fine-tuning's, not tuned here.
"""

import importlib.util
import os


def _quickstart(arg: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart.py")
    spec = importlib.util.spec_from_file_location("quickstart_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str | None = None):
    variant, _, alone = (arg or "").partition("/")
    if variant not in ("", "short", "tiny"):
        raise ValueError(
            f"configs/learners.py: unknown variant {arg!r} (short | tiny, each optionally "
            "/grpo or /ppo: that learner alone)"
        )
    arg = variant
    c = _quickstart(arg)
    # The service decodes both learners' rows in one batch: twice the quickstart's slots,
    # the same per learner (a learner alone keeps the quickstart's instance).
    single = tuple(c.mesh.instance_slots)
    c.mesh.instance_slots = tuple(2 * s for s in single)
    c.trainer.lora.rank = 8
    c.trainer.lora.alpha = 16.0
    c.optimizer.learning_rate = 1e-3 if arg == "tiny" else 2e-4
    c.learners = (
        dict(name="grpo"),
        dict(
            name="ppo",
            seed=1,
            algorithm=dict(advantage="gae", policy_loss="ppo_clip", overlong_buffer=0),
            critic=dict(learning_rate=1e-3 if arg == "tiny" else 2e-4),
            data=dict(train_seed=3),
            pipeline=dict(mode="stream_sync", rollout="full"),
        ),
    )
    if alone:  # one learner as a run of its own: its sections over the top level's
        (learner,) = [x for x in c.learners if x["name"] == alone] or [None]
        if learner is None:
            raise ValueError(f"configs/learners.py: no learner {alone!r} (grpo | ppo)")
        for section, values in learner.items():
            if section == "seed":
                c.seed = values
            elif section != "name":
                target = c.trainer.lora if section == "lora" else c[section]
                for key, value in values.items():
                    target[key] = value
        c.learners = ()
        c.mesh.instance_slots = single
    return c
