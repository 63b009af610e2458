"""Every config file loads; bad configs fail at start-up naming the field."""

import dataclasses
import glob
import importlib.util
import os
import re
import typing

import ml_collections
import pytest

from streamrl_jax import algorithms
from streamrl_jax import config as config_lib
from streamrl_jax import pipeline as run_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
VARIANTS = {"quickstart.py": [None, "tiny", "sync", "short"], "length_replay.py": [None, "smollm2"]}


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_configs():
    assert any(p.endswith("quickstart.py") for p in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_and_variant_builds(path):
    module = _load(path)
    for variant in VARIANTS.get(os.path.basename(path), [None]):
        cfg = config_lib.from_config_dict(module.get_config(variant))
        assert cfg.pipeline.mode in config_lib.MODES


def test_one_process_needs_an_active_instance():
    # In one process scheduling.elastic_reserved counts instances (across processes,
    # generation processes: test_every_combination_rule_names_its_fields).
    cfg = config_lib.from_config_dict(_with(scheduling__elastic_reserved=1))
    with pytest.raises(config_lib.ConfigError, match="elastic_reserved=1 must leave at least one"):
        config_lib.check(cfg, config_lib.Processes.one())
    config_lib.check(
        config_lib.from_config_dict(
            _with(
                scheduling__elastic_reserved=1,
                mesh__instance_slots=(4, 4),
                mesh__generate_devices=2,
            )
        ),
        config_lib.Processes.one(),
    )
    with pytest.raises(config_lib.ConfigError, match="elastic_reserved=1 must leave"):
        run_lib.run(cfg, "/nonexistent")  # before any model load


_PARTIAL = {
    "pipeline__mode": "stream_async",
    "pipeline__rollout": "partial",
    "pipeline__partial_budget_tokens": 8,
    "pipeline__max_lag": 2,
}
_DYNAMIC = {"pipeline__rollout": "dynamic_sampling"}
_ONE = (1, 0)
# Every rule on which settings combine (config/rules.py `validate` and `check`): a refused
# combination, the process counts (total, generation) it is checked with, and what its
# one-line message must name: the fields and, across processes, the counts.
COMBINATIONS = {
    "dynamic sampling, groups of one": (
        {**_DYNAMIC, "pipeline__group_size": 1},
        _ONE,
        ["pipeline.rollout='dynamic_sampling'", "pipeline.group_size"],
    ),
    "dynamic sampling, mini-batches": (
        {**_DYNAMIC, "pipeline__mini_batches": 2},
        _ONE,
        ["pipeline.rollout='dynamic_sampling'", "pipeline.mini_batches"],
    ),
    "dynamic sampling, in-flight updates": (
        {**_DYNAMIC, "pipeline__mode": "stream_async", "pipeline__weight_update": "inflight"},
        _ONE,
        ["pipeline.rollout='dynamic_sampling'", "pipeline.weight_update"],
    ),
    "a partial budget without partial rollout": (
        {"pipeline__partial_budget_tokens": 8},
        _ONE,
        ["pipeline.partial_budget_tokens", "pipeline.rollout"],
    ),
    "partial rollout without a budget": (
        {**_PARTIAL, "pipeline__partial_budget_tokens": 0},
        _ONE,
        ["pipeline.partial_budget_tokens", "pipeline.rollout"],
    ),
    "overlong buffer": (
        {"algorithm__overlong_buffer": 999},
        _ONE,
        ["algorithm.overlong_buffer", "generation.max_new_tokens"],
    ),
    "group whitening, groups of one": (
        {"algorithm__advantage": "gae", "pipeline__group_size": 1},
        _ONE,
        ["critic.whiten", "pipeline.group_size"],
    ),
    "oracle dispatch": (
        {"scheduling__dispatch": "oracle"},
        _ONE,
        ["scheduling.dispatch", "generation.length_replay"],
    ),
    "no instance": ({"mesh__instance_slots": ()}, _ONE, ["mesh.instance_slots"]),
    "colocated instances": (
        {"pipeline__mode": "colocated", "mesh__instance_slots": (4, 4, 4)},
        _ONE,
        ["pipeline.mode", "mesh.generate_devices", "mesh.train_devices", "mesh.instance_slots"],
    ),
    "colocated train_tp": (
        {"pipeline__mode": "colocated", "mesh__train_tp": 3},
        _ONE,
        ["pipeline.mode", "mesh.train_tp", "mesh.generate_devices", "mesh.train_devices"],
    ),
    "train_tp": ({"mesh__train_tp": 2}, _ONE, ["mesh.train_tp", "mesh.train_devices"]),
    "instance_tp": (
        {"mesh__instance_tp": 2},
        _ONE,
        ["mesh.instance_tp", "mesh.generate_devices"],
    ),
    "instances of the generation devices": (
        {"mesh__instance_slots": (4, 4)},
        _ONE,
        ["mesh.instance_slots", "mesh.generate_devices", "mesh.instance_tp"],
    ),
    "elastic, one process": (
        {"scheduling__elastic_reserved": 1},
        _ONE,
        ["scheduling.elastic_reserved", "mesh.instance_slots"],
    ),
    "colocated across processes": (
        {"pipeline__mode": "colocated"},
        (2, 1),
        ["pipeline.mode", "2 processes, 1 generating and 1 training"],
    ),
    "training processes that do not split micro-batches": (
        {},
        (5, 2),
        [
            "pipeline.micro_batch_groups",
            "pipeline.prompts_per_step",
            "pipeline.mini_batches",
            "5 processes, 2 generating and 3 training",
        ],
    ),
    "elastic, no generation process left": (
        {"scheduling__elastic_reserved": 2},
        (4, 2),
        ["scheduling.elastic_reserved", "4 processes, 2 generating and 2 training"],
    ),
    "elastic, before joining": (
        {"scheduling__elastic_reserved": 1},
        (None, 1),
        ["scheduling.elastic_reserved", "several processes, 1 generating"],
    ),
}


@pytest.mark.parametrize("case", sorted(COMBINATIONS))
def test_every_combination_rule_names_its_fields(case):
    overrides, (total, generation), names = COMBINATIONS[case]
    processes = config_lib.Processes(total=total, generation=generation)
    with pytest.raises(config_lib.ConfigError) as refused:
        config_lib.check(config_lib.from_config_dict(_with(**overrides)), processes)
    message = str(refused.value)
    assert "\n" not in message
    assert all(name in message for name in names), message


@pytest.mark.parametrize(
    "overrides,total,generation",
    [
        ({}, 1, 0),
        ({"pipeline__mode": "colocated", "mesh__instance_slots": (4, 4)}, 1, 0),
        ({"pipeline__mode": "colocated", "mesh__train_tp": 2}, 1, 0),
        ({"mesh__train_devices": 2, "mesh__train_tp": 2}, 1, 0),
        ({"mesh__generate_devices": 2, "mesh__instance_tp": 2}, 1, 0),
        (_DYNAMIC, 1, 0),
        ({"pipeline__rollout": "curriculum+dynamic_sampling"}, 1, 0),
        ({**_PARTIAL, "checkpoint__every": 2}, 1, 0),  # one process checkpoints them
        (_PARTIAL, 2, 1),
        (_PARTIAL, None, 1),  # the total is checked once the processes have joined
        ({}, 4, 2),  # 2 training processes split micro-batches of 4 groups
        ({"scheduling__elastic_reserved": 1}, 3, 2),
        ({"scheduling__elastic_reserved": 1}, None, 2),
        ({"pipeline__mode": "stream_async", "pipeline__weight_update": "inflight"}, 2, 1),
        ({"checkpoint__every": 2}, 2, 1),
    ],
)
def test_combinations_that_work_pass_the_check(overrides, total, generation):
    cfg = config_lib.from_config_dict(_with(**overrides))
    processes = config_lib.Processes(total=total, generation=generation)
    assert config_lib.check(cfg, processes) is cfg


def test_training_split_is_the_ownership_rule():
    from streamrl_jax.pipeline.shards import Ownership

    for count, per_mini, micro in ((2, 8, 4), (2, 6, 4), (4, 8, 4), (1, 3, 2)):
        config_lib.check_training_split(count, per_mini, micro)
        Ownership(count, per_mini, micro)
    for count, per_mini, micro in ((3, 4, 2), (2, 3, 2), (2, 4, 3), (0, 4, 4)):
        with pytest.raises(config_lib.ConfigError, match="pipeline.micro_batch_groups"):
            config_lib.check_training_split(count, per_mini, micro)
        with pytest.raises(config_lib.ConfigError, match="pipeline.micro_batch_groups"):
            Ownership(count, per_mini, micro)


def test_process_counts_are_consistent():
    assert not config_lib.Processes.one().several
    assert config_lib.Processes(total=5, generation=2).training == 3
    assert config_lib.Processes(total=None, generation=2).training is None
    for total, generation in ((1, 1), (2, 2), (2, 0), (None, 0), (0, 0)):
        with pytest.raises(ValueError):
            config_lib.Processes(total=total, generation=generation)


def test_unknown_variant_is_an_error():
    module = _load(os.path.join(ROOT, "configs", "quickstart.py"))
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        module.get_config("nope")


def _with(**sections):
    cd = config_lib.defaults().to_dict()  # a plain dict: ConfigDict itself refuses type changes
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        cd[section][key] = value
    return cd


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"pipeline__staleness": 0}, "pipeline.staleness must be >= 1"),
        ({"pipeline__mode": "fast"}, "pipeline.mode='fast'"),
        ({"pipeline__min_groups": 99}, "pipeline.min_groups .99. exceeds"),
        ({"pipeline__mini_batches": 3}, "must be divisible by pipeline.mini_batches .3."),
        ({"pipeline__nonfinite": "ignore"}, "pipeline.nonfinite='ignore'; expected one of"),
        ({"pipeline__watchdog_s": 0.0}, "pipeline.watchdog_s must be > 0"),
        ({"data__reward_errors": "skip"}, "data.reward_errors='skip'"),
        ({"data__jsonl_path": "train.jsonl"}, "needs data.eval_jsonl_path"),
        ({"checkpoint__keep": 0}, "checkpoint.keep must be >= 1"),
        ({"checkpoint__every": -1}, "checkpoint.every must be >= 0"),
        ({"scheduling__dispatch": "lpt"}, "scheduling.dispatch='lpt'"),
        ({"generation__max_new_tokens": 10_000}, "exceeds model.max_context"),
        ({"generation__top_p": 0.0}, "generation.top_p"),
        ({"data__eval_seed": 1}, "data.train_seed must differ"),
        ({"pipeline__steps": "ten"}, "pipeline.steps must be int"),
        ({"mesh__instance_slots": (4, 0)}, "instance_slots must all be >= 1"),
        ({"data__task_config": "{nope"}, "data.task_config is not valid JSON"),
        ({"data__task_config": '{"countdown": {}}'}, "names .'countdown'., not in data.tasks"),
        ({"pipeline__weight_update": "eager"}, "pipeline.weight_update='eager'; expected one of"),
        (
            {"pipeline__weight_update": "inflight", "pipeline__mode": "stream_sync"},
            "pipeline.weight_update='inflight' needs pipeline.mode='stream_async'",
        ),
        (
            {
                "pipeline__weight_update": "inflight",
                "pipeline__mode": "stream_async",
                "pipeline__deterministic": True,
            },
            "'inflight' cannot be pipeline.deterministic",
        ),
        ({"pipeline__max_lag": -1}, "pipeline.max_lag must be >= 0"),
        ({"pipeline__max_lag": 2}, r"pipeline.max_lag \(2\) must be 0 \(= staleness\) or, in"),
        (
            {"pipeline__rollout": "partial", "pipeline__partial_budget_tokens": 8},
            "pipeline.partial_budget_tokens needs pipeline.mode='stream_async'",
        ),
        (
            {
                "pipeline__mode": "stream_async",
                "pipeline__rollout": "partial",
                "pipeline__partial_budget_tokens": 8,
            },
            r"needs pipeline.max_lag \(0\) > pipeline.staleness \(1\)",
        ),
        (
            {**_PARTIAL, "pipeline__mini_batches": 2},
            "partial_budget_tokens needs pipeline.mini_batches=1",
        ),
        (
            {
                **_PARTIAL,
                "pipeline__partial_budget_tokens": 4,
                "pipeline__lag_policy": "regenerate",
            },
            r"lag_policy='regenerate' needs .* = 8 >= generation.max_new_tokens",
        ),
        ({"pipeline__rollout": "replay"}, "pipeline.rollout='replay'; expected a kind of"),
        ({"pipeline__rollout": "full+curriculum"}, "pipeline.rollout='full.curriculum'; expected"),
        (
            {"pipeline__rollout": "curriculum+curriculum+full"},
            "pipeline.rollout='curriculum.curriculum.full'; expected",
        ),
        ({"pipeline__curriculum_floor": 0.0}, r"pipeline.curriculum_floor must be in \(0, 1\]"),
        ({"pipeline__curriculum_decay": 1.0}, r"pipeline.curriculum_decay must be in \(0, 1\)"),
        ({"pipeline__lag_policy": "keep"}, "pipeline.lag_policy='keep'; expected one of"),
        (
            {"pipeline__mode": "stream_async", "pipeline__staleness": 3, "pipeline__max_lag": 2},
            r"pipeline.max_lag \(2\) must be 0 .* >= pipeline.staleness \(3\)",
        ),
    ],
)
def test_impossible_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_lib.from_config_dict(_with(**overrides))


def test_unknown_keys_are_rejected():
    cd = config_lib.defaults().to_dict()
    cd["pipeline"]["stalenes"] = 2
    with pytest.raises(ValueError, match=r"unknown config key\(s\) pipeline.stalenes"):
        config_lib.from_config_dict(cd)
    cd = config_lib.defaults().to_dict()
    cd["learner"] = {}
    with pytest.raises(ValueError, match="unknown config key.*learner"):
        config_lib.from_config_dict(ml_collections.ConfigDict(cd))


def test_int_accepted_for_float_and_tuple_from_list():
    cd = config_lib.defaults().to_dict()
    cd["optimizer"]["learning_rate"] = 1
    cd["mesh"]["instance_slots"] = [4, 8]
    cd["mesh"]["generate_devices"] = 2  # one device an instance
    cfg = config_lib.from_config_dict(cd)
    assert cfg.optimizer.learning_rate == 1.0 and cfg.mesh.instance_slots == (4, 8)


def test_registry_names_equal_the_registries():
    # config/ imports no registry (it is the bottom layer); these keep the names in step.
    from streamrl_jax.generation import engine_config, quant
    from streamrl_jax.model import config as model_config
    from streamrl_jax.rewards import jsonl
    from streamrl_jax.scheduling import dispatch, live

    assert (*algorithms.ADVANTAGES, *algorithms.CRITIC_ADVANTAGES) == config_lib.ADVANTAGES
    assert tuple(algorithms.POLICY_LOSSES) == config_lib.POLICY_LOSSES
    assert tuple(algorithms.AGGREGATIONS) == config_lib.AGGREGATIONS
    assert tuple(algorithms.KL_ESTIMATORS) == config_lib.KL_ESTIMATORS
    assert set(config_lib.DTYPES) == set(model_config._DTYPES)
    assert set(config_lib.OBJECTIVES) == set(dispatch.OBJECTIVES)
    assert set(config_lib.PLANNERS) == set(dispatch.PLANNERS)
    assert set(config_lib.DISPATCHES) == set(live.DISPATCH)
    assert set(config_lib.BAD_ROWS) == set(jsonl.ON_BAD_ROW)
    assert config_lib.WEIGHT_DTYPES == quant.WEIGHT_DTYPES
    assert config_lib.CPU_DOTS == engine_config.CPU_DOTS
    from streamrl_jax import environments
    from streamrl_jax.environments import tool_calls

    assert ("", *environments.ENVIRONMENTS) == config_lib.ENVIRONMENTS
    assert config_lib.TOOL_FORMATS == tool_calls.TOOL_FORMATS


REGISTRY_FIELDS = [
    "pipeline.mode",
    "pipeline.nonfinite",
    "algorithm.advantage",
    "algorithm.policy_loss",
    "algorithm.aggregation",
    "algorithm.kl_estimator",
    "optimizer.schedule",
    "model.param_dtype",
    "model.dtype",
    "model.generate_dtype",
    "generation.weight_dtype",
    "generation.cpu_dots",
    "critic.whiten",
    "data.bad_rows",
    "data.overlong_prompts",
    "data.reward_errors",
    "data.reward",
    "data.reward_sandbox",
    "data.tasks",
    "scheduling.dispatch",
    "scheduling.objective",
    "scheduling.planner",
    "environment.name",
    "environment.tool_format",
]


@pytest.mark.parametrize("field", REGISTRY_FIELDS)
def test_a_wrong_registry_name_fails_naming_the_field(field):
    section, key = field.split(".")
    with pytest.raises(ValueError, match=re.escape(f"{field}='bogus'")):
        config_lib.from_config_dict(_with(**{f"{section}__{key}": "bogus"}))


def test_tasks_are_checked_against_reasoning_gym():
    with pytest.raises(ValueError, match="'chain_summ' is not a reasoning-gym task.*chain_sum"):
        config_lib.from_config_dict(_with(data__tasks="basic_arithmetic, chain_summ"))
    with pytest.raises(ValueError, match="data.tasks=' , ' names no task"):
        config_lib.from_config_dict(_with(data__tasks=" , "))
    cfg = config_lib.from_config_dict(_with(data__tasks="countdown,gsm_symbolic"))
    assert config_lib.task_names(cfg.data) == ["countdown", "gsm_symbolic"]
    # JSONL problems instead of tasks: `data.tasks` is not read, so not checked.
    config_lib.from_config_dict(
        _with(data__tasks="bogus", data__jsonl_path="a.jsonl", data__eval_jsonl_path="b.jsonl")
    )


# Text fields that name no registry: paths, prompts, JSON, comma-separated task names
# (checked against reasoning-gym by `_check_tasks`).
FREE_TEXT = {
    "init_from",
    "model.source",
    "data.tasks",
    "data.task_config",
    "data.system_prompt",
    "data.jsonl_path",
    "data.eval_jsonl_path",
    "scheduling.ranker_path",
    "scheduling.ptl_profile",
    "algorithm.distill_teacher",  # a checkpoint or model path, checked where it is loaded
    # checked where the environment is built (environments/openenv.py), naming the field
    "environment.openenv",
    "environment.openenv_kwargs",
    "environment.openenv_answer_tool",
    # checked where the judge is built (rewards/judge.py), naming the field
    "judge.model",
    "judge.rubric",
    "judge.template",
}


def test_every_numeric_and_registry_field_has_a_rule():
    top = typing.get_type_hints(config_lib.ExperimentConfig)
    sections = {"": config_lib.ExperimentConfig}
    sections |= {name: cls for name, cls in top.items() if dataclasses.is_dataclass(cls)}
    missing = []
    for prefix, cls in sections.items():
        for name, hint in typing.get_type_hints(cls).items():
            path = f"{prefix}.{name}" if prefix else name
            ruled = name in config_lib.RULES[cls] or path in FREE_TEXT
            if hint in (int, float, str) and not ruled:
                missing.append(path)
    assert len(sections) == 17 and not missing, missing


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"eval__num_problems": -3}, "eval.num_problems must be >= 0, got -3"),
        ({"eval__every": -1}, "eval.every must be >= 0"),
        ({"data__train_size": 0}, "data.train_size must be >= 1, got 0"),
        ({"data__train_seed": -1}, "data.train_seed must be >= 0"),
        ({"data__format_reward": -0.5}, "data.format_reward must be >= 0"),
        ({"optimizer__b1": 1.0}, r"optimizer.b1 must be in \[0, 1\), got 1.0"),
        ({"optimizer__b2": -0.1}, "optimizer.b2 must be in"),
        ({"optimizer__warmup_steps": -1}, "optimizer.warmup_steps must be >= 0"),
        ({"optimizer__weight_decay": -0.1}, "optimizer.weight_decay must be >= 0"),
        ({"optimizer__max_grad_norm": -1.0}, "optimizer.max_grad_norm must be >= 0"),
        ({"optimizer__learning_rate": 0.0}, "optimizer.learning_rate must be > 0"),
        ({"optimizer__min_lr_ratio": 1.5}, r"optimizer.min_lr_ratio must be in \[0, 1\]"),
        ({"optimizer__eps": 0.0}, "optimizer.eps must be > 0"),
        ({"algorithm__clip_eps": 0.0}, "algorithm.clip_eps must be > 0"),
        ({"algorithm__clip_eps_high": -0.1}, "algorithm.clip_eps_high must be > 0"),
        ({"algorithm__dual_clip": 0.5}, r"algorithm.dual_clip must be 0 \(off\) or > 1"),
        ({"algorithm__kl_coef": -0.1}, "algorithm.kl_coef must be >= 0"),
        ({"algorithm__entropy_coef": -0.1}, "algorithm.entropy_coef must be >= 0"),
        ({"algorithm__tis_cap": -1.0}, "algorithm.tis_cap must be >= 0"),
        ({"critic__learning_rate": 0.0}, "critic.learning_rate must be > 0"),
        ({"critic__value_clip": -0.1}, "critic.value_clip must be >= 0"),
        ({"critic__gamma": 1.5}, r"critic.gamma must be in \[0, 1\]"),
        ({"critic__lam": -0.1}, "critic.lam must be in"),
        ({"model__max_context": 0}, "model.max_context must be >= 1"),
        ({"mesh__generate_devices": 0}, "mesh.generate_devices must be >= 1"),
        ({"mesh__train_devices": 0}, "mesh.train_devices must be >= 1"),
        ({"mesh__train_tp": 0}, "mesh.train_tp must be >= 1"),
        ({"mesh__instance_tp": 0}, "mesh.instance_tp must be >= 1"),
        ({"generation__prefill_batch": 0}, "generation.prefill_batch must be >= 1"),
        ({"generation__temperature": -1.0}, "generation.temperature must be >= 0"),
        ({"scheduling__ranker_min_samples": 0}, "scheduling.ranker_min_samples must be >= 1"),
        ({"scheduling__elastic_reserved": -1}, "scheduling.elastic_reserved must be >= 0"),
        ({"pipeline__timeout_s": 0.0}, "pipeline.timeout_s must be > 0"),
        ({"trainer__row_tokens": -1}, "trainer.row_tokens must be >= 0"),
        ({"trainer__row_tokens": 100}, r"trainer.row_tokens \(100\) must be 0 \(auto\) or >= "),
        ({"trainer__shared_prompt": 1}, "trainer.shared_prompt must be bool"),
        ({"trainer__pack": "yes"}, "trainer.pack must be bool"),
        (
            {"optimizer__schedule": "cosine", "optimizer__warmup_steps": 10},
            r"optimizer.warmup_steps \(10\) must be below the run's optimizer steps",
        ),
    ],
)
def test_numeric_ranges_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_lib.from_config_dict(_with(**overrides))


def test_negative_seed_names_the_field():
    cd = config_lib.defaults().to_dict()
    cd["seed"] = -1
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        config_lib.from_config_dict(cd)


def test_zero_means_off_is_accepted():
    cfg = config_lib.from_config_dict(
        _with(
            algorithm__dual_clip=0.0,
            algorithm__tis_cap=0.0,
            optimizer__max_grad_norm=0.0,
            critic__value_clip=0.0,
            algorithm__advantage="gae",
        )
    )
    assert cfg.algorithm.advantage == "gae" and cfg.critic.value_clip == 0.0


def test_reward_sandbox_auto_isolates_scorers_that_evaluate_answers():
    from streamrl_jax.pipeline.datasets import reward_sandbox

    def sandbox(**overrides):
        return reward_sandbox(config_lib.from_config_dict(_with(**overrides)))

    assert sandbox(data__tasks="basic_arithmetic,chain_sum") is None  # compare strings only
    limits = sandbox(data__tasks="basic_arithmetic,countdown", data__reward_timeout_s=3.0)
    assert limits is not None and limits.timeout_s == 3.0  # countdown evals the answer
    assert sandbox(data__tasks="countdown", data__reward_sandbox="inline") is None
    assert sandbox(data__tasks="chain_sum", data__reward_sandbox="process") is not None


def test_int8_rollout_needs_tis_and_tis_needs_one_mini_batch():
    with pytest.raises(ValueError, match="generation.weight_dtype='bogus'; expected one of"):
        config_lib.from_config_dict(_with(generation__weight_dtype="bogus"))
    with pytest.raises(ValueError, match="weight_dtype='int8' needs algorithm.tis_cap > 0"):
        config_lib.from_config_dict(_with(generation__weight_dtype="int8"))
    with pytest.raises(ValueError, match="tis_cap > 0 needs pipeline.mini_batches=1"):
        config_lib.from_config_dict(
            _with(algorithm__tis_cap=2.0, pipeline__mini_batches=2, pipeline__prompts_per_step=8)
        )
    cfg = config_lib.from_config_dict(
        _with(generation__weight_dtype="int8", algorithm__tis_cap=2.0)
    )
    assert cfg.generation.weight_dtype == "int8"


@pytest.mark.parametrize("share", [True, False])
def test_generation_share_prefill_reaches_every_engine(share):
    from types import SimpleNamespace

    from streamrl_jax.pipeline.components import engine_config

    cfg = config_lib.from_config_dict(_with(generation__share_prefill=share))
    assert engine_config(cfg, SimpleNamespace(stop_ids=[2]), slots=4).share_prefill is share


def test_eval_at_start_off_skips_the_batch_zero_evaluation():
    from streamrl_jax.pipeline.hooks import generation_hooks

    class Source:
        def forget_below(self, batch):
            pass

    for at_start, want in ((True, [0, 5, 10]), (False, [5, 10])):
        cfg = config_lib.ExperimentConfig(
            eval=config_lib.EvalSection(every=5, num_problems=4, at_start=at_start)
        )
        ran = []
        hooks = generation_hooks(cfg, ran.append, Source())
        for b in range(11):
            hooks.run(b)
        assert ran == want
