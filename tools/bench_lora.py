"""LoRA against full fine-tuning on SmolLM2-135M: weight-sync bytes and seconds (in one
process and over the processes' shard sync), training state memory, the trainer's step
time, and the engine's decode with the adapter merged against unmerged adapter slots.

    python tools/bench_lora.py --quick        # rank 8, every target; < 4 min on CPU-2

* Sync: `WeightSync` from the training mesh (CPU device 0) to one generation instance
  (device 1) in the generation dtype: every parameter (full fine-tuning) against the
  adapters alone (`adapters_only`, after the first transfer placed the base); median of
  `--rounds` alternated transfers. The generation side's relayout, which follows either,
  is not counted.
* Wire sync: the multi-controller path (`ShardSender` -> `ShardReceiver`, CURVE over
  loopback TCP, placed into the receiver's sharding), sender and receiver in this process
  on their own threads: every parameter each version (full fine-tuning) against LoRA's
  deltas of the adapter leaves (`send(changed=)`); median of `--rounds`.
* Decode: `Engine.run` of `--decode_rows` requests (32-token prompts, 64 forced tokens)
  on one device: the adapter merged into the weights (`EngineConfig.adapters=0`) against
  4 adapter slots with every request on slot 0, and with the requests spread over the 4
  slots (`generation/adapters.py`); median of `--rounds` alternated runs, compiles
  excluded.
* Memory: bytes of the trainer's own state and accumulator (parameters, AdamW moments,
  gradients), read off the arrays the trainers create.
* Step: one micro-batch's `accumulate` + `apply` (`--rows` x `--seq` tokens), median of
  `--rounds` alternated steps, after a warm-up step each (compiles excluded).

The last line is JSON with the ratios (full / LoRA) and the absolute figures.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank.")
_TARGETS = flags.DEFINE_list("targets", ["q", "k", "v", "o", "gate", "up", "down"], "Targets.")
_DTYPE = flags.DEFINE_string("generate_dtype", "float32", "Generation (sync) dtype.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Alternated rounds (median).")
_ROWS = flags.DEFINE_integer("rows", 4, "Micro-batch rows of the step timing.")
_SEQ = flags.DEFINE_integer("seq", 256, "Micro-batch columns of the step timing.")
_DECODE_ROWS = flags.DEFINE_integer("decode_rows", 8, "Engine slots of the decode timing.")
_QUICK = flags.DEFINE_bool("quick", False, "Fewer rounds, a shorter micro-batch.")


def wire_sync(params_by_name: dict, rounds: int, dtype) -> dict:
    """Median seconds and bytes of a shard-sync version: every leaf (full) or the adapters
    as a delta (lora), sender and receiver on threads of this process (module docstring)."""
    import jax
    import numpy as np

    from streamrl_jax.distributed import shard_receiver, shard_sync, shard_wire
    from streamrl_jax.weight_sync import adapter_leaves, cast_floats

    key = b"bench-lora-key-0123456789abcdef"
    out = {}
    for name, params in params_by_name.items():
        cast = jax.jit(lambda p: cast_floats(p, dtype))(params)
        shardings = jax.tree.map(lambda x: x.sharding, cast)
        sender = shard_sync.ShardSender(
            "127.0.0.1:0", authkey=key, process=0, num_receivers=1, timeout_s=120
        )
        need = shard_wire.need_of(shardings, cast, 1)
        receiver = shard_receiver.ShardReceiver(
            [sender.address], need, authkey=key, timeout_s=120, deltas=name == "lora"
        )
        changed = adapter_leaves(cast) if name == "lora" else None
        try:
            sender.send(cast, 0)  # the whole first version (the base lands)
            receiver.receive(shardings, 120)
            seconds, sent = [], 0
            for v in range(1, rounds + 1):
                t0 = time.perf_counter()
                stats = sender.send(cast, v, changed=changed)
                receiver.receive(shardings, 120)
                seconds.append(time.perf_counter() - t0)
                sent = stats.total_bytes
            out[name] = {"wire_bytes": sent, "wire_s": float(np.median(seconds))}
        finally:
            receiver.close(5)
            sender.close(5)
    return out


def decode(graphdef, lora_state, rows: int, rounds: int) -> dict:
    """Median seconds of `Engine.run` of `rows` forced-length requests: merged, four
    adapter slots all on slot 0, and spread over them (module docstring)."""
    import dataclasses

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from streamrl_jax.generation.engine import Engine
    from streamrl_jax.generation.engine_config import EngineConfig
    from streamrl_jax.generation.types import GenerationRequest, SamplingParams

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    cfg = EngineConfig(
        num_slots=rows, max_prompt_length=32, max_total_length=128, chunk_steps=16,
        prefill_batch=rows, share_prefill=False,
    )  # fmt: skip
    model_cfg = lora_state["cfg"]
    rng = np.random.default_rng(0)
    reqs = [
        GenerationRequest(
            request_id=i,
            prompt=rng.integers(0, model_cfg.vocab_size, 32).tolist(),
            max_new_tokens=64,
            forced_length=64,
            sampling=SamplingParams.greedy(),
        )
        for i in range(rows)
    ]
    engines = {
        "merged": (Engine(graphdef, lora_state["params"], model_cfg, cfg, mesh), reqs),
    }
    slots = Engine(
        graphdef, lora_state["params"], model_cfg, dataclasses.replace(cfg, adapters=4), mesh
    )
    for k in range(1, 4):
        slots.update_adapter(k, lora_state["params"], version=0)
    engines["slots_one"] = (slots, reqs)
    spread = [dataclasses.replace(r, adapter=i % 4) for i, r in enumerate(reqs)]
    engines["slots_mixed"] = (slots, spread)
    times = {name: [] for name in engines}
    for engine, rs in engines.values():
        engine.run(rs)  # compiles
    for _ in range(rounds):
        for name, (engine, rs) in engines.items():
            t0 = time.perf_counter()
            engine.run(rs)
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax import sharding
    from streamrl_jax.config import OptimizerSection
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import describe
    from streamrl_jax.trainer import TrainerConfig, make_batch, make_policy_trainer
    from streamrl_jax.weight_sync import WeightSync, place_on, tree_bytes

    rounds, rows, seq = (3, 2, 128) if _QUICK.value else (_ROUNDS.value, _ROWS.value, _SEQ.value)
    base = describe(smollm2_gguf_path()).cfg
    cfgs = {
        "full": base,
        "lora": base.replace(lora_rank=_RANK.value, lora_targets=tuple(_TARGETS.value)),
    }
    d0, d1 = jax.devices()[:2]
    train_mesh = mesh_lib.make_meshes(mesh_lib.MeshConfig(colocated=True), [d0]).train
    tcfg = TrainerConfig(
        optimizer=OptimizerSection(learning_rate=1e-5), seq_buckets=(seq,), batch_buckets=(rows,)
    )
    rng = np.random.default_rng(0)
    n = rows
    samples = dict(
        prompts=[rng.integers(0, base.vocab_size, seq // 4) for _ in range(n)],
        responses=[rng.integers(0, base.vocab_size, seq // 2) for _ in range(n)],
        behaviour_logp=[np.full(seq // 2, -3.0, np.float32) for _ in range(n)],
        old_logp=[np.full(seq // 2, -3.0, np.float32) for _ in range(n)],
        ref_logp=[np.full(seq // 2, -3.0, np.float32) for _ in range(n)],
        advantages=rng.normal(size=n).astype(np.float32),
    )
    host = make_batch(**samples, seq_buckets=(seq,), batch_buckets=(rows,))
    parts = {}
    for name, cfg in cfgs.items():
        trainer = make_policy_trainer(cfg, tcfg, train_mesh)
        state = trainer.init_state(0)
        acc = trainer.init_accumulator()
        dst = [sharding.state_shardings(state.params, Mesh(np.array([d1]), ("tp",)), "generate")]
        sync = WeightSync(jnp.dtype(_DTYPE.value), place_on(dst), adapters_only=name == "lora")
        sync.transfer(state.params, 0)  # W_0: the base lands (and compiles the cast)
        parts[name] = dict(trainer=trainer, state=state, acc=acc, sync=sync)
        parts[name]["memory"] = {
            "params": tree_bytes(state.params),
            "optimizer": tree_bytes(state.opt_state),
            "gradients": tree_bytes(acc.grads),
        }
    batch = {k: p["trainer"].place_batch(host) for k, p in parts.items()}

    def step(name: str) -> float:
        p = parts[name]
        t0 = time.perf_counter()
        acc, _ = p["trainer"].accumulate(
            p["state"], p["acc"], batch[name], p["trainer"].scalar(1.0)
        )
        state, acc, metrics = p["trainer"].apply(p["state"], acc)
        jax.block_until_ready((state.params, metrics))
        p["state"], p["acc"] = state, acc
        return time.perf_counter() - t0

    for name in parts:
        step(name)  # compiles
    times = {name: {"sync": [], "bytes": 0, "step": []} for name in parts}
    for r in range(rounds):
        for name, p in parts.items():
            _, stats = p["sync"].transfer(p["state"].params, r + 1)
            times[name]["sync"].append(stats.seconds)
            times[name]["bytes"] = stats.bytes
            times[name]["step"].append(step(name))
    out = {
        "tool": "bench_lora",
        "rank": _RANK.value,
        "targets": _TARGETS.value,
        "generate_dtype": _DTYPE.value,
        "rounds": rounds,
        "micro_batch": [rows, seq],
    }
    wire = wire_sync(
        {name: p["state"].params for name, p in parts.items()}, rounds, jnp.dtype(_DTYPE.value)
    )
    for name, t in times.items():
        mem = parts[name]["memory"]
        out[name] = {
            "sync_bytes": t["bytes"],
            "sync_s": float(np.median(t["sync"])),
            "step_s": float(np.median(t["step"])),
            "train_state_bytes": sum(mem.values()),
            **{f"{k}_bytes": v for k, v in mem.items()},
            **wire[name],
        }
        sync_ms, state_mib = out[name]["sync_s"] * 1e3, sum(mem.values()) / 2**20
        print(
            f"{name:5s} sync {t['bytes'] / 1e6:8.2f} MB in {sync_ms:8.2f} ms  "
            f"step {out[name]['step_s']:.3f} s  state {state_mib:8.1f} MiB  "
            f"wire {wire[name]['wire_bytes'] / 1e6:8.2f} MB in {wire[name]['wire_s'] * 1e3:8.2f} ms"
        )
    full, lora = out["full"], out["lora"]
    out["sync_bytes_ratio"] = full["sync_bytes"] / lora["sync_bytes"]
    out["sync_time_ratio"] = full["sync_s"] / lora["sync_s"]
    out["train_state_ratio"] = full["train_state_bytes"] / lora["train_state_bytes"]
    out["step_time_ratio"] = full["step_s"] / lora["step_s"]
    out["wire_bytes_ratio"] = full["wire_bytes"] / lora["wire_bytes"]
    out["wire_time_ratio"] = full["wire_s"] / lora["wire_s"]
    # The engine: the trained LoRA model's weights, merged or in adapter slots.
    lora_parts = parts["lora"]
    params = jax.device_put(lora_parts["state"].params, d0)
    graphdef = lora_parts["trainer"].graphdef
    dec = decode(graphdef, {"cfg": cfgs["lora"], "params": params}, _DECODE_ROWS.value, rounds)
    out["decode_s"] = dec
    out["slots_one_over_merged"] = dec["slots_one"] / dec["merged"]
    out["slots_mixed_over_merged"] = dec["slots_mixed"] / dec["merged"]
    print(
        "decode ({} rows x 64): merged {:.3f} s, 4 slots on one {:.3f} s, mixed {:.3f} s".format(
            _DECODE_ROWS.value, dec["merged"], dec["slots_one"], dec["slots_mixed"]
        )
    )
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
