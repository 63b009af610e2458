"""Final-answer extraction from free model text.

The prompt asks for `<answer>...</answer>`; small models often do something
else, so the extractor falls back in a fixed order and reports whether the
requested format was used:

1. the last closed `<answer>...</answer>` with non-empty content (format_ok);
2. the content after a final unclosed `<answer>` (a truncated response);
3. the last `\\boxed{...}` (nested braces matched);
4. the last "answer is X" / "answer: X" (rest of that line);
5. the last number in the text.

The candidate is then cleaned (surrounding whitespace, `$`, `**`, a `\\boxed{}`
wrapper, a trailing full stop, thousands separators of a plain number). No
input raises: anything that is not a non-empty string yields `(None, False)`.

`same_answer` compares an extracted answer with a reference answer (user
datasets, `rewards.jsonl`): equal after cleaning both, or equal as numbers.
"""

import decimal
import re

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, braces matched; None if unclosed or absent."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for pos in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[begin:pos]
    return None


def clean_answer(candidate: str) -> str | None:
    """Strips decoration around an answer; None if nothing is left."""
    answer = candidate.strip()
    boxed = _last_boxed(answer)
    if boxed is not None and answer.startswith(_BOXED):
        answer = boxed.strip()
    for _ in range(3):  # "**$x$.**" needs several rounds
        answer = answer.strip().strip("*").strip("$").strip()
        if answer.endswith(".") and not answer.endswith(".."):
            answer = answer[:-1]
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer or None


def extract_answer(text: object) -> tuple[str | None, bool]:
    """Extracts the final answer from a model response.

    Args:
      text: the decoded response (anything else yields no answer).

    Returns:
      `(answer, format_ok)`: the cleaned answer or None, and whether it came
      from a closed `<answer>` tag.
    """
    if not isinstance(text, str) or not text.strip():
        return None, False
    tagged = [clean_answer(m) for m in _ANSWER_TAG.findall(text)]
    tagged = [a for a in tagged if a is not None]
    if tagged:
        return tagged[-1], True
    opened = list(_OPEN_TAG.finditer(text))
    tail = text[opened[-1].end() :] if opened else ""
    if "</answer>" not in tail.lower() and (answer := clean_answer(tail)) is not None:
        return answer, False
    boxed = _last_boxed(text)
    if boxed is not None and (answer := clean_answer(boxed)) is not None:
        return answer, False
    said = _ANSWER_IS.findall(text)
    if said and (answer := clean_answer(said[-1])) is not None:
        return answer, False
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", ""), False
    return None, False


def same_answer(answer: str | None, reference: str) -> bool:
    """Whether an extracted answer matches a reference answer.

    Both sides are cleaned (`clean_answer`); they match when the cleaned
    strings are equal (case and inner spacing count) or both are plain numbers
    of the same value (`"42"`, `"42.0"`, `"4.2e1"`, `"+42"`). Never raises.
    """
    if not isinstance(answer, str) or not isinstance(reference, str):
        return False
    got, want = clean_answer(answer), clean_answer(reference)
    if got is None or want is None:
        return False
    if got == want:
        return True
    if _PLAIN_NUMBER.fullmatch(got) and _PLAIN_NUMBER.fullmatch(want):
        return decimal.Decimal(got) == decimal.Decimal(want)
    return False
