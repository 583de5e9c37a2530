"""The verifiable math reward on real GSM8k-style answers (the dataset's `#### x` solutions) and the
completions models write for them (boxed answers, "the answer is", a last number)."""

import pytest

from asyncrlhf.rewards.math import as_number, boxed, final_answer, math_score
from asyncrlhf.rewards.rules import resolve_rule

pytestmark = pytest.mark.unit

# GSM8k train, rows 0 and 1: the reference solutions as the dataset stores them.
NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
WENG = ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10")


def test_the_reference_answer_is_the_text_after_the_hashes():
    assert final_answer(NATALIA) == "72" and final_answer(WENG) == "10"


@pytest.mark.parametrize(("completion", "reference", "score"), [
    ("In May she sold 48/2 = 24. In total 48 + 24 = 72.\n#### 72", NATALIA, 1.0),
    ("48 + 24 = 72, so the answer is \\boxed{72}.", NATALIA, 1.0),
    ("She sold 24 in May, so 48 + 24 = 72 clips. The answer is 72.", NATALIA, 1.0),
    ("She sold 48 + 24 = 72 clips altogether.", "72", 1.0),  # the last number, against a bare label
    ("48 + 48/2 = 96, so \\boxed{96}", NATALIA, 0.0),  # wrong
    ("\\boxed{72} is wrong; actually it is 96", NATALIA, 1.0),  # a boxed answer wins over later numbers
    ("She earned $10.00.", WENG, 1.0),  # currency and decimals
    ("\\boxed{\\$10}", WENG, 1.0),
    ("#### 1,000", "1000", 1.0),  # thousands separators
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("So 25% of them.", "25", 1.0),
    ("\\boxed{\\text{Tuesday}}", "tuesday", 1.0),  # text answers compare normalised
    ("I do not know.", NATALIA, 0.0),  # no answer at all
    ("The answer is 72.", "", 0.0),  # no reference: never a reward
])
def test_math_score(completion, reference, score):
    assert math_score(completion, reference) == score


def test_boxed_handles_nested_braces_and_unclosed_boxes():
    assert boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert boxed("\\boxed{12") is None


def test_numbers_parse_exactly():
    assert as_number("1,234.50") == as_number("1234.5")
    assert as_number("\\frac{2}{4}") == as_number("1/2")
    assert as_number("72 clips") == 72  # units after the number
    assert as_number("x + 1") is None


def test_the_rule_reads_labels_then_answers():
    fn = resolve_rule("math_answer")
    assert fn(["p1", "p2"], ["\\boxed{72}", "#### 9"], labels=["72", "10"]) == [1.0, 0.0]
    assert fn(["p1"], ["#### 10"], answers={"p1": WENG}) == [1.0]
