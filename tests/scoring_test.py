"""The judge and the scoring stage (rewards/judge.py, pipeline/scoring.py): verdicts from
score-token probabilities, the stage's order, bound and failures, a masked sample left out
of its group, and a run with a judge."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest
from support import group_of_scores, pack_small, scored_sample, sync_gate, tiny_config

from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib
from streamrl_jax.config import ConfigError, JudgeSection, PipelineSection, Processes
from streamrl_jax.errors import UserError
from streamrl_jax.generation import complete
from streamrl_jax.metrics import Tracer, read_jsonl
from streamrl_jax.model.loader import single_device_mesh
from streamrl_jax.pipeline.scoring import ScoringStage, item_of, judged
from streamrl_jax.pipeline.supervisor import Supervisor
from streamrl_jax.rewards import judge as judge_lib
from streamrl_jax.rewards.judge import Item, Judge, Verdict
from streamrl_jax.rewards.vowels import vowel_reward
from streamrl_jax.scheduling.sample_log import SampleLog

# ------------------------------------------------------------------ the judge


@pytest.fixture(scope="module")
def tiny_judge_parts():
    return judge_lib.load("tiny", single_device_mesh(), max_context=128)


def _judge(parts, **kw) -> Judge:
    graphdef, params, tokenizer, model_cfg = parts
    return Judge(graphdef, params, tokenizer, single_device_mesh(), model_cfg=model_cfg, **kw)


def test_a_verdict_is_the_normalised_expected_grade_or_unparsable(tiny_judge_parts):
    j = _judge(tiny_judge_parts, min_mass=0.2, scores=("1", "2", "3", "4", "5"))
    # p = (0.1, 0.1, 0.2): mass 0.4; grades 0, 1/2, 1 -> (0.1 * 0.5 + 0.2) / 0.4
    v = j._verdict(np.log(np.array([0.1, 0.1, 0.2, 1e-30, 1e-30])))
    assert v.failure is None
    assert v.mass == pytest.approx(0.4)
    assert v.score == pytest.approx((0.1 * 0.25 + 0.2 * 0.5) / 0.4)
    low = j._verdict(np.log(np.array([0.05, 0.05, 0.05, 0.01, 0.01])))
    assert low.score is None and low.failure.startswith("unparsable")


def test_the_judge_scores_a_batch_row_by_row(tiny_judge_parts):
    # A row's verdict depends on that row alone: not on the others in its forward, nor on
    # how many forwards (batch 2 against batch 8, several row lengths).
    items = [
        Item("What is 2 + 2?", "4"),
        Item("What is 7 - 3?", "The answer is <answer>4</answer> " * 12),
        Item("q", "x " * 40),
    ]
    wide = _judge(tiny_judge_parts, min_mass=0.0, batch=8, max_tokens=128)
    narrow = _judge(tiny_judge_parts, min_mass=0.0, batch=2, max_tokens=128)
    a, b = wide(items), narrow(items)
    alone = [wide([it])[0] for it in items]
    assert [v.score for v in a] == [v.score for v in b] == [v.score for v in alone]
    assert all(0.0 <= v.score <= 1.0 for v in a)
    assert len({v.score for v in a}) == 3  # the rows differ


def test_a_long_response_keeps_its_end(tiny_judge_parts):
    j = _judge(tiny_judge_parts, max_tokens=128)
    item = Item("q", "word " * 200 + "<answer>42</answer>")
    ids = j.tokens(item)
    assert len(ids) <= 128 and j.truncated == 1
    assert "<answer>42</answer>" in j.tokenizer.decode(ids)


def test_bad_judge_settings_are_named(tiny_judge_parts):
    with pytest.raises(UserError, match="exactly one token"):
        _judge(tiny_judge_parts, scores=("1", "excellent quality"))
    with pytest.raises(UserError, match="distinct"):
        _judge(tiny_judge_parts, scores=("1", "1"))
    with pytest.raises(UserError, match="judge.template"):
        _judge(tiny_judge_parts, template="{rubric} {verdict}")
    with pytest.raises(UserError, match="without its response is"):
        _judge(tiny_judge_parts, max_tokens=64).tokens(Item("q", "word " * 100))
    with pytest.raises(UserError, match="judge.model='/no/such/judge'"):
        judge_lib.load("/no/such/judge", single_device_mesh(), max_context=128)


def test_a_parsed_verdict_is_the_last_score_written_as_a_word():
    ten = tuple(str(k) for k in range(1, 11))
    pattern = judge_lib.score_pattern(ten)
    # the longest first ("10" is not read as "1"), the last one written
    assert judge_lib.parse_score("Score: 10", ten, pattern) == 9
    assert judge_lib.parse_score("1 step is wrong, so 7.", ten, pattern) == 6
    assert judge_lib.parse_score("between 3 and 4 -> 3", ten, pattern) == 2
    assert judge_lib.parse_score("x10 and 1000 and 2a", ten, pattern) is None  # whole words
    assert judge_lib.parse_score("no grade here", ten, pattern) is None
    yes_no = ("No", "Yes")
    pattern = judge_lib.score_pattern(yes_no)
    assert judge_lib.parse_score("yes, it does. YES", yes_no, pattern) == 1  # any case
    assert judge_lib.parse_score("Yesterday, Nobody", yes_no, pattern) is None
    cased = ("a", "A")  # two scores that differ only in case: read as written
    assert judge_lib.parse_score("A then a", cased, judge_lib.score_pattern(cased)) == 0


def test_a_parsed_judge_writes_with_the_engine_row_by_row(tiny_judge_parts):
    # judge.verdict="parsed": the judge's greedy answer is what `generation.complete`
    # decodes from the same prompt alone (the engine's prefill, KV cache and decode loop),
    # whatever shares its slots; the verdict reads the last score in it. (Weights x4, as
    # support.lively_model: at the init scale greedy decoding repeats one token.)
    graphdef, params, tokenizer, model_cfg = tiny_judge_parts
    params = jax.tree.map(lambda x: 4.0 * x, params)
    tiny_judge_parts = (graphdef, params, tokenizer, model_cfg)
    items = [Item("What is 2 + 2?", "4"), Item("q", "x " * 30), Item("What?", "Yes " * 5)]
    kw = dict(verdict="parsed", verdict_tokens=12, max_tokens=96)
    wide, narrow = _judge(tiny_judge_parts, batch=4, **kw), _judge(tiny_judge_parts, batch=1, **kw)
    want = [
        tokenizer.decode(t)
        for t in complete.generate(
            model_cfg, graphdef, params, [wide.tokens(it) for it in items], max_new_tokens=12,
            stop_ids=tokenizer.stop_ids,
        )
    ]  # fmt: skip
    got = wide(items)
    assert [v.text for v in got] == [v.text for v in narrow(items)] == want
    assert len(set(want)) == 3  # the rows differ
    for v in got:  # random weights write no grade: unparsable, never a score
        k = judge_lib.parse_score(v.text, wide.scores, judge_lib.score_pattern(wide.scores))
        assert (v.score is None) == (k is None)
    yes = wide._parsed("I think Yes.")
    assert (yes.score, yes.failure, yes.text) == (1.0, None, "I think Yes.") and np.isnan(yes.mass)
    bad = wide._parsed("maybe")
    assert bad.score is None and bad.failure.startswith("unparsable: no score")
    # parsed scores may be several tokens; the written verdict must fit the judge's context
    _judge(tiny_judge_parts, scores=("poor", "excellent quality"), **kw)
    with pytest.raises(UserError, match="exceeds the judge model's 128 positions"):
        _judge(tiny_judge_parts, verdict="parsed", verdict_tokens=64, max_tokens=96)


# ------------------------------------------------------------------ the stage


class FakeJudge:
    """Scores each item by its response's length / 10; records every call; optionally
    waits for `gate` or raises / fails certain responses."""

    def __init__(self, batch=4, gate=None, fail=(), raise_on=(), parallel=1):
        self.batch, self.gate, self.fail, self.raise_on = batch, gate, set(fail), set(raise_on)
        self.parallel = parallel
        self.calls: list[list[str]] = []

    def __call__(self, items):
        self.calls.append([it.response for it in items])
        if self.gate is not None:
            assert self.gate.wait(30)
        if any(it.response in self.raise_on for it in items):
            raise RuntimeError("judge down")
        return [
            Verdict(None, 0.0, "unparsable: test")
            if it.response in self.fail
            else Verdict(len(it.response) / 10, 1.0)
            for it in items
        ]


def _stage(judge, forward, log=None, **kw):
    cfg = JudgeSection(model="fake", **{"max_wait_s": 0.0, **kw})
    sup = Supervisor(PipelineSection())
    return ScoringStage(
        judge, cfg, forward, supervisor=sup, tracer=Tracer(False), timeout_s=5.0, log=log
    )


def _samples(texts):
    out = []
    for i, t in enumerate(texts):
        s = group_of_scores(0, i, [0.5])[0]
        out.append(type(s)(s.sample, t, s.reward))
    return out


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_stage_judges_each_sample_once_in_arrival_order():
    got, done = [], []
    judge = FakeJudge(batch=3)
    stage = _stage(judge, got.append, coef=2.0)
    texts = [f"t{'x' * i}" for i in range(10)]
    for i, s in enumerate(_samples(texts)):
        stage.put(s, lambda i=i: done.append(i))
    _wait(lambda: len(done) == 10)
    stage.close()
    assert [s.text for s in got] == texts
    assert sorted(done) == list(range(10))
    assert sorted(t for call in judge.calls for t in call) == sorted(texts)  # once each
    assert all(len(call) <= 3 for call in judge.calls)
    for s in got:  # rule 0.5 + coef * verdict
        assert s.reward.judge == pytest.approx(len(s.text) / 10)
        assert s.reward.score == pytest.approx(0.5 + 2.0 * len(s.text) / 10)
    row = stage.pop_row()
    assert row["judge/judged"] == 10 and row["judge/masked"] == 0


def test_a_judge_of_several_runs_forwards_side_by_side_and_hands_them_on_in_order():
    # A judge that runs 3 forwards at once (scoring processes): the stage starts three
    # before the first returns, and every sample still leaves in arrival order.
    gate = threading.Event()
    got = []
    judge = FakeJudge(batch=1, gate=gate, parallel=3)
    stage = _stage(judge, got.append)
    for s in _samples(["a", "b", "c", "d"]):
        stage.put(s)
    _wait(lambda: len(judge.calls) == 3)  # three forwards under way, none returned
    time.sleep(0.2)
    assert len(judge.calls) == 3 and not got and stage.waiting() == 4
    gate.set()
    _wait(lambda: len(got) == 4)
    stage.close()
    assert [s.text for s in got] == ["a", "b", "c", "d"]
    assert sorted(c[0] for c in judge.calls) == ["a", "b", "c", "d"]


def test_a_slow_judge_stalls_producers_only_at_the_bound():
    gate = threading.Event()
    got = []
    stage = _stage(FakeJudge(batch=1, gate=gate), got.append, queue=2)
    samples = _samples(["a", "b", "c", "d"])
    stage.put(samples[0])  # taken by the (held) forward
    _wait(lambda: stage.waiting() == 1 and not stage._queue)
    stage.put(samples[1])
    stage.put(samples[2])  # the queue is full now
    blocked = threading.Thread(target=stage.put, args=(samples[3],))
    blocked.start()
    time.sleep(0.3)
    assert blocked.is_alive() and stage.waiting() == 3
    gate.set()
    blocked.join(10)
    assert not blocked.is_alive()
    _wait(lambda: len(got) == 4)
    stage.close()
    assert [s.text for s in got] == ["a", "b", "c", "d"]


def test_a_full_stage_times_out_naming_itself():
    gate = threading.Event()
    stage = _stage(FakeJudge(batch=1, gate=gate), lambda s: None, queue=1)
    stage.timeout_s = 0.3
    samples = _samples(["a", "b", "c"])
    stage.put(samples[0])
    _wait(lambda: stage.waiting() == 1 and not stage._queue)
    stage.put(samples[1])
    with pytest.raises(TimeoutError, match="scoring stage"):
        stage.put(samples[2])
    gate.set()
    stage.close()


def test_failures_are_masked_and_counted_never_scored(tmp_path):
    got = []
    judge = FakeJudge(batch=2, fail={"bad"}, raise_on={"boom"})
    log = SampleLog(tmp_path / "judge.jsonl")
    stage = _stage(judge, got.append, log=log, max_failure_rate=1.0)
    for s in _samples(["ok", "bad", "boom", "fine"]):
        stage.put(s)
    _wait(lambda: len(got) == 4)
    # The verdict log: a line per judged sample, in the order judged, the failure named
    # and no reward for a masked one.
    stage.close()
    lines = read_jsonl(str(tmp_path / "judge.jsonl"))
    assert [(x["step"], x["group"], x["member"]) for x in lines] == [
        (s.sample.tag.batch, s.sample.tag.group, s.sample.tag.member) for s in got
    ]
    for line, s in zip(lines, got, strict=True):
        assert line["response"] == s.text and line["text"] is None
        if s.reward.masked is None:
            assert line["failure"] is None and line["verdict"] == pytest.approx(s.reward.judge)
            assert line["reward"] == pytest.approx(s.reward.score)
        else:
            assert line["failure"] == s.reward.masked and line["reward"] is None
    by_text = {s.text: s.reward for s in got}
    assert by_text["ok"].masked is None and by_text["ok"].judge == pytest.approx(0.2)
    assert by_text["bad"].masked.startswith("unparsable")
    # "boom" raised: its whole forward is masked (the forward it shared may be "bad"'s)
    assert by_text["boom"].masked.startswith("error")
    assert by_text["bad"].score == by_text["boom"].score == 0.5  # the rule score, untouched
    row = stage.pop_row()
    assert row["judge/masked"] >= 2 and row["judge/unparsable"] + row["judge/error"] >= 2


def test_a_judge_past_its_deadline_masks_its_samples():
    gate = threading.Event()
    got = []
    stage = _stage(FakeJudge(batch=2, gate=gate), got.append, timeout_s=0.2)
    for s in _samples(["a", "b"]):
        stage.put(s)
    _wait(lambda: len(got) == 2)
    assert all(s.reward.masked.startswith("timeout") for s in got)
    gate.set()
    stage.close()


def test_past_the_failure_rate_the_run_fails_naming_the_judge():
    got = []
    stage = _stage(FakeJudge(batch=4, fail={"bad"}), got.append, max_failure_rate=0.2)
    texts = ["bad" if i % 3 == 0 else f"ok{i}" for i in range(24)]
    for s in _samples(texts):
        try:
            stage.put(s)
        except Exception:  # the stage stopped taking samples once the run failed
            break
    _wait(lambda: stage.supervisor.latch.failed)
    with pytest.raises(Exception, match="judge failed on .* judge.max_failure_rate=0.2"):
        stage.supervisor.raise_if_failed()
    stage.close()


def test_blocking_mode_judges_in_the_callers_thread():
    got = []
    judge = FakeJudge(batch=1)
    stage = _stage(judge, got.append, mode="blocking")
    threads = []
    for s in _samples(["a", "bb"]):
        stage.put(s)  # returns only once judged and handed on
        threads.append(len(got))
    assert threads == [1, 2] and not stage._threads
    stage.close()


def test_the_rule_reward_can_be_weighed_or_left_out():
    s = group_of_scores(0, 0, [1.0])[0]
    assert judged(s, Verdict(0.25, 1.0), coef=2.0).reward.score == 1.5
    alone = judged(s, Verdict(0.25, 1.0), coef=2.0, rule_coef=0.0).reward
    assert alone.score == 0.5 and alone.judge == 0.25 and alone.correct  # the rule's record


def test_item_of_reads_the_tasks_question_and_answer():
    s = group_of_scores(0, 0, [1.0])[0]
    s.sample.metadata["entry"] = {"question": "What is 1 + 1?", "answer": "2"}
    assert item_of(s) == Item("What is 1 + 1?", "text", "2")


# ------------------------------------------------------------------ masking


def test_a_masked_sample_is_as_if_it_never_existed():
    full = [scored_sample(0, m, r, version=2, batch=2) for m, r in enumerate([1.0, 0.0, 1.0, 0.5])]
    masked = list(full)
    masked[1] = dataclasses.replace(
        full[1], reward=dataclasses.replace(full[1].reward, masked="timeout: test")
    )
    without = [full[0], full[2], full[3]]
    stats_a, stats_b = {}, {}
    for d in (stats_a, stats_b):
        d.update({k: [] for k in ("reward", "correct", "format_ok", "length", "truncated")})
        d["versions"] = []
    a = pack_small([masked], sync_gate(), stats_a)
    b = pack_small([without], sync_gate(), stats_b)
    for field in ("tokens", "advantages", "loss_mask", "rewards"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert stats_a == stats_b
    every = [dataclasses.replace(s, reward=dataclasses.replace(s.reward, masked="x")) for s in full]
    assert pack_small([every], sync_gate(), stats_a) is None


def test_a_tenant_judge_gives_the_scoring_meshs_verdicts(tiny_judge_parts):
    # judge.placement="generation" (pipeline/tenant.py): each generation instance holds
    # the judge and runs its forwards on its own thread, in turn; on instance meshes of
    # the scoring mesh's shape the verdicts are the same bits, probability and parsed.
    from support import CFG, ENGINE, lively_model

    from streamrl_jax import mesh as mesh_lib
    from streamrl_jax.generation.service import GenerationService
    from streamrl_jax.pipeline.tenant import TenantJudge

    graphdef, params, _ = lively_model((0, 1))
    meshes = mesh_lib.make_meshes(mesh_lib.MeshConfig(generate_devices=2, train_devices=1))
    instances = mesh_lib.instance_meshes(meshes.generate)
    items = [Item("What is 2 + 2?", "4"), Item("q", "x " * 30), Item("What?", "Yes " * 5)]
    lively = (tiny_judge_parts[0], jax.tree.map(lambda x: 4.0 * x, tiny_judge_parts[1]),
              *tiny_judge_parts[2:])  # fmt: skip
    parsed = dict(verdict="parsed", verdict_tokens=8, max_tokens=96)
    for parts, kw in ((tiny_judge_parts, dict(min_mass=0.0)), (lively, parsed)):
        on_mesh = _judge(parts, batch=2, **kw)
        tenant = TenantJudge(_judge(parts, batch=2, **kw), instances, timeout_s=60.0)
        with pytest.raises(RuntimeError, match="no generation service"):
            tenant(items)
        with GenerationService(graphdef, params, CFG, instances, ENGINE) as sgs:
            tenant.attach(sgs)
            got = [tenant(items), tenant(items)]  # instance 0, then instance 1
            assert [sgs.metrics()[i]["tenant_s"] > 0 for i in (0, 1)] == [True, True]
        want = on_mesh(items)
        for verdicts in got:
            assert [(v.score, v.text, v.failure) for v in verdicts] == [
                (v.score, v.text, v.failure) for v in want
            ]
            np.testing.assert_array_equal([v.mass for v in verdicts], [v.mass for v in want])
    one = GenerationService(graphdef, params, CFG, instances[:1], ENGINE)
    with one, pytest.raises(ValueError, match="2 judges for a service of 1 instances"):
        tenant.attach(one)


# ------------------------------------------------------------------ config and runs


def test_judge_settings_that_do_not_combine_are_refused():
    cfg = tiny_config(judge__model="tiny", pipeline__rollout="dynamic_sampling")
    config_lib.check(cfg, Processes.one())  # one process: the stage is ahead of the rollout
    config_lib.check(cfg, Processes(total=2, generation=1))  # the trainers judge the groups
    with pytest.raises(ConfigError, match="judge.mode"):
        config_lib.validate(tiny_config(judge__model="tiny", judge__mode="later"))
    # Scoring processes serve a judge, as a stage.
    three = Processes(total=3, generation=1, scoring=1)
    config_lib.check(tiny_config(judge__model="tiny"), three)
    with pytest.raises(ConfigError, match=r"need judge.model \(got ''\).*1 scoring"):
        config_lib.check(tiny_config(), three)
    with pytest.raises(ConfigError, match="judge.mode='stage' \\(got 'blocking'\\)"):
        config_lib.check(tiny_config(judge__model="tiny", judge__mode="blocking"), three)
    with pytest.raises(ValueError, match="generation \\+ scoring < total"):
        Processes(total=3, generation=2, scoring=1)
    with pytest.raises(ValueError, match="no generation or scoring processes"):
        Processes(total=1, generation=0, scoring=1)
    # The judge as the generation service's tenant: a stage, and no scoring processes.
    tenant = dict(judge__model="tiny", judge__placement="generation")
    config_lib.check(tiny_config(**tenant), Processes(total=2, generation=1))
    with pytest.raises(ConfigError, match="placement='generation' with judge.mode='blocking'"):
        config_lib.check(tiny_config(judge__mode="blocking", **tenant), Processes.one())
    with pytest.raises(ConfigError, match="1 scoring process.*placement='generation'"):
        config_lib.check(tiny_config(**tenant), three)
    with pytest.raises(ConfigError, match="judge.placement"):
        config_lib.validate(tiny_config(judge__model="tiny", judge__placement="trainer"))


def test_a_run_with_a_judge_adds_its_verdicts_and_reports_the_stage(tmp_path, monkeypatch):
    kw = dict(judge__model="tiny", judge__min_mass=0.0, judge__coef=0.5, pipeline__steps=2)
    cfg = tiny_config(log__final_params=True, **kw)
    run_lib.run(cfg, str(tmp_path), reward_fn=vowel_reward)
    rows = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if "reward" in r]
    assert len(rows) == 2
    judged = sum(r["judge/judged"] for r in rows)
    assert judged >= cfg.pipeline.prompts_per_step * cfg.pipeline.group_size
    assert all(r["judge/masked"] == 0 and r["judge/busy_s"] > 0 for r in rows if r["judge/judged"])
    assert 0 < rows[0]["judge/verdict"] < 1
    # Algorithm 1 over the three stages from each step's seconds (the judge on a device of
    # its own): a split of the run's 3 devices, never a slower step than the measured (a
    # step whose samples were all judged before it has no scoring seconds: no split).
    assert rows[0]["judge/busy_s"] > 0
    for r in [r for r in rows if r["judge/busy_s"] > 0]:
        got = [r[f"balance/{k}_devices"] for k in ("gen", "score", "train")]
        assert sum(got) <= 3 and min(got) >= 1, r
        assert r["balance/step_s"] <= r["balance/now_s"] * (1 + 1e-9)
    # judge.jsonl (log.judge): every judged sample's verdict once, with the reward trained
    # (the vowel reward + 0.5 x the verdict)
    lines = read_jsonl(str(tmp_path / "judge.jsonl"))
    assert len(lines) >= judged
    assert len({(x["step"], x["group"], x["member"]) for x in lines}) == len(lines)
    for x in lines:
        assert 0 <= x["verdict"] <= 1 and x["failure"] is None
        rule = vowel_reward(x["response"], {}).score
        assert x["reward"] == pytest.approx(rule + 0.5 * x["verdict"])
    # The judge as the generation service's tenant (judge.placement="generation": its
    # forwards on the instance's thread, pipeline/tenant.py), on an instance of the
    # scoring mesh's shape: the same verdicts, so the same parameters bit for bit.
    from streamrl_jax.pipeline.tenant import TenantJudge

    tenant, calls = tmp_path / "tenant", []
    real = TenantJudge.__call__
    monkeypatch.setattr(TenantJudge, "__call__", lambda j, items: calls.append(1) or real(j, items))
    cfg = tiny_config(log__final_params=True, judge__placement="generation", **kw)
    run_lib.run(cfg, str(tenant), reward_fn=vowel_reward)
    assert calls  # the tenant judged
    got = [r for r in read_jsonl(str(tenant / "metrics.jsonl")) if "reward" in r]
    assert sum(r["judge/judged"] for r in got) == judged
    verdicts = {(x["step"], x["group"], x["member"]): x["verdict"] for x in lines}
    assert {
        (x["step"], x["group"], x["member"]): x["verdict"]
        for x in read_jsonl(str(tenant / "judge.jsonl"))
    } == verdicts
    want = np.load(tmp_path / run_lib.FINAL_PARAMS)
    params = np.load(tenant / run_lib.FINAL_PARAMS)
    for name in want.files:
        np.testing.assert_array_equal(params[name], want[name], name)


def test_the_runs_judge_is_built_from_its_section():
    # components.make_judge: the model loaded with room for the written verdict, the
    # section's verdict kind, limits and scores (blocking: one sample at a time).
    from streamrl_jax.pipeline.components import make_judge

    cfg = tiny_config(
        judge__model="tiny", judge__verdict="parsed", judge__verdict_tokens=16,
        judge__max_tokens=96, judge__scores=("bad", "fine", "good"), judge__mode="blocking",
    )  # fmt: skip
    j = make_judge(cfg, single_device_mesh())
    assert (j.verdict, j.verdict_tokens, j.max_tokens, j.batch) == ("parsed", 16, 96, 1)
    assert j.scores == ("bad", "fine", "good")
    assert j._engine.cfg.max_total_length == 96 + 16
    (v,) = j([Item("q", "an answer")])
    assert v.text is not None and (v.score is None) == (v.failure is not None)
