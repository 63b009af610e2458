"""User JSONL problems: parsing, prompt ids, reward, and every bad-input error."""

import json
import logging
import re

import pytest

from streamrl_jax.data import PromptPipeline
from streamrl_jax.model.defaults import smollm2_gguf_path
from streamrl_jax.model.tokenizer import Tokenizer
from streamrl_jax.rewards import answers, jsonl

GOOD_ROWS = [
    {"question": "What is 6 * 7?", "answer": 42, "id": "mul"},
    {"question": "Capital of France?", "answer": "Paris", "task": "geo", "level": 2},
    {"question": "Half of 1?", "answer": 0.5},
]


def _write(tmp_path, lines, name="mine.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join(x if isinstance(x, bytes) else x.encode() + b"\n" for x in lines))
    return path


def _good(tmp_path, **kwargs):
    lines = [json.dumps(GOOD_ROWS[0]), "", json.dumps(GOOD_ROWS[1]), "  ", json.dumps(GOOD_ROWS[2])]
    return jsonl.JsonlDataset(_write(tmp_path, lines), **kwargs)


def test_good_file_round_trip(tmp_path):
    ds = _good(tmp_path)
    assert len(ds) == 3 and ds.skipped_rows == 0 and ds.name == "mine"
    # Blank lines are ignored but still counted in the line numbers of id-less rows.
    assert [p.prompt_id for p in ds] == ["mine/mul", "mine/3", "mine/5"]
    assert [p.question for p in ds] == [r["question"] for r in GOOD_ROWS]
    assert [p.answer for p in ds] == ["42", "Paris", "0.5"]
    assert [p.task for p in ds] == ["mine", "geo", "mine"]
    geo = ds[1]
    assert geo.metadata["task"] == "geo" and geo.metadata["prompt_id"] == "mine/3"
    entry = geo.metadata["entry"]
    assert (entry["question"], entry["answer"]) == ("Capital of France?", "Paris")
    assert entry["metadata"]["line"] == 3 and entry["metadata"]["extra"] == {"level": 2}
    assert ds[-1] == ds[2]
    assert ds.questions() == {r["question"] for r in GOOD_ROWS}


def test_name_and_exclusion(tmp_path):
    ds = _good(tmp_path, name="user", exclude_questions={"Capital of France?", "not there"})
    assert [p.prompt_id for p in ds] == ["user/mul", "user/5"]
    assert ds.excluded_rows == 1


def test_byte_order_mark_is_accepted(tmp_path):
    path = _write(tmp_path, [b"\xef\xbb\xbf" + json.dumps(GOOD_ROWS[0]).encode() + b"\n"])
    assert jsonl.JsonlDataset(path)[0].prompt_id == "mine/mul"


def test_reward_scores_correct_and_incorrect(tmp_path):
    ds = _good(tmp_path)
    reward = ds.reward_fn(format_bonus=0.1)
    mul, geo, half = ds
    good = reward(f"Let me think.\n<answer>{mul.answer}</answer>", mul.metadata)
    assert (good.correct, good.format_ok, good.score) == (True, True, 1.1)
    assert good.extracted_answer == "42" and good.task_score == 1.0
    loose = reward("6 times 7... The answer is 42.0", mul.metadata)  # numerically equal
    assert (loose.correct, loose.format_ok, loose.score) == (True, False, 1.0)
    bad = reward("<answer>43</answer>", mul.metadata)
    assert (bad.correct, bad.score) == (False, pytest.approx(0.1))
    assert reward("<answer>**Paris**</answer>", geo.metadata).correct
    assert not reward("<answer>Lyon</answer>", geo.metadata).correct
    assert reward("<answer>.50</answer>", half.metadata).correct
    for junk in ("", "I have no idea.", "<answer></answer>", None):
        result = reward(junk, mul.metadata)
        assert (result.score, result.correct, result.extracted_answer) == (0, False, None)


def test_reward_scores_another_split(tmp_path):
    """The pipeline scores eval problems with the train set's reward_fn."""
    train = _good(tmp_path)
    evaluation = jsonl.JsonlDataset(
        _write(tmp_path, ['{"question": "1 + 1?", "answer": "2"}'], name="eval.jsonl")
    )
    assert train.reward_fn()("<answer>2</answer>", evaluation[0].metadata).correct


@pytest.mark.parametrize(
    "answer,reference,want",
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("4.2e1", "42", True),
        ("1,000", "1000", True),
        ("$42$.", "42", True),
        ("Paris", "Paris", True),
        ("paris", "Paris", False),  # case counts
        ("41", "42", False),
        ("42 apples", "42", False),
        (None, "42", False),
    ],
)
def test_same_answer(answer, reference, want):
    assert answers.same_answer(answer, reference) is want


def test_prompt_pipeline_accepts_a_jsonl_dataset(tmp_path):
    ds = _good(tmp_path)
    pipe = PromptPipeline(ds, Tokenizer.from_gguf(smollm2_gguf_path()), max_prompt_len=512, seed=0)
    assert sorted(p.problem.prompt_id for p in pipe.next_prompts(3)) == sorted(
        p.prompt_id for p in ds
    )


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{path}: not found")):
        jsonl.JsonlDataset(path)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path}: is not a file")):
        jsonl.JsonlDataset(tmp_path)


@pytest.mark.parametrize("lines", [[], ["", "   "]])
def test_empty_file_names_the_path(tmp_path, lines):
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}: empty file")):
        jsonl.JsonlDataset(path)


GOOD_LINE = json.dumps(GOOD_ROWS[0])
BAD_ROWS = [
    ('{"question": "q", "answer": 1', "invalid JSON: Expecting ',' delimiter (column 30)"),
    ('["q", 1]', "expected a JSON object, got array"),
    ('"just text"', "expected a JSON object, got string"),
    ('{"answer": 1}', "missing 'question' (keys: ['answer'])"),
    ('{"question": "  ", "answer": 1}', "'question' is empty"),
    ('{"question": 7, "answer": 1}', "'question' must be a string, got number"),
    ('{"question": "q"}', "missing 'answer' (keys: ['question'])"),
    ('{"question": "q", "answer": [1]}', "'answer' must be a string or a number, got array"),
    ('{"question": "q", "answer": true}', "'answer' must be a string or a number, got boolean"),
    ('{"question": "q", "answer": null}', "'answer' must be a string or a number, got null"),
    ('{"question": "q", "answer": ""}', "'answer' is empty"),
    ('{"question": "q", "answer": NaN}', "'answer' must be finite, got nan"),
    ('{"question": "q", "answer": 1, "id": 3}', "'id' must be a non-empty string, got number 3"),
    ('{"question": "q", "answer": 1, "id": ""}', "'id' must be a non-empty string, got string ''"),
    ('{"question": "q", "answer": 1, "task": {}}', "'task' must be a non-empty string, got object"),
    (b'{"question": "caf\xe9", "answer": 1}\n', "not valid UTF-8 (invalid continuation byte"),
]


@pytest.mark.parametrize("line,message", BAD_ROWS)
def test_bad_row_error_names_line_and_problem(tmp_path, line, message):
    path = _write(tmp_path, [GOOD_LINE, "", line])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: {message}")):
        jsonl.JsonlDataset(path)


@pytest.mark.parametrize(
    "lines,message",
    [
        ([GOOD_LINE, GOOD_LINE], ":2: duplicate prompt id 'mine/mul' (first at line 1)"),
        # An explicit id may collide with the line number of an id-less row.
        (['{"question": "a", "answer": 1, "id": "2"}', '{"question": "b", "answer": 2}'], ":2:"),
    ],
)
@pytest.mark.parametrize("on_bad_row", jsonl.ON_BAD_ROW)
def test_duplicate_ids_always_raise(tmp_path, lines, message, on_bad_row):
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
        jsonl.JsonlDataset(path, on_bad_row=on_bad_row)


def test_skip_mode_counts_and_logs_bad_rows(tmp_path, caplog):
    bad = [line for line, _ in BAD_ROWS]
    path = _write(tmp_path, [GOOD_LINE, *bad, json.dumps(GOOD_ROWS[1])])
    with caplog.at_level(logging.WARNING):
        ds = jsonl.JsonlDataset(path, on_bad_row="skip")
    assert ds.skipped_rows == len(BAD_ROWS)
    assert [p.prompt_id for p in ds] == ["mine/mul", f"mine/{len(BAD_ROWS) + 2}"]
    (record,) = [r for r in caplog.records if "malformed" in r.getMessage()]
    warning = record.getMessage()
    assert f"skipped {len(BAD_ROWS)} malformed of {len(BAD_ROWS) + 2} rows" in warning
    assert "line 2 (invalid JSON" in warning and "line 6 (" in warning
    assert "line 7 (" not in warning and warning.endswith("; ...")  # only the first five


def test_skip_mode_without_usable_rows_raises(tmp_path):
    path = _write(tmp_path, ["not json", "[]"])
    with pytest.raises(ValueError, match=re.escape(f"{path}: no usable rows (2 rows: 2 malformed")):
        jsonl.JsonlDataset(path, on_bad_row="skip")
    with pytest.raises(ValueError, match="1 excluded"):
        jsonl.JsonlDataset(_write(tmp_path, [GOOD_LINE]), exclude_questions={"What is 6 * 7?"})


def test_bad_arguments_raise(tmp_path):
    path = _write(tmp_path, [GOOD_LINE])
    with pytest.raises(ValueError, match="on_bad_row='ignore'"):
        jsonl.JsonlDataset(path, on_bad_row="ignore")
    with pytest.raises(ValueError, match="name must be non-empty"):
        jsonl.JsonlDataset(path, name="")


def test_run_config_selects_jsonl_files(tmp_path):
    # data.jsonl_path / eval_jsonl_path replace the reasoning-gym tasks in a built run;
    # a malformed training row is an early error naming file and line (data.bad_rows).
    from support import tiny_config

    from streamrl_jax.pipeline import components as build_lib

    train = _write(
        tmp_path, [json.dumps({"question": f"{i}+1?", "answer": i + 1}) for i in range(6)]
    )
    evals = _write(tmp_path, [json.dumps({"question": "9+9?", "answer": 18})], name="ev.jsonl")
    c = build_lib.build(tiny_config(data__jsonl_path=str(train), data__eval_jsonl_path=str(evals)))
    assert len(c.prompts.dataset) == 6 and len(c.eval_prompts) == 1
    assert c.eval_prompts[0].problem.prompt_id == "ev/1"
    bad = _write(tmp_path, ['{"question": "1+1?", "answer": 2}', "{oops"], name="bad.jsonl")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2")):
        build_lib.build(tiny_config(data__jsonl_path=str(bad), data__eval_jsonl_path=str(evals)))


HOSTILE_ROWS = {
    "a 5,000-digit integer": ('{"question": "q", "answer": ' + "9" * 5000 + "}", "invalid JSON"),
    "nesting 100,000 deep": (
        '{"question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "nested too deeply",
    ),  # fmt: skip
    "a 2 MiB line": ('{"question": "' + "x" * (2 << 20) + '", "answer": 1}', "line longer than"),
    "an answer of a wrong type": ('{"question": "q", "answer": {"a": 1}}', "'answer' must be"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ROWS))
def test_hostile_rows_are_named_or_skipped(tmp_path, case):
    # Every kind of bad row is a clear error naming path:line, or skipped and counted.
    row, message = HOSTILE_ROWS[case]
    path = _write(tmp_path, [json.dumps(GOOD_ROWS[0]), row, json.dumps(GOOD_ROWS[1])])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        jsonl.JsonlDataset(path)
    data = jsonl.JsonlDataset(path, on_bad_row="skip")
    assert len(data) == 2 and data.skipped_rows == 1
    assert data[1].prompt_id.endswith("/3")  # the line after the bad one is read as itself
