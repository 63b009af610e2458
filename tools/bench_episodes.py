"""Episode throughput: KV continuation vs re-prefill per turn, stream_async vs stream_sync.

    python tools/bench_episodes.py --quick     # <= 5 minutes
    python tools/bench_episodes.py             # more episodes, the pipeline on SmolLM2

1. **Engine** (SmolLM2-135M, one CPU device, the agent config's engine): `--episodes`
   episodes of `--turns` policy turns of `--turn_tokens` tokens each (forced lengths:
   every run does the same work), `--env_tokens` environment tokens appended after
   every turn but the last, on one engine with `--slots` slots, driven turn by turn
   as the episodes rollout does. `kv`: each next turn extends its kept slot's KV in
   place (`GenerationRequest.keep_kv`); `reprefill`: each next turn re-prefills the
   whole history (the baseline). Same-run ratio: kv / reprefill throughput. Every
   shape is compiled by an untimed pass first.
2. **Pipeline** (`configs/agent.py` with the retry environment, 3 attempts: every
   episode has 3 turns whatever the model; `--quick`: the tiny model): the same run
   in `stream_sync` and `stream_async`, steady-state seconds per step (the first
   `--skip` steps, which compile, left out), episodes and turns per second. Same-run
   ratio: async / sync.

3. **Endpoint** (SmolLM2-135M, one instance, `--slots` slots): `--clients` concurrent
   official `openai` clients on loopback, each running `--rounds` chat episodes of
   `--turns` turns of `--turn_tokens` tokens (`ignore_eos`: the same work every run),
   a fixed user message between turns, vs the same episodes driven in-process (the
   endpoint's `Turns` and backend, no HTTP) by as many threads: tokens/s, p50/p99 turn
   latency, a request's round trip without generation, and the median turn overhead.
   Same-run ratio: endpoint / in-process tokens/s. A first pass of each compiles.

Last line: JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

_QUICK = flags.DEFINE_bool("quick", False, "A <= 5 minute run.")
_EPISODES = flags.DEFINE_integer("episodes", 0, "Engine: episodes (0: 16 quick, 32 full).")
_TURNS = flags.DEFINE_integer("turns", 4, "Engine: policy turns per episode.")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 16, "Engine: policy tokens per turn.")
_ENV_TOKENS = flags.DEFINE_integer("env_tokens", 24, "Engine: environment tokens per turn.")
_PROMPT = flags.DEFINE_integer("prompt", 110, "Engine: first prompt tokens.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Engine: slots.")
_STEPS = flags.DEFINE_integer("steps", 0, "Pipeline: steps per mode (0: 5 quick, 8 full).")
_SKIP = flags.DEFINE_integer("skip", 2, "Pipeline: first steps left out (compiles).")
_PIPELINE = flags.DEFINE_bool("pipeline", True, "Run the pipeline part.")
_ENDPOINT = flags.DEFINE_bool("endpoint", True, "Run the endpoint part.")
_CLIENTS = flags.DEFINE_integer("clients", 8, "Endpoint: concurrent clients (one episode each).")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Endpoint: episodes per client (0: 1 quick, 3 full).")
_MEMORY_ROUNDS = flags.DEFINE_integer(
    "memory_rounds", 0, "Endpoint: rounds of the load afterwards, resident memory after each."
)


def _episode_requests(n: int, prompt_len: int, keep_kv: bool, vocab: int):
    from streamrl_jax.generation.types import GenerationRequest, SamplingParams

    rng = np.random.default_rng(0)
    return [
        GenerationRequest(
            request_id=f"e{i}",
            prompt=rng.integers(100, vocab, prompt_len).tolist(),
            max_new_tokens=_TURN_TOKENS.value,
            forced_length=_TURN_TOKENS.value,
            sampling=SamplingParams(temperature=0.7),
            seed=i,
            keep_kv=keep_kv,
        )
        for i in range(n)
    ]


def run_episodes(engine, requests) -> dict[str, float]:
    """Drives `requests`' episodes to `--turns` turns each; wall time and counts."""
    from streamrl_jax.generation.types import GenerationRequest

    rng = np.random.default_rng(1)
    env = rng.integers(100, 1000, _ENV_TOKENS.value).tolist()
    by_id = {r.request_id: r for r in requests}
    turns = dict.fromkeys(by_id, 0)
    policy_tokens = 0
    t0 = time.perf_counter()
    engine.submit(requests)
    while engine.has_work():
        for s in engine.step():
            turns[s.request_id] += 1
            policy_tokens += _TURN_TOKENS.value
            if turns[s.request_id] < _TURNS.value:
                keep_kv = by_id[s.request_id].keep_kv
                turn = GenerationRequest.next_turn(
                    s, env, _TURN_TOKENS.value, forced=True, keep_kv=keep_kv
                )
                engine.submit([turn])
            else:
                engine.release(s.request_id)
    wall = time.perf_counter() - t0
    total = sum(turns.values())
    return {"wall_s": wall, "turns": total, "policy_tokens": policy_tokens}


def engine_part() -> dict:
    import jax
    from jax.sharding import AxisType, Mesh

    from streamrl_jax.generation.engine import Engine
    from streamrl_jax.generation.engine_config import EngineConfig
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    n = _EPISODES.value or (16 if _QUICK.value else 32)
    mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",), axis_types=(AxisType.Auto,))
    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    total = _PROMPT.value + _TURNS.value * (_TURN_TOKENS.value + _ENV_TOKENS.value) + 8
    ecfg = EngineConfig(
        num_slots=_SLOTS.value,
        max_prompt_length=128,
        max_total_length=max(total, 160),
        chunk_steps=8,
        prefill_batch=4,
        stop_ids=tuple(pre.tokenizer.stop_ids),
    )
    out = {}
    for mode, keep in (("reprefill", False), ("kv", True)):
        engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
        run_episodes(engine, _episode_requests(n, _PROMPT.value, keep, pre.cfg.vocab_size))
        engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)  # shapes compiled
        r = run_episodes(engine, _episode_requests(n, _PROMPT.value, keep, pre.cfg.vocab_size))
        m = engine.metrics()
        r.update(
            extended=m["extended"],
            reprefilled=m["reprefilled"],
            reprefilled_tokens=m["reprefilled_tokens"],
        )
        r["tokens_per_s"] = r["policy_tokens"] / r["wall_s"]
        r["turns_per_s"] = r["turns"] / r["wall_s"]
        out[mode] = {k: round(float(v), 3) for k, v in r.items()}
        print(f"engine {mode}: {out[mode]}", file=sys.stderr, flush=True)
    out["kv_over_reprefill"] = round(
        out["kv"]["tokens_per_s"] / out["reprefill"]["tokens_per_s"], 3
    )
    out.update(episodes=n, turns=_TURNS.value, turn_tokens=_TURN_TOKENS.value)
    out.update(env_tokens=_ENV_TOKENS.value, prompt=_PROMPT.value, slots=_SLOTS.value)
    return out


def pipeline_part() -> dict:
    import importlib.util

    from streamrl_jax import pipeline as run_lib
    from streamrl_jax.config import from_config_dict

    spec = importlib.util.spec_from_file_location("agent", os.path.join(_ROOT, "configs/agent.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    steps = _STEPS.value or (5 if _QUICK.value else 8)
    out = {"model": "tiny" if _QUICK.value else "smollm2", "steps": steps}
    for mode in ("stream_sync", "stream_async"):
        c = module.get_config("tiny" if _QUICK.value else "short")
        c.pipeline.mode = mode
        c.pipeline.steps = steps
        c.environment.name = "retry"
        c.environment.max_attempts = 3
        c.eval.num_problems = 0
        c.eval.every = 0
        c.checkpoint.every = 0
        c.log.progress = False
        c.log.tensorboard = False
        c.optimizer.warmup_steps = 0
        cfg = from_config_dict(c.to_dict())
        with tempfile.TemporaryDirectory() as workdir:
            result = run_lib.run(cfg, workdir)
        rows = result.steps[_SKIP.value :]
        step_s = float(np.mean([r["step_s"] for r in rows]))
        samples = float(np.mean([r["samples"] for r in rows]))
        turns = float(np.mean([r["samples"] * r["episode_turns"] for r in rows]))
        out[mode] = {
            "step_s": round(step_s, 3),
            "episodes_per_s": round(samples / step_s, 3),
            "turns_per_s": round(turns / step_s, 3),
            "kv_extended": float(sum(r["kv_extended"] for r in result.steps)),
            "kv_reprefilled": float(sum(r["kv_reprefilled"] for r in result.steps)),
        }
        print(f"pipeline {mode}: {out[mode]}", file=sys.stderr, flush=True)
    out["async_over_sync"] = round(out["stream_sync"]["step_s"] / out["stream_async"]["step_s"], 3)
    return out


def endpoint_part() -> dict:
    """N concurrent official `openai` clients on loopback vs the same episodes driven
    in-process (the endpoint's turns and backend without HTTP), on one SmolLM2 engine."""
    import concurrent.futures
    import contextlib
    import logging as std_logging
    import threading

    import openai

    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax.endpoint import api
    from streamrl_jax.endpoint.client import EndpointClient
    from streamrl_jax.endpoint.kit import serve
    from streamrl_jax.endpoint.server import endpoint_token
    from streamrl_jax.generation.engine_config import EngineConfig
    from streamrl_jax.generation.service import GenerationService
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained

    std_logging.getLogger("httpx").setLevel(std_logging.WARNING)
    meshes = mesh_lib.instance_meshes(
        mesh_lib.make_meshes(mesh_lib.MeshConfig(generate_devices=1, train_devices=1)).generate
    )
    pre = load_pretrained(smollm2_gguf_path(), mesh=meshes[0])
    n, rounds = _CLIENTS.value, _ROUNDS.value or (1 if _QUICK.value else 3)
    turns_n, k = _TURNS.value, _TURN_TOKENS.value
    ecfg = EngineConfig(
        num_slots=_SLOTS.value,
        max_prompt_length=128,
        max_total_length=512,
        chunk_steps=8,
        prefill_batch=4,
        stop_ids=tuple(pre.tokenizer.stop_ids),
    )
    service = GenerationService(pre.graphdef, pre.params, pre.cfg, meshes, ecfg)
    token = endpoint_token(b"bench")
    limits = api.Limits(max_tokens=k, max_inflight=4 * n)
    endpoint, server = serve(service, pre.tokenizer, token, limits)
    backend, turns = endpoint.backend, endpoint.turns
    client = EndpointClient(server.url, token)
    task = "What is {} + {}? Think step by step, then answer."
    feedback = {"role": "user", "content": "Not yet. Check your work and answer again."}
    sampling = api.Sampling(k, 0.7, 1.0, (), None, False, False, True, ignore_eos=True)
    params = turns.sampling(sampling)

    def over_http(i: int) -> list[float]:
        lat = []
        with client.episode() as (oc, _):
            messages = [{"role": "user", "content": task.format(i, 2 * i + 1)}]
            for _ in range(turns_n):
                t0 = time.perf_counter()
                r = oc.chat.completions.create(
                    model="policy", messages=messages, max_tokens=k, temperature=0.7,
                    logprobs=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                lat.append(time.perf_counter() - t0)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             feedback]  # fmt: skip
        return lat

    def in_process(i: int) -> list[float]:
        lat = []
        eid = endpoint.book.open()
        messages = [{"role": "user", "content": task.format(i, 2 * i + 1)}]
        for _ in range(turns_n):
            t0 = time.perf_counter()
            rec = endpoint.book.take(eid)
            chat = api.Chat(messages)
            request = turns.chat(rec, chat, sampling, params, limits.episode_tokens)
            sample = backend.submit(request).result(timeout=600)
            turn = turns.commit(rec, request, sample, chat)
            endpoint.book.give_back(rec)
            lat.append(time.perf_counter() - t0)
            messages = [*rec.messages, feedback]
            del turn
        endpoint.book.close(eid)
        backend.release(eid)
        return lat

    out: dict = {"clients": n, "episodes_per_client": rounds, "turns": turns_n, "turn_tokens": k}

    def run(fn, episodes: int) -> tuple[float, list[float]]:
        lat: list[float] = []
        lock = threading.Lock()

        def client_loop(c: int) -> None:
            for r in range(episodes):
                got = fn(c * 100 + r)
                with lock:
                    lat.extend(got)

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(client_loop, range(n)))
        return time.perf_counter() - t0, lat

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    paths = {"in_process": in_process, "endpoint": over_http}
    for _ in range(2):  # every shape compiled before anything is timed (both orders)
        for fn in paths.values():
            run(fn, 1)
    rss0, served0 = rss_mb(), endpoint.counts["requests"]
    timed: dict[str, list] = {name: [] for name in paths}
    for _ in range(3):  # alternated, three times: the best of each (a shared machine)
        for name, fn in paths.items():
            timed[name].append(run(fn, rounds))
    # The load: every request answered (none refused or lost), nothing left open, and
    # the process's resident memory across the timed runs.
    out["load"] = {
        "http_requests": endpoint.counts["requests"] - served0,
        "refused": endpoint.counts["refused"],
        "open_episodes_after": endpoint.book.num_open,
        "rss_growth_mb": round(rss_mb() - rss0, 1),
    }
    for name, runs in timed.items():
        wall, lat = min(runs, key=lambda x: x[0])
        tokens = len(lat) * k
        out[name] = {
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "turns_per_s": round(len(lat) / wall, 3),
            "turn_p50_s": round(float(np.percentile(lat, 50)), 4),
            "turn_p99_s": round(float(np.percentile(lat, 99)), 4),
        }
        print(f"endpoint part {name}: {out[name]}", file=sys.stderr, flush=True)
    # The server's own cost per request without generation: a refused request's (404)
    # round trip through the official client; and the difference of the median turns.
    oc = client.openai("ep-unknown")
    t = []
    for _ in range(50):
        t0 = time.perf_counter()
        with contextlib.suppress(openai.NotFoundError):  # the 404 is the point
            oc.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        t.append(time.perf_counter() - t0)
    out["round_trip_no_generation_ms"] = round(1e3 * float(np.median(t)), 3)
    out["endpoint_over_in_process"] = round(
        out["endpoint"]["tokens_per_s"] / out["in_process"]["tokens_per_s"], 3
    )
    out["median_turn_overhead_ms"] = round(
        1e3 * (out["endpoint"]["turn_p50_s"] - out["in_process"]["turn_p50_s"]), 2
    )
    if _MEMORY_ROUNDS.value:
        # Bounded memory: the same load again and again (each round every client plays
        # one episode through the endpoint), the process's resident memory after each.
        # Growth that stops is allocation reaching its working set; growth that goes on
        # is a leak.
        import gc

        trace = []
        for _ in range(_MEMORY_ROUNDS.value):
            run(over_http, 1)
            gc.collect()
            trace.append(round(rss_mb() - rss0, 1))
        out["memory_rounds"] = {
            "requests_per_round": n * turns_n,
            "rss_growth_mb": trace,
            "open_episodes_after": endpoint.book.num_open,
        }
        print(f"endpoint memory rounds: {out['memory_rounds']}", file=sys.stderr, flush=True)
    server.stop()
    backend.close()
    return out


def main(argv) -> None:
    del argv
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # the pipeline's two roles
    t0 = time.perf_counter()
    out = {"bench": "episodes", "quick": _QUICK.value, "engine": engine_part()}
    if _ENDPOINT.value:
        out["endpoint"] = endpoint_part()
    if _PIPELINE.value:
        out["pipeline"] = pipeline_part()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
