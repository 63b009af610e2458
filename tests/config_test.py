"""Every config file loads; bad configs fail at start-up naming the field."""

import glob
import importlib.util
import os

import ml_collections
import pytest

from streamrl_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
VARIANTS = {"quickstart.py": [None, "tiny", "sync"], "length_replay.py": [None, "smollm2"]}


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
        ({"scheduling__elastic_reserved": 1}, "elastic_reserved=1 must leave at least one"),
        ({"generation__max_new_tokens": 10_000}, "exceeds model.max_context"),
        ({"generation__top_p": 0.0}, "generation.top_p"),
        ({"data__eval_seed": 1}, "data.train_seed must differ"),
        ({"pipeline__steps": "ten"}, "pipeline.steps must be int"),
        ({"mesh__instance_slots": (4, 0)}, "instance_slots must all be >= 1"),
        ({"data__task_config": "{nope"}, "data.task_config is not valid JSON"),
        ({"data__task_config": '{"countdown": {}}'}, "names .'countdown'., not in data.tasks"),
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
    cd["trainer"] = {}
    with pytest.raises(ValueError, match="unknown config key.*trainer"):
        config_lib.from_config_dict(ml_collections.ConfigDict(cd))


def test_int_accepted_for_float_and_tuple_from_list():
    cd = config_lib.defaults().to_dict()
    cd["optimizer"]["learning_rate"] = 1
    cd["mesh"]["instance_slots"] = [4, 8]
    cfg = config_lib.from_config_dict(cd)
    assert cfg.optimizer.learning_rate == 1.0 and cfg.mesh.instance_slots == (4, 8)
