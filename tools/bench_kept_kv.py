"""Kept KV under pressure: twice as many open episodes as slots through the endpoint.

    python tools/bench_kept_kv.py --quick     # <= 5 minutes

SmolLM2-135M on one engine of `--slots` slots behind the endpoint on loopback.
`2 * slots` official `openai` clients each play one chat episode of `--turns` turns of
`--turn_tokens` tokens (`ignore_eos`: the same work every run), idle `--think_s`
between turns (a scaffold running its tool): every episode keeps its slot's KV while
idle. Three servers, the same load each:

* `give_up` (`kv_hold_s=0`, what `python -m streamrl_jax.serve` runs): a request that
  finds every free slot kept for an idle episode takes the least recently used one;
  that episode's next turn re-prefills its history;
* `hold` (`kv_hold_s=120`, a training run's default): the request waits for a kept slot
  to be let go (its episode closes, or 120 s pass);
* `enough` (`2 * slots` slots): no pressure, the baseline.

Per server: turn latency p50/p99, the first turn's p99 (a new episode's wait), the
re-prefills and kept slots given up (the engine's counts), tokens/s. Every shape is
compiled by an untimed pass first. Last line: JSON.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging as std_logging
import sys
import time

import numpy as np
from absl import app, flags

_QUICK = flags.DEFINE_bool("quick", False, "A <= 5 minute run.")
_SLOTS = flags.DEFINE_integer("slots", 4, "Engine slots (the clients are twice as many).")
_TURNS = flags.DEFINE_integer("turns", 3, "Turns per episode.")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 8, "Tokens per turn.")
_THINK = flags.DEFINE_float("think_s", 0.5, "Idle seconds between an episode's turns.")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Timed loads per server (0: 1 quick, 3 full).")


def _server(pre, meshes, slots: int, hold_s: float):
    from streamrl_jax.endpoint import api
    from streamrl_jax.endpoint.kit import serve
    from streamrl_jax.endpoint.server import endpoint_token
    from streamrl_jax.generation.engine_config import EngineConfig
    from streamrl_jax.generation.service import GenerationService

    ecfg = EngineConfig(
        num_slots=slots,
        max_prompt_length=128,
        max_total_length=512,
        chunk_steps=8,
        prefill_batch=4,
        stop_ids=tuple(pre.tokenizer.stop_ids),
        kv_hold_s=hold_s,
    )
    service = GenerationService(pre.graphdef, pre.params, pre.cfg, meshes, ecfg)
    token = endpoint_token(b"bench-kept-kv")
    limits = api.Limits(max_tokens=_TURN_TOKENS.value, max_inflight=64, timeout_s=300)
    endpoint, server = serve(service, pre.tokenizer, token, limits)
    return endpoint, server, token


def _load(url: str, token: str, clients: int) -> tuple[float, list[float], list[float]]:
    """`clients` episodes at once: (wall, every turn's latency, first turns' latency)."""
    from streamrl_jax.endpoint.client import EndpointClient

    client = EndpointClient(url, token, timeout=300)
    k, turns = _TURN_TOKENS.value, _TURNS.value

    def episode(i: int) -> list[float]:
        lat = []
        with client.episode() as (oc, _):
            messages = [{"role": "user", "content": f"What is {i} + {2 * i + 1}? Answer."}]
            for t in range(turns):
                if t:
                    time.sleep(_THINK.value)  # the scaffold's tool: the episode is idle
                t0 = time.perf_counter()
                r = oc.chat.completions.create(
                    model="policy", messages=messages, max_tokens=k, temperature=0.7,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                lat.append(time.perf_counter() - t0)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "Check it and answer again."}]  # fmt: skip
        return lat

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        lats = list(pool.map(episode, range(clients)))
    client.close_client()
    return time.perf_counter() - t0, [x for lat in lats for x in lat], [lat[0] for lat in lats]


def main(argv) -> None:
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    std_logging.getLogger("httpx").setLevel(std_logging.WARNING)
    t_start = time.perf_counter()
    meshes = mesh_lib.instance_meshes(
        mesh_lib.make_meshes(mesh_lib.MeshConfig(generate_devices=1, train_devices=1)).generate
    )
    pre = load_pretrained(smollm2_gguf_path(), mesh=meshes[0])
    s = _SLOTS.value
    clients, rounds = 2 * s, _ROUNDS.value or (1 if _QUICK.value else 3)
    servers = {"give_up": (s, 0.0), "hold": (s, 120.0), "enough": (2 * s, 120.0)}
    out: dict = {"bench": "kept_kv", "quick": _QUICK.value, "slots": s, "episodes": clients,
                 "turns": _TURNS.value, "turn_tokens": _TURN_TOKENS.value,
                 "think_s": _THINK.value}  # fmt: skip
    for name, (slots, hold) in servers.items():
        endpoint, server, token = _server(pre, meshes, slots, hold)
        engine = endpoint.backend.service.engines[0]
        _load(server.url, token, clients)  # compiles every shape the load runs
        before = dict(engine.metrics())
        runs = [_load(server.url, token, clients) for _ in range(rounds)]
        after = engine.metrics()
        wall, lat, first = min(runs, key=lambda r: r[0])
        counts = {k: (after[k] - before[k]) // rounds for k in ("reprefilled", "kept_given_up",
                                                                "extended")}  # fmt: skip
        out[name] = {
            "slots": slots,
            "kv_hold_s": hold,
            "wall_s": round(wall, 2),
            "tokens_per_s": round(len(lat) * _TURN_TOKENS.value / wall, 1),
            "turn_p50_s": round(float(np.percentile(lat, 50)), 3),
            "turn_p99_s": round(float(np.percentile(lat, 99)), 3),
            "first_turn_p99_s": round(float(np.percentile(first, 99)), 3),
            **counts,
            "open_after": endpoint.book.num_open,
        }
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
        server.stop()
        endpoint.backend.close()
    out["give_up_over_hold_first_turn_p99"] = round(
        out["give_up"]["first_turn_p99_s"] / out["hold"]["first_turn_p99_s"], 3
    )
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
