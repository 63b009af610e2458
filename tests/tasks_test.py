"""reasoning-gym tasks: answer extraction, scoring per task, disjoint seeds."""

import functools

import pytest

from streamrl_jax.rewards import answers, tasks

# countdown generates ~0.1 s per problem, so its sets stay small.
SIZES = {"basic_arithmetic": 200, "chain_sum": 200, "countdown": 12, "gsm_symbolic": 200}


@functools.cache
def _dataset(name: str, seed: int = 0, size: int = 4) -> tasks.TaskDataset:
    return tasks.TaskDataset(name, seed=seed, size=size)


def _wrong(problem: tasks.Problem) -> str:
    if problem.task == "countdown":
        return "1 + 1"
    return str(int(float(problem.answer)) + 1)


@pytest.mark.parametrize(
    "text,want",
    [
        ("<answer> 42 </answer>", ("42", True)),
        ("<answer>1</answer> no, <answer>**-7.**</answer>", ("-7", True)),
        ("<answer>\\boxed{5}</answer>", ("5", True)),
        ("so \\boxed{\\frac{1}{2}} done", ("\\frac{1}{2}", False)),
        ("The final answer is: $1,234$.", ("1234", False)),
        ("Answer: 94*4 - 61 - 6", ("94*4 - 61 - 6", False)),
        ("I counted 3, then 17 apples", ("17", False)),
        ("<answer>94*4 - 61 - 6", ("94*4 - 61 - 6", False)),  # truncated
        ("<answer></answer> maybe", (None, False)),
        ("no digits here", (None, False)),
        ("   ", (None, False)),
        ("", (None, False)),
        (None, (None, False)),
    ],
)
def test_extract_answer(text, want):
    assert answers.extract_answer(text) == want


@pytest.mark.parametrize("name", tasks.DEFAULT_TASKS)
def test_scoring_correct_wrong_malformed_empty(name):
    ds = _dataset(name)
    reward = ds.reward_fn(format_bonus=0.1)
    default_reward = tasks.TaskReward(format_bonus=0.1)  # scorer looked up by task name
    for problem in ds:
        for fn in (reward, default_reward):
            good = fn(f"Let me think.\n<answer>{problem.answer}</answer>", problem.metadata)
            assert (good.correct, good.format_ok, good.score) == (True, True, 1.1)
            assert good.extracted_answer == problem.answer
            loose = fn(f"The answer is {problem.answer}", problem.metadata)
            assert (loose.correct, loose.format_ok, loose.score) == (True, False, 1.0)
            bad = fn(f"<answer>{_wrong(problem)}</answer>", problem.metadata)
            assert (bad.correct, bad.score) == (False, pytest.approx(0.1))
            for junk in ("", "I have no idea.", "<answer></answer>", None):
                result = fn(junk, problem.metadata)
                assert (result.score, result.correct, result.extracted_answer) == (0, False, None)


def test_partial_credit_uses_task_score():
    problem = _dataset("countdown")[0]
    result = tasks.TaskReward(partial_credit=True)("<answer>1 + 1</answer>", problem.metadata)
    assert not result.correct
    assert result.score == result.task_score
    assert 0.0 < result.score < 1.0  # countdown's own partial score for a wrong expression


@pytest.mark.parametrize("name", tasks.DEFAULT_TASKS)
def test_train_and_eval_seeds_are_disjoint(name):
    size = SIZES[name]
    train, evaluation = _dataset(name, 0, size), _dataset(name, 1, size)
    assert len(train.questions()) > size // 2  # the sets are not degenerate
    assert not train.questions() & evaluation.questions()


def test_exclude_questions_guarantees_disjointness():
    """A tiny problem space repeats questions across seeds; exclusion removes them."""
    make = functools.partial(
        tasks.TaskDataset,
        "basic_arithmetic",
        task_configs={"basic_arithmetic": {"max_terms": 2, "max_digits": 1}},
    )
    evaluation = make(seed=1, size=500)
    plain = make(seed=0, size=200)
    train = make(seed=0, size=200, exclude_questions=evaluation.questions())
    overlap = plain.questions() & evaluation.questions()
    assert overlap  # without exclusion the splits share questions
    assert len(train) == sum(p.question not in overlap for p in plain)
    assert not train.questions() & evaluation.questions()
    assert {p.prompt_id for p in train} <= {p.prompt_id for p in plain}


def test_same_seed_is_deterministic_with_stable_ids():
    a, b = (tasks.TaskDataset("chain_sum", seed=3, size=20) for _ in range(2))
    assert [(p.prompt_id, p.question) for p in a] == [(p.prompt_id, p.question) for p in b]
    assert len({p.prompt_id for p in a}) == 20
    assert a[5].prompt_id == "chain_sum/3/5"


def test_mixture_draws_from_every_task_and_scores_each():
    ds = tasks.TaskDataset({"chain_sum": 1.0, "basic_arithmetic": 1.0}, seed=0, size=30)
    assert {p.task for p in ds} == {"chain_sum", "basic_arithmetic"}
    for fn in (ds.reward_fn(), tasks.TaskReward()):
        for p in ds:
            assert fn(f"<answer>{p.answer}</answer>", p.metadata).correct


def test_chat_messages_ask_for_answer_tags():
    messages = tasks.chat_messages(_dataset("chain_sum")[0].question)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<answer>" in messages[0]["content"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tasks": "chain_sum", "seed": 0, "size": 0},
        {"tasks": "chain_sum", "seed": -1, "size": 5},
        {"tasks": {"chain_sum": 0.0}, "seed": 0, "size": 5},
        {"tasks": "chain_sum", "seed": 0, "size": 5, "task_configs": {"countdown": {}}},
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        tasks.TaskDataset(kwargs.pop("tasks"), **kwargs)


def test_generator_failure_is_skipped_and_counted(monkeypatch):
    """reasoning-gym's basic_arithmetic raises ZeroDivisionError for some seeds."""
    real = tasks.reasoning_gym.create_dataset

    class Flaky:
        def __init__(self, inner):
            self.inner = inner
            self.score_answer = inner.score_answer

        def __getitem__(self, i):
            if i == 3:
                raise ZeroDivisionError("integer division or modulo by zero")
            return self.inner[i]

    monkeypatch.setattr(tasks.reasoning_gym, "create_dataset", lambda *a, **k: Flaky(real(*a, **k)))
    eager = tasks.TaskDataset(
        "basic_arithmetic", seed=5, size=8, exclude_questions={"not a question"}
    )
    assert len(eager) == 7 and eager.generation_errors == 1
    assert all(p.prompt_id != "basic_arithmetic/5/3" for p in eager)
    lazy = tasks.TaskDataset("basic_arithmetic", seed=5, size=8)
    assert lazy[3].prompt_id == "basic_arithmetic/5/4"  # the next item that generates
    assert lazy.generation_errors == 1
