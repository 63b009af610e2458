"""The pod planner (`streamrl_podplan.programs`, `reports`, `search`, `shapes`) on this
machine's CPU devices (the TPU topology needs libtpu, an optional install; the planners
are the same code for any device kind): every executable of both roles compiles from
abstract inputs placed by the roles' shardings and reports its memory. (What a remat
policy saves shows on a TPU compile, not in XLA:CPU's memory analysis of these tiny
programs: BENCHMARKS.md "Pod plans".)"""

import dataclasses
import functools
import re
import types

import jax
import numpy as np
import pytest

from streamrl_podplan import programs, reports, search, shapes

KNOBS = programs.Knobs(model="tiny", rows=4, seq=64, slots=4, max_prompt=16, max_len=64,
                       chunk_steps=4, prefill_batch=2, dtype="float32")  # fmt: skip


# Each program compiled once a module: tests that plan the same knobs on the same devices
# (the hand count's generation and the TPU gate-up layout's "auto"; the full-depth cost's
# probes, which `training_cost` and its test both ask for) read one compile's report.
_PLANNED: dict = {}
_PLAN = {"training": reports.plan_training, "generation": reports.plan_generation}


def _planned(role, k, devices, hbm, *apply):
    devs = tuple((d.platform, d.id) for d in devices.flat)
    key = (role, k, tuple(shapes.TINY.items()), devs, hbm, *apply)  # "tiny" as it is now
    if key not in _PLANNED:
        _PLANNED[key] = _PLAN[role](k, devices, hbm, *apply)
    return _PLANNED[key]


def _plan_training(k, devices, hbm, apply=True):
    """`reports.plan_training`, memoised by its arguments (the devices by kind and id)."""
    return _planned("training", k, devices, hbm, apply)


def _plan_generation(k, devices, hbm):
    """`reports.plan_generation`, memoised as `_plan_training`."""
    return _planned("generation", k, devices, hbm)


def test_both_roles_compile_and_report_their_memory_per_device():
    devices = np.array(jax.devices()[:4])
    training = reports.plan_training(KNOBS, devices[:2], hbm=1.0)
    generation = reports.plan_generation(KNOBS, devices[2:3], hbm=1.0)
    assert [r["executable"] for r in training + generation] == [
        "accumulate", "apply", "prefill", "decode_chunk"
    ]  # fmt: skip
    for r in training + generation:
        assert r["fits"] and 0 < r["arguments_bytes"] <= r["peak_bytes"] < 1 << 30, r


# The same planners for a TPU topology that is not attached (libtpu, a test dependency:
# pyproject's `test` extra). Dimensions of `shapes.TINY` are multiples of 128, so a
# TPU's tile padding does not blur the hand counts below.
TPU_KNOBS = programs.Knobs(model="tiny", rows=4, seq=128, slots=8, max_prompt=128, max_len=256,
                           chunk_steps=4, prefill_batch=2, dtype="float32")  # fmt: skip


@functools.cache
def _v5p_2x2x1():
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        topology_name="v5p:2x2x1", platform="tpu", chip_config_name="megacore"
    )
    return np.array(topo.devices)


def test_a_tpu_plan_reports_what_a_hand_count_of_its_arguments_says():
    devices = _v5p_2x2x1()
    cfg = programs.model_config(TPU_KNOBS)
    n, f32, bf16 = cfg.num_params(), 4, 2
    # Training: FSDP over 2 chips; f32 master weights, two Adam moments, the accumulator.
    accumulate, apply = _plan_training(TPU_KNOBS, devices[:2], hbm=95)
    batch = accumulate["arguments_bytes"] - (n * f32 + n * f32) // 2  # weights + accumulator
    assert 0 < batch < 64 * 1024, accumulate  # the micro-batch's 4 x 128 tokens and masks
    # accumulate does not read the moments (jit prunes them), but they stay on the chip
    assert accumulate["unread_bytes"] == pytest.approx(2 * n * f32 / 2, rel=1e-3)
    assert accumulate["peak_bytes"] >= accumulate["arguments_bytes"]
    assert accumulate["need_bytes"] == accumulate["peak_bytes"] + accumulate["unread_bytes"]
    assert apply["arguments_bytes"] == pytest.approx(4 * n * f32 / 2, rel=2e-3)
    # Generation: one chip, bf16 weights and KV cache (the gate-up test's "auto" compile).
    k = TPU_KNOBS
    kv = 2 * cfg.num_layers * k.slots * k.max_len * cfg.num_kv_heads * cfg.head_dim * bf16
    prefill, chunk = _plan_generation(k, devices[:1], hbm=95)
    for r in (prefill, chunk):
        assert r["arguments_bytes"] == pytest.approx(n * bf16 + kv, rel=5e-3), r
        assert r["fits"] and r["peak_bytes"] >= r["arguments_bytes"], r
    assert reports.verdict("generation", [prefill, chunk]).startswith("generation: fits")


def test_gate_up_parts_major_spares_the_tpu_a_copy_of_the_mlp_weights():
    # [E, 2, M] ("embed_major", CPU's layout): XLA:TPU re-lays out every layer's gate_up
    # (its minor tile would pad the 2) before the decode chunk's loop, all layers' copies
    # live at once; [2, E, M] (`gate_up_layout="auto"` on TPU) is read as it lies.
    cfg, devices = programs.model_config(TPU_KNOBS), _v5p_2x2x1()[:1]
    by_layout = {
        layout: _plan_generation(
            dataclasses.replace(TPU_KNOBS, gate_up_layout=layout), devices, hbm=95
        )
        for layout in ("embed_major", "auto")
    }
    copy = cfg.num_layers * cfg.hidden_size * 2 * cfg.intermediate_size * 2  # bf16
    for em, pm in zip(by_layout["embed_major"], by_layout["auto"], strict=True):
        assert em["arguments_bytes"] == pm["arguments_bytes"], em["executable"]
        assert pm["peak_bytes"] <= em["peak_bytes"], em["executable"]
    # The decode chunk's peak falls by most of the copy (0.75 of it measured: the
    # compiler overlaps some of the rest); prefill's copies were one layer's at a time.
    em, pm = by_layout["embed_major"][1], by_layout["auto"][1]
    assert em["peak_bytes"] - pm["peak_bytes"] >= 0.7 * copy, (em, pm, copy)


def test_sequence_parallel_keeps_a_tp_th_of_the_residual_stream_on_each_chip(monkeypatch):
    # Full remat keeps each block's input for the backward: layers x rows x seq x embed,
    # replicated over tp; sequence parallel keeps 1/tp of it a chip. 8 layers x 1 row x
    # 128 x 256 x f32 = 1 MiB, half of it freed at TP 2 (1.32 MB measured: the
    # recomputed block's own activations are sequence-sharded too; at 512 positions,
    # 4 MiB and 5.78 MB, in twice the compile time).
    monkeypatch.setattr(shapes, "TINY", dict(shapes.TINY, num_heads=4, num_kv_heads=2,
                                               num_layers=8))  # fmt: skip
    k = programs.Knobs(model="tiny", rows=2, seq=128, tp=2, remat="full", dtype="float32")
    cfg, devices = programs.model_config(k), _v5p_2x2x1()
    plain, sp = (
        reports.plan_training(dataclasses.replace(k, sequence_parallel=on), devices, 95, False)[0]
        for on in (False, True)
    )
    kept = cfg.num_layers * 1 * k.seq * cfg.hidden_size * 4
    assert sp["arguments_bytes"] == plain["arguments_bytes"]
    assert plain["peak_bytes"] - sp["peak_bytes"] >= kept * (1 - 1 / k.tp), (plain, sp, kept)


def test_an_oversized_plan_is_reported_as_not_fitting_with_its_role_and_amount():
    # 2,048 slots x 65,536 positions of the tiny model's KV cache: 128 GiB on a 95 GiB chip.
    k = dataclasses.replace(TPU_KNOBS, slots=2048, max_len=1 << 16, chunk_steps=2)
    got = reports.plan_generation(k, _v5p_2x2x1()[:1], hbm=95)
    line = reports.verdict("generation", got)
    assert line.startswith("generation: DOES NOT FIT: "), line
    over = float(re.search(r"\((?:at least )?([\d.]+) GiB over\)", line).group(1))
    assert over >= 128 - 95, line


def test_the_report_cache_resumes_a_plan_without_compiling_it_again(tmp_path, monkeypatch):
    cache = tmp_path / "reports.jsonl"
    monkeypatch.setattr(reports, "REPORT_CACHE", cache)
    devices = np.array(jax.devices()[:2])
    first = reports.plan_training(KNOBS, devices, hbm=1.0)
    assert len(cache.read_text().splitlines()) == 2  # accumulate and apply
    with cache.open("a") as f:
        f.write('{"key": "cut short by a kill')  # a torn last line is skipped, not fatal

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(reports, "_report", no_compile)
    assert reports.plan_training(KNOBS, devices, hbm=1.0) == first
    # Another program (here its micro-batch), another key: compiled, not read.
    with pytest.raises(AssertionError, match="compiled again"):
        reports.plan_training(dataclasses.replace(KNOBS, rows=2), devices, hbm=1.0)
    with pytest.raises(AssertionError, match="compiled again"):  # another HBM, another verdict
        reports.plan_training(KNOBS, devices, hbm=2.0)


# The even depth's probes on this machine's CPU by default (4 compiles of a 6-deep trainer,
# about 3x faster here than libtpu's for the v5p topology: 54 s against 164 s, loaded);
# the same probes compiled for the TPU topology, and the odd depth's, are further cases
# (-m extended) of the same property.
@pytest.mark.parametrize(
    "depth, platform",
    [
        (6, "cpu"),
        pytest.param(6, "tpu", marks=pytest.mark.extended),
        pytest.param(5, "cpu", marks=pytest.mark.extended),
    ],
)
def test_the_trainer_cost_is_carried_to_full_depth(depth, platform, monkeypatch):
    # XLA counts a loop body once: the scanned trainer's FLOPs miss all blocks but one.
    # An even depth reads a block off scanned compiles (1 and 2 blocks a step), an odd one
    # off unrolled shallow compiles (2 and 4 deep).
    # Each program compiles once here (training_cost and the test ask for the same ones).
    monkeypatch.setattr(reports, "plan_training", _plan_training)
    if platform == "tpu":
        k, devices = dataclasses.replace(TPU_KNOBS, layers=depth), _v5p_2x2x1()[:2]
    else:
        k, devices = dataclasses.replace(KNOBS, layers=depth), np.array(jax.devices()[:2])
    if depth % 2 == 0:
        k = dataclasses.replace(k, remat="full")
    flops, bytes_ = reports.training_cost(k, devices, hbm=95)
    acc = lambda **kw: reports.plan_training(
        dataclasses.replace(k, **kw), devices, hbm=95, apply=False
    )[0]
    whole, scanned = acc(scan_layers=False), acc()
    assert flops == pytest.approx(whole["flops"], rel=0.01)
    assert scanned["flops"] < 0.6 * whole["flops"]
    if depth % 2:
        assert bytes_ == pytest.approx(whole["bytes_accessed"], rel=0.05)
        return
    # The bytes are the scanned loop's (it slices the stacked weights and stacks the
    # residuals: ~30% more than the unrolled program's at this tiny shape): a block's cost
    # read off 1 and 2 a step predicts the compile with 3 a step.
    two = acc(scan_unroll=2)
    three = acc(scan_unroll=3)
    for key in ("flops", "bytes_accessed"):
        predicted = scanned[key] + 2 * (two[key] - scanned[key])
        assert three[key] == pytest.approx(predicted, rel=0.05), key
    assert bytes_ == pytest.approx(
        scanned["bytes_accessed"] + 5 * (two["bytes_accessed"] - scanned["bytes_accessed"])
    )


def test_the_search_keeps_the_cheapest_fitting_knobs_and_the_fastest_plan(monkeypatch):
    # The compiles stand in as reports: what is searched and chosen, not what compiles.
    def report(name, need, flops, bytes_):
        return {"executable": name, "fits": need <= 95, "need_gib": need, "flops": flops,
                "bytes_accessed": bytes_}  # fmt: skip

    tried = []

    def training(k, devices, hbm, apply=True):
        per_replica = k.rows // (4 // k.tp)  # 4 training devices
        tried.append(("train", k.tp, per_replica, k.remat))
        need = {"dots_attention": 300, "minimal": 120, "full": 40}[k.remat] * per_replica
        return [report("accumulate", need, 1e12, 1e10), report("apply", 8, 0, 1e10)]

    def generation(k, devices, hbm):
        tried.append(("gen", k.instance_tp, k.slots))
        need = 10 + k.slots * 1.5 / k.instance_tp
        return [report("prefill", 20, 1e12, 1e10), report("decode_chunk", need, 1e10, 1e10)]

    monkeypatch.setattr(reports, "plan_training", training)
    monkeypatch.setattr(reports, "plan_generation", generation)
    monkeypatch.setattr(reports, "training_cost", lambda k, d, h, scanned=None: (1e13, 1e11))
    space = {"train_devices": 4, "tps": [1, 2, 3], "remats": ["dots_attention", "minimal", "full"],
             "rows_per_replica": [1, 2], "instance_tps": [1, 2], "slots": [128, 64, 32],
             "global_batch": 32, "granularity": 1, "algorithm": "grpo"}  # fmt: skip
    base = dataclasses.replace(KNOBS, max_len=1024, max_prompt=128)
    chips = np.array([types.SimpleNamespace(platform="tpu") for _ in range(8)])
    got = search.search(base, chips, 95, "tpu_v5p", space)
    # TP 3 does not divide 4 training devices; the remat ladder stops at the first fit
    # (each rows option its own: 2 rows a replica fit with `full` only, 80 GiB); the slot
    # ladder too (64 slots of TP 1 need 106 GiB, 32 need 58; TP 2: 128 need 106)
    assert [t for t in tried if t[0] == "train"] == [
        ("train", tp, rpr, r) for tp in (1, 2) for rpr in (1, 2)
        for r in ("dots_attention", "minimal", "full")
    ]  # fmt: skip
    assert [t for t in tried if t[0] == "gen"] == [
        ("gen", 1, 128), ("gen", 1, 64), ("gen", 1, 32), ("gen", 2, 128), ("gen", 2, 64)
    ]  # fmt: skip
    assert len(got["plans"]) == 8 and got["fits"]
    assert {p["train"]["rows"] for p in got["plans"]} == {4, 8, 2}  # TP 1: 4, 8; TP 2: 2, 4
    assert {p["train"]["remat"] for p in got["plans"]} == {"full"}
    assert got["chosen"]["step_s"] == min(p["step_s"] for p in got["plans"])
    assert all(p["async_over_colocated"] > 0 and p["scales"] for p in got["plans"])
    # Colocated, the trainer's state shares the chips: at most the compiled slots.
    assert all(1 <= p["colocated_slots"] <= p["generation"]["slots"] for p in got["plans"])


def _v6e_search(monkeypatch, model, chips, train_gib, gen_gib, **space):
    """`search.search` on `chips` v6e chips with stand-in compile reports (training
    accumulate and apply, generation prefill and decode chunk, GiB) and PPO's space."""

    def report(name, need):
        return {"executable": name, "fits": True, "need_gib": need, "flops": 1e12,
                "bytes_accessed": 1e10}  # fmt: skip

    monkeypatch.setattr(reports, "plan_training", lambda k, d, h, apply=True: [
        report("accumulate", train_gib[0]), report("apply", train_gib[1])])  # fmt: skip
    monkeypatch.setattr(reports, "plan_generation", lambda k, d, h: [
        report("prefill", gen_gib[0]), report("decode_chunk", gen_gib[1])])  # fmt: skip
    monkeypatch.setattr(reports, "training_cost", lambda k, d, h, scanned=None: (1e13, 1e11))
    space = {"remats": ["full"], "rows_per_replica": [1], "algorithm": "ppo", **space}
    base = programs.Knobs(model=model, seq=10752, max_len=10752, max_prompt=512)
    devices = np.array([types.SimpleNamespace(platform="tpu") for _ in range(chips)])
    return search.search(base, devices, 31.25, "tpu_v6e", space)


def test_colocated_runs_with_the_slots_left_beside_the_trainer_state(monkeypatch):
    # Qwen2.5-7B on 32 v6e chips (32 GB): a TP 1 instance that compiles with 24 slots
    # holds 14 when PPO's training state shares its chip (the simulator's count), and the
    # plan is still simulated, colocated with those 14, not refused.
    got = _v6e_search(monkeypatch, "qwen2.5_7b_shape", 32, (14, 7), (24, 24),
                      train_devices=16, tps=[4], instance_tps=[1], slots=[24],
                      global_batch=64, granularity=4)  # fmt: skip
    (plan,) = got["plans"]
    assert plan["generation"]["slots"] == 24 and plan["colocated_slots"] == 14


def test_a_compile_that_holds_more_slots_than_the_simulators_count_is_simulated(monkeypatch):
    # Qwen2.5-72B on 128 v6e chips: a TP 8 instance compiles with 32 slots of 10,752
    # positions (30.27 GiB of 32); the simulator's KV count holds 31. The plan runs with
    # 31 (the fewer), not refused; colocated, the weights beside PPO's training state
    # exceed the chips: reported as such (None), the plan kept.
    got = _v6e_search(monkeypatch, "qwen2.5_72b_shape", 128, (27.4, 17.1), (30.27, 30.23),
                      train_devices=64, tps=[8], instance_tps=[8], slots=[32],
                      global_batch=128, granularity=8, train_cost="roofline")  # fmt: skip
    (plan,) = got["plans"]
    assert plan["generation"]["slots"] == 32 and plan["slots"] == 31 and plan["step_s"] > 0
    assert plan["colocated_step_s"] is plan["colocated_slots"] is None
    assert plan["async_over_colocated"] is None
