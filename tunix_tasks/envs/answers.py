"""Final answers of question-answer environments: owns how the answer is read from a turn
(the ``<answer>`` tag convention) and the built-in ways of matching it to a reference.

    extract_answer("<think>2+2</think><answer> 4 </answer>")   # "4"
    extract_answer("4\n")                                       # "4" (no tag: the whole content)
    last_number_text("9 - 7 = 2.")                              # "2"
    numeric_match("So she has $1,234.50 left.", "#### 1234.5")  # 1.0
    exact_match(" Paris ", "Paris"), contains_match("It is Paris.", "paris")  # 1.0, 1.0

``reasoning_gym`` and ``dataset`` read answers the same way: the last
``<answer>...</answer>`` span when there is one (reasoning-gym's own ``extract_answer``
convention, so a chat model may reason first), otherwise the whole content, stripped
(what the character presets' ``<|answer|>`` turn carries). ``ANSWER_INSTRUCTION`` is the
line their prompts end with to say so.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "ANSWER_INSTRUCTION",
    "contains_match",
    "exact_match",
    "extract_answer",
    "last_number",
    "last_number_text",
    "numeric_match",
]

ANSWER_INSTRUCTION = "Reply with the final answer only, or put it in <answer></answer>."
# reasoning-gym's regex (reasoning_gym.utils.extract_answer): one optional space inside
# the tags, the span may cross lines; the last span wins.
_TAGGED = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# A decimal with optional thousands separators (12, 3.5, 1,234.50, .5), negative after a
# minus that is not a hyphen or an operator between operands ("2024-05" is not -5).
_NUMBER = re.compile(r"(?:(?<![\w).])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+")
_SPACES = re.compile(r"\s+")


def extract_answer(content: str) -> str:
    """The answer in ``content``: the last ``<answer>`` span, else the whole, stripped."""
    spans = _TAGGED.findall(content)
    return (spans[-1] if spans else content).strip()


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234.5`` -> 1234.5); None when there is none."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def last_number_text(text: str) -> str:
    """The last number in ``text`` as written, without thousands separators
    (``"9 - 7 = 2."`` -> ``"2"``); ``text`` stripped when it has none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else text.strip()


def exact_match(answer: str, reference: str) -> float:
    """1.0 when equal once whitespace runs are collapsed and the ends stripped, else 0."""
    return float(_SPACES.sub(" ", answer).strip() == _SPACES.sub(" ", reference).strip())


def contains_match(answer: str, reference: str) -> float:
    """1.0 when the (stripped) reference occurs in the answer, ignoring case, else 0."""
    return float(reference.strip().casefold() in answer.casefold())


def numeric_match(answer: str, reference: str, tolerance: float = 1e-6) -> float:
    """1.0 when the last numbers of the two agree within ``tolerance`` (absolute, or
    relative to the larger for large numbers: ``math.isclose``), else 0 (also when the
    answer has no number)."""
    got, want = last_number(answer), last_number(reference)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=tolerance, abs_tol=tolerance))
