"""Skewness-aware scheduling benchmark: ranker quality, dispatch makespan, elastic rule.

1. **Ranker** on real outputs: `--samples` is a SampleLog JSONL of real generations (make
   one with `--collect=N`: SmolLM2-135M-Instruct, temperature 1, on the reasoning-gym
   mixture basic_arithmetic / chain_sum / countdown / gsm_symbolic). Held-out prompts (by
   prompt id), recall@20/10/5 % and Kendall tau next to prompt-length and task-mean
   predictors. Without `--samples` the ranker is scored on synthetic toy prompts and the
   JSON says `"ranker_data": "synthetic"`.
2. **Makespan on the real engine** (tiny random model, lengths forced to the paper's
   long-tail trace scaled to `--max_len`): one global batch over instances with different
   slot counts (`--slots`), dispatched by random + FIFO (baseline), skew-aware (Algorithm
   2 + LPT; scores from a ranker *modelled* at recall@20 = `--ranker_recall`, because the
   length-replay prompts carry no length signal), and oracle (true lengths). PTL(BS) is
   measured first (`profile_ptl.measure_ptl`). On this CPU, instances sharing a process
   would interleave on one thread pool, so each instance's share runs alone and the batch
   makespan is the slowest instance's wall time (each instance as if on its own device);
   each share runs `--repeats` times and the fastest is kept. On this shared, loaded CPU
   wall times of ~1 s runs are noisy (`wall_over_random`), so the headline ratio times the
   engine's *own schedule* (its decode chunks: admissions, completions and LPT order as
   they happened) with the measured PTL at the instance's slot count (the decode step
   computes every slot): `over_random`. The simulator's makespan of the same plans is
   `simulated_over_random`. Dispatch plans with `static_batch=True` for the same reason.
3. **Pod scale in the simulator**: Qwen2.5-7B on H800 (roofline costs), global batch 1024,
   20K trace, 16 instances: random vs skew-aware (max and sum objectives) vs oracle.
4. **Elastic rule** on a simulated run whose lengths grow each step (trace 4K -> 20K):
   trace of T_gen, T_train, delta, delta' and the instance count.

    python tools/bench_scheduling.py --quick --samples=/tmp/smollm2_samples.jsonl
    python tools/bench_scheduling.py --collect=640 --samples_out=/tmp/smollm2_samples.jsonl

The last stdout line is JSON with `ranker_recall_at_20`, `skew_over_random_makespan`,
`oracle_over_random_makespan` (real engine) and every section's details.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import profile_ptl
import train_ranker
from absl import app, flags

from streamrl_jax.generation.engine import Engine, EngineConfig
from streamrl_jax.generation.types import GenerationRequest, SamplingParams
from streamrl_jax.model.loader import single_device_mesh
from streamrl_jax.scheduling import balance, dispatch
from streamrl_jax.scheduling.ranker import RankerConfig
from streamrl_jax.simulation import generation as sim_gen
from streamrl_jax.simulation import hardware, lengths, simulator
from streamrl_jax.simulation.dispatch import ranker_scores
from streamrl_jax.simulation.scenario import Scenario

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "Small sizes (<= 5 minutes on 2 CPU cores).")
flags.DEFINE_string("samples", None, "SampleLog JSONL of real generations for the ranker.")
flags.DEFINE_integer("ranker_steps", 400, "Ranker optimizer steps.")
flags.DEFINE_list("slots", ["8", "4", "4"], "Slot count per engine instance.")
flags.DEFINE_integer("repeats", 1, "Timed runs per plan (the fastest is kept: shared CPU).")
flags.DEFINE_integer("max_len", 256, "Longest forced response (engine section).")
flags.DEFINE_integer("requests", None, "Requests per global batch (engine section).")
flags.DEFINE_integer("seeds", None, "Global batches (seeds) in the engine section.")
flags.DEFINE_float("ranker_recall", 0.87, "Modelled ranker recall@20 for length replay.")
flags.DEFINE_integer("collect", 0, "Collect N real SmolLM2 samples into --samples_out, exit.")
flags.DEFINE_string("samples_out", "/tmp/smollm2_samples.jsonl", "Where --collect writes.")
flags.DEFINE_integer("collect_max_new", 160, "max_new_tokens of --collect.")


def ranker_section(samples: str | None, steps: int) -> dict:
    if samples:
        from streamrl_jax.scheduling.sample_log import read_sample_log

        examples = train_ranker.merge_by_prompt(read_sample_log(samples))
        cfg = RankerConfig(vocab_size=49152)
        _, report = train_ranker.train_and_evaluate(examples, cfg, steps, holdout=0.3)
        return {"data": "smollm2_real", **report}
    rng = np.random.default_rng(0)
    examples = []
    for i in range(1200):  # toy prompts: length = 40 x (ids 3/5/7/11) + prompt length
        p = rng.integers(0, 64, size=int(rng.integers(8, 33)))
        n = float(40 * np.isin(p, [3, 5, 7, 11]).sum() + len(p))
        examples.append(train_ranker.Example(f"toy/{i}", tuple(p.tolist()), None, n))
    cfg = RankerConfig(vocab_size=64, max_tokens=32)
    _, report = train_ranker.train_and_evaluate(examples, cfg, steps, holdout=0.3)
    return {"data": "synthetic", **report}


def engine_section(quick: bool) -> dict:
    graphdef, params, cfg = profile_ptl.load_model("tiny")
    slots = [int(s) for s in FLAGS.slots]
    max_len = FLAGS.max_len
    ptl_sizes = sorted({1, 2, *slots, max(slots) // 2 or 1})
    prof = profile_ptl.measure_ptl(
        graphdef, params, cfg, ptl_sizes, chunks=3 if quick else 6, max_total_length=max_len + 32
    )
    # PTL cannot fall as the batch grows; a dip is load noise on the shared CPU.
    per_token = np.maximum.accumulate(prof["per_token_s"])
    ptl = dispatch.PTLProfile(tuple(prof["batch_sizes"]), tuple(per_token.tolist()))
    engines = [
        Engine(
            graphdef,
            params,
            cfg,
            EngineConfig(
                num_slots=s,
                max_prompt_length=16,
                max_total_length=max_len + 16,
                chunk_steps=8,
                prefill_batch=4,
                admission="lpt",  # priority 0 everywhere = FIFO (ties in submission order)
            ),
            single_device_mesh(),
            instance_id=i,
        )
        for i, s in enumerate(slots)
    ]
    n_req = FLAGS.requests or (128 if quick else 256)
    trace = dataclasses.replace(lengths.paper_trace(max_len), min_len=4)
    warm = [_request(i, 8, np.random.default_rng(i)) for i in range(4)]
    for e in engines:
        e.run(warm)  # compile prefill and the decode chunk outside the timings
    results: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    steps_timed: dict[str, list[float]] = {}
    for seed in range(FLAGS.seeds or (3 if quick else 6)):
        rng = np.random.default_rng(seed)
        _, history = lengths.sample_lengths(trace, n_req, rng)
        _, true = lengths.sample_lengths(trace, n_req, rng)
        reqs = [_request(i, int(n), rng) for i, n in enumerate(true)]
        prompts = [r.prompt for r in reqs]
        skew = dispatch.SkewAwareDispatcher(None, ptl, dispatch.DispatchConfig(static_batch=True))
        skew.observe(history)
        sum_cfg = dispatch.DispatchConfig(objective="sum", static_batch=True)
        skew_sum = dispatch.SkewAwareDispatcher(None, ptl, sum_cfg)
        skew_sum.observe(history)
        scores = ranker_scores(true, FLAGS.ranker_recall, 0.2, rng)
        random_plan = dispatch.RandomDispatcher(seed).plan(prompts, len(slots), slots)
        plans = {
            "random_fifo": random_plan,
            "random_lpt": dataclasses.replace(random_plan, priority_per_request=scores.tolist()),
            "skew_max": skew.plan_scores(scores, len(slots), slots),
            "skew_sum": skew_sum.plan_scores(scores, len(slots), slots),
            "oracle": skew.plan_scores(true.astype(float), len(slots), slots),
        }
        for name, plan in plans.items():
            span = step_span = 0.0
            for k, engine in enumerate(engines):
                mine = [
                    dataclasses.replace(r, priority=plan.priority_per_request[i])
                    for i, r in enumerate(reqs)
                    if plan.instance_per_request[i] == k
                ]
                best = np.inf
                for _ in range(FLAGS.repeats):
                    chunks0 = len(engine.metrics()["timeline"])
                    t0 = time.perf_counter()
                    engine.run(mine)
                    best = min(best, time.perf_counter() - t0)
                    chunks = len(engine.metrics()["timeline"]) - chunks0
                span = max(span, best)
                # The engine's own schedule (admissions, chunks) timed with the measured PTL
                # at its slot count: every decode step computes every slot.
                step_span = max(step_span, chunks * engine.cfg.chunk_steps * ptl(slots[k]))
            results.setdefault(name, []).append(span)
            steps_timed.setdefault(name, []).append(step_span)
            spec_spans = _simulated_makespan(plan, slots, ptl, true)
            predicted.setdefault(name, []).append(spec_spans)

    def ratios(d: dict[str, list[float]]) -> dict[str, float]:
        base = np.array(d["random_fifo"])
        return {k: float(np.mean(np.array(v) / base)) for k, v in d.items()}

    return {
        "slots": slots,
        "requests": n_req,
        "max_len": max_len,
        "ptl_s": dict(zip(map(str, prof["batch_sizes"]), prof["per_token_s"], strict=True)),
        "wall_makespan_s": {k: [round(x, 4) for x in v] for k, v in results.items()},
        "step_makespan_s": {k: [round(x, 4) for x in v] for k, v in steps_timed.items()},
        "over_random": ratios(steps_timed),
        "wall_over_random": ratios(results),
        "simulated_over_random": ratios(predicted),
    }


def _request(i: int, length: int, rng: np.random.Generator) -> GenerationRequest:
    return GenerationRequest(
        request_id=i,
        prompt=rng.integers(1, 256, size=int(rng.integers(8, 17))).tolist(),
        max_new_tokens=1,
        sampling=SamplingParams(temperature=1.0),
        seed=i,
        forced_length=length,
    )


def _simulated_makespan(plan, slots, ptl, true) -> float:
    """The simulator's makespan of the same plan with the measured PTL (cross-check)."""
    spans = []
    prompt = np.full(len(true), 12)
    for k, order in enumerate(plan.orders(len(slots))):
        if order:
            cost = sim_gen.InstanceSpec(cost=_PTLCost(ptl, slots[k]), slots=slots[k])
            spans.append(sim_gen.run_instance(cost, order, prompt, true)[2])
    return max(spans)


@dataclasses.dataclass(frozen=True)
class _PTLCost:
    ptl: dispatch.PTLProfile
    slots: int

    def segment_time(self, batch: int, ctx0: float, steps: int) -> float:
        return steps * self.ptl(self.slots)  # fixed-shape decode step: every slot computed

    def prefill_time(self, tokens: float) -> float:
        return 0.0


def _scenario(max_len: int, devices: int = 32) -> Scenario:
    return Scenario(
        mode="stream_sync",
        model=hardware.get_model("qwen2.5-7b"),
        hw=hardware.get_hardware("h800"),
        devices=devices,
        trace=lengths.paper_trace(max_len),
        global_batch=1024,
    )


def simulator_section(quick: bool, recall: float) -> dict:
    sc = _scenario(20_000)
    spec = simulator.roofline_costs(sc).instance()
    n_inst = 16
    kinds = {
        "random_fifo": ("random", 1.0, "max"),
        "skew_max": ("skew_aware", recall, "max"),
        "skew_sum": ("skew_aware", recall, "sum"),
        "oracle": ("skew_aware", 1.0, "max"),
    }
    spans: dict[str, list[float]] = {k: [] for k in kinds}
    rng = np.random.default_rng(0)
    _, recent = lengths.sample_lengths(sc.trace, 1024, rng)
    for _ in range(3 if quick else 10):
        prompt, resp = lengths.sample_lengths(sc.trace, 1024, rng)
        for name, (kind, rec, obj) in kinds.items():
            plan = sim_gen.plan_batch(
                spec, n_inst, resp, recent, dispatch_kind=kind, ranker_recall=rec,
                alpha=0.2, objective=obj, rng=np.random.default_rng(len(spans[name])),
            )  # fmt: skip
            spans[name].append(sim_gen.simulate_batch(spec, plan, prompt, resp).makespan)
        recent = resp
    base = np.array(spans["random_fifo"])
    return {
        "setting": f"qwen2.5-7b, h800, tp {sc.tp}, {n_inst} instances x {spec.slots} slots, "
        "batch 1024, 20K trace",
        "ranker_recall": recall,
        "over_random": {k: float(np.mean(np.array(v) / base)) for k, v in spans.items()},
    }


def elastic_section(quick: bool) -> dict:
    """Output lengths grow each step (trace max 4K -> 20K, batch 1024); the trainer keeps 8
    devices; generation starts with 4 instances and may grow to 16 (reserved devices).
    delta' = T_gen(k) - T_gen(k + 1), both predicted by the simulator on the step's batch."""
    sc = _scenario(20_000)
    costs = simulator.roofline_costs(sc)
    spec = costs.instance()
    rng = np.random.default_rng(0)
    steps = 8 if quick else 14
    rows, batch = [], {}

    def t_gen(k: int) -> float:
        plan = sim_gen.plan_batch(
            spec, k, batch["resp"], batch["recent"], dispatch_kind="skew_aware",
            ranker_recall=0.87, alpha=0.2, objective="max", rng=np.random.default_rng(0),
        )  # fmt: skip
        return sim_gen.simulate_batch(spec, plan, batch["prompt"], batch["resp"]).makespan

    ctl = balance.ElasticController(4, 16, saving=lambda k, _t: t_gen(k) - t_gen(k + 1))
    batch["recent"] = lengths.sample_lengths(lengths.paper_trace(4_000), 1024, rng)[1]
    for step in range(steps):
        max_len = int(4_000 + (16_000 * step) / (steps - 1))
        trace = lengths.paper_trace(max_len)
        batch["prompt"], batch["resp"] = lengths.sample_lengths(trace, 1024, rng)
        tg = t_gen(ctl.instances)
        tt = float(costs.train_seconds(batch["prompt"], batch["resp"], 8).sum())
        d = ctl.observe(step, tg, tt)
        rows.append(
            {
                "step": step,
                "max_len": max_len,
                "t_gen": round(tg, 1),
                "t_train": round(tt, 1),
                "delta": round(d.delta, 1),
                "delta_prime": round(d.delta_prime, 1),
                "instances": d.instances,
                "add": d.add,
            }
        )
        batch["recent"] = batch["resp"]
    return {"batch": 1024, "train_devices": 8, "trace": rows, "final_instances": ctl.instances}


def collect(n: int, out: str, max_new: int) -> None:
    """Real SmolLM2 generations on the reasoning-gym mixture, one SampleLog line each."""
    from streamrl_jax.data import tokenize
    from streamrl_jax.model.defaults import smollm2_gguf_path
    from streamrl_jax.model.loader import load_pretrained
    from streamrl_jax.rewards.tasks import DEFAULT_TASKS, TaskDataset
    from streamrl_jax.scheduling.sample_log import SampleLog

    mesh = single_device_mesh()
    pre = load_pretrained(smollm2_gguf_path(), mesh=mesh)
    prompts = [tokenize(p, pre.tokenizer) for p in TaskDataset(DEFAULT_TASKS, seed=0, size=n)]
    maxp = 1 << (max(len(p.tokens) for p in prompts) - 1).bit_length()
    ecfg = EngineConfig(
        num_slots=32, max_prompt_length=maxp, max_total_length=maxp + max_new, chunk_steps=8,
        prefill_batch=8, min_bucket=64, stop_ids=tuple(pre.cfg.eos_token_ids)[:4],
    )  # fmt: skip
    engine = Engine(pre.graphdef, pre.params, pre.cfg, ecfg, mesh)
    engine.submit(
        [
            GenerationRequest(
                request_id=i,
                prompt=list(p.tokens),
                max_new_tokens=max_new,
                sampling=SamplingParams(temperature=1.0),
                seed=1000 + i,
                metadata={"prompt_id": p.problem.prompt_id, "task": p.problem.task},
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
    )
    with SampleLog(out, flush_every=1) as log:
        while engine.has_work():
            for s in engine.step():
                log.write(s, step=0)
    print(json.dumps({"collected": n, "out": out}))


def main(argv):
    del argv
    if FLAGS.collect:
        collect(FLAGS.collect, FLAGS.samples_out, FLAGS.collect_max_new)
        return
    t0 = time.time()
    quick = FLAGS.quick
    ranker = ranker_section(FLAGS.samples, 300 if quick else FLAGS.ranker_steps)
    print(json.dumps({"ranker": ranker}), flush=True)
    engine = engine_section(quick)
    print(json.dumps({"engine": engine}), flush=True)
    recall = ranker["ranker"]["recall_at_20"]
    sim = {
        "paper_recall": simulator_section(quick, FLAGS.ranker_recall),
        "measured_recall": simulator_section(quick, max(recall, 0.01)),
    }
    print(json.dumps({"simulator": sim}), flush=True)
    elastic = elastic_section(quick)
    print(json.dumps({"elastic": elastic}), flush=True)
    summary = {
        "ranker_recall_at_20": recall,
        "ranker_recall_at_10": ranker["ranker"]["recall_at_10"],
        "ranker_recall_at_5": ranker["ranker"]["recall_at_5"],
        "ranker_kendall_tau": ranker["ranker"]["kendall_tau"],
        "ranker_data": ranker["data"],
        "ranker_heldout_prompts": ranker["heldout_prompts"],
        "random_recall_at_20": ranker["random_recall_at_20"],
        "task_mean_recall_at_20": ranker["task_mean"]["recall_at_20"],
        "skew_over_random_makespan": engine["over_random"]["skew_max"],
        "skew_sum_over_random_makespan": engine["over_random"]["skew_sum"],
        "oracle_over_random_makespan": engine["over_random"]["oracle"],
        "random_lpt_over_random_makespan": engine["over_random"]["random_lpt"],
        "sim_skew_over_random": sim["paper_recall"]["over_random"]["skew_max"],
        "sim_skew_sum_over_random": sim["paper_recall"]["over_random"]["skew_sum"],
        "sim_oracle_over_random": sim["paper_recall"]["over_random"]["oracle"],
        "sim_skew_measured_recall_over_random": sim["measured_recall"]["over_random"]["skew_max"],
        "elastic_final_instances": elastic["final_instances"],
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
