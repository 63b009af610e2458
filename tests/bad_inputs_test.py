"""The bad-input corpus (tools/bench_bad_inputs.py): every case a clear error.

Configs, datasets, checkpoints and model files go through the real entry point
and must end with exit status 2 and one `error:` line naming the field or file,
without a traceback or a hang; hostile model output through the sandboxed
scorer must come back scored (or as a named timeout) and write nothing; hostile
or broken network peers must end in their named error and leak nothing.
"""

import importlib.util
import os
import sys

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_bad_inputs",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "bench_bad_inputs.py"),
)
corpus = sys.modules["bench_bad_inputs"] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(corpus)


def test_the_corpus_is_broad():
    kinds = {case.kind for case in corpus.CASES}
    assert len(corpus.CASES) >= 50 and kinds == {"launch", "reward", "network"}
    assert len({case.name for case in corpus.CASES}) == len(corpus.CASES)


@pytest.mark.parametrize("case", corpus.CASES, ids=lambda case: case.name)
def test_a_bad_input_is_a_clear_error(case):
    outcome, detail = corpus.run_case(case, timeout_s=120.0)
    assert outcome == "clear", detail
