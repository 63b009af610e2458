"""Length replay: the paper's throughput benchmark setting, scaled to this machine.

Every response is forced to a length drawn from the paper's long-tail trace
(median ~0.16, P90 ~0.62, max 1.0 of `generation.max_new_tokens`), so all
modes generate exactly the same tokens and only the schedule differs. Rewards
do not matter here; throughput (samples/s) does. Used by tools/bench_pipeline.py.

  python -m streamrl_jax.launch --config=configs/length_replay.py --workdir=/tmp/lr
Variants: `:smollm2` uses SmolLM2-135M instead of the tiny random model.
"""

from streamrl_jax import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.defaults()
    c.model.source = "tiny"
    c.model.max_context = 384
    c.mesh.generate_devices = 1
    c.mesh.train_devices = 1
    c.mesh.instance_slots = (16,)
    c.generation.max_prompt_len = 128
    c.generation.max_new_tokens = 256
    c.generation.length_replay = True
    c.generation.decode_chunk = 16
    c.pipeline.mode = "stream_async"
    c.pipeline.steps = 6
    c.pipeline.prompts_per_step = 8
    c.pipeline.group_size = 4
    c.pipeline.min_groups = 2
    c.pipeline.micro_batch_groups = 2
    c.optimizer.learning_rate = 1e-5
    c.data.train_size = 200
    c.eval.num_problems = 0
    c.log.progress = False
    if arg in (None, "", "tiny"):
        pass
    elif arg == "smollm2":
        c.model.source = "smollm2"
        c.model.max_context = 256
        c.generation.max_new_tokens = 128
        c.pipeline.prompts_per_step = 4
    else:
        raise ValueError(f"configs/length_replay.py: unknown variant {arg!r} (tiny | smollm2)")
    return c
