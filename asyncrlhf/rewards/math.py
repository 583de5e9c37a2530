"""A verifiable math reward: extract the final answer of a completion and of the reference, compare them.

The final answer, first found: the last `\\boxed{...}` (braces balanced, as MATH-style models write it), the
last GSM8k `#### <answer>` line, the last "answer is <x>", else the last number in the text. Answers
compare as numbers when both parse (`1,000` == `1000.0`, `$10` == `10`, `\\frac{1}{2}` == `0.5` == `1/2`,
`25%` == `25`), else as normalised text (case, spaces, `$`, `\\text{}` and a trailing period ignored).
"""

from __future__ import annotations

import re
from fractions import Fraction

_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n]+?)\$?\s*(?:\.\s|\.?$)", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer(text: str) -> str | None:
    """A completion's (or a reference's) final answer as written, or None when it gives none."""
    found = boxed(text)
    if found is not None:
        return found
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches:
            return matches[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _clean(answer: str) -> str:
    answer = _TEXT.sub(r"\1", answer)
    answer = _FRAC.sub(r"(\1)/(\2)", answer)
    for old, new in (("\\$", ""), ("$", ""), ("\\%", "%"), ("\\!", ""), ("\\,", "")):
        answer = answer.replace(old, new)
    return answer.strip().rstrip(".").strip()


def as_number(answer: str) -> Fraction | None:
    """`answer` as an exact number, when it is one (thousands commas, a %, a fraction, units after it)."""
    text = _clean(answer).replace("(", "").replace(")", "").rstrip("%").strip()
    found = _NUMBER.fullmatch(text) or _NUMBER.match(text)
    if not found or (found.end() < len(text) and not text[found.end() :].strip().isalpha()):
        return None
    try:
        return Fraction(found.group(0).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(predicted: str, reference: str) -> bool:
    a, b = as_number(predicted), as_number(reference)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: re.sub(r"\s+", "", _clean(s)).lower()  # noqa: E731
    return norm(predicted) == norm(reference)


def math_score(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer equals the reference's (itself extracted when it is a full
    GSM8k solution ending in `#### x` or a boxed answer), else 0.0."""
    predicted = final_answer(completion)
    if predicted is None or not reference.strip():
        return 0.0
    ref = final_answer(reference) if ("####" in reference or "\\boxed" in reference) else reference
    return 1.0 if ref is not None and same_answer(predicted, ref) else 0.0
