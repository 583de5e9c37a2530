import pytest

from asyncrlhf.rewards import RULES, RuleScorer, ScorerConfigError, ScorerError

pytestmark = pytest.mark.unit


def test_sentiment_is_vader_compound_of_the_completion_only():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    vader = SentimentIntensityAnalyzer()
    completions = ["I love this, it is wonderful!", "This is terrible and awful.", "The table has four legs."]
    result = RuleScorer("sentiment").score(["I hate everything"] * 3, completions)
    assert result.scores == [vader.polarity_scores(c)["compound"] for c in completions]
    assert result.scores[0] > 0.5 and result.scores[1] < -0.5 and result.scores[2] == 0.0


def test_length_penalty_counts_words_or_chars_beyond_the_target():
    scorer = RuleScorer("length_penalty", {"target": 3, "coef": 0.5})
    # words: 2 -> 0; 3 -> 0; 5 -> -0.5 * (5 - 3) = -1.0
    assert scorer.score(["p"] * 3, ["a b", "a b c", "a b c d e"]).scores == [0.0, 0.0, -1.0]
    chars = RuleScorer("length_penalty", {"target": 4, "coef": 0.25, "unit": "chars"})
    # "abcdefgh": 8 chars -> -0.25 * 4 = -1.0
    assert chars.score(["p"], ["abcdefgh"]).scores == [-1.0]


def test_regex_match_searches_or_fully_matches():
    search = RuleScorer("regex_match", {"pattern": r"\d+"})
    assert search.score(["p"] * 2, ["it is 42.", "no digits"]).scores == [1.0, 0.0]
    full = RuleScorer("regex_match", {"pattern": r"\d+", "fullmatch": True})
    assert full.score(["p"] * 2, [" 42 ", "it is 42"]).scores == [1.0, 0.0]


def test_exact_match_reference_from_label_then_answers_then_answer():
    scorer = RuleScorer("exact_match", {"answers": {"2+2?": "4"}, "answer": "7", "extract": r"answer: (\S+)"})
    prompts = ["2+2?", "3+4?", "1+1?", "2+2?"]
    completions = ["so the answer: 4", "the answer: 7", "the answer: 2", "no answer here"]
    # "2+2?" -> answers map "4" (match); "3+4?" -> fallback answer "7" (match);
    # "1+1?" -> label "2" (match); last: nothing extracted -> 0
    labels = ["", "", "2", ""]
    assert scorer.score(prompts, completions, labels).scores == [1.0, 1.0, 1.0, 0.0]
    plain = RuleScorer("exact_match")  # no reference at all -> 0
    assert plain.score(["q"], ["Paris"], ["paris"]).scores == [1.0]
    assert plain.score(["q"], ["Paris"]).scores == [0.0]
    strict = RuleScorer("exact_match", {"case_sensitive": True})
    assert strict.score(["q"], ["Paris"], ["paris"]).scores == [0.0]


def test_file_rule_loads_and_may_return_components_or_tensors(tmp_path):
    file = tmp_path / "my_rewards.py"
    file.write_text(
        "import torch\n"
        "def reward_fn(prompts, completions, bonus=0.0):\n"
        "    return [len(c) + bonus for c in completions]\n"
        "def as_tensor(prompts, completions):\n"
        "    return torch.tensor([1.5] * len(completions))\n"
        "def with_logs(prompts, completions, labels=None):\n"
        "    refs = labels or [None] * len(completions)\n"
        "    hits = [1.0 if r and r in c else 0.0 for c, r in zip(completions, refs)]\n"
        "    lengths = [float(len(c)) for c in completions]\n"
        "    return {'rewards': hits, 'extra_logs': {'hit': hits, 'n': lengths}}\n"
    )
    assert RuleScorer(f"{file}:reward_fn", {"bonus": 0.5}).score(["p", "p"], ["ab", "abcd"]).scores == [
        2.5,
        4.5,
    ]
    assert RuleScorer(f"{file}:as_tensor").score(["p"], ["x"]).scores == [1.5]
    result = RuleScorer(f"{file}:with_logs").score(["p", "p"], ["yes 4", "no"], ["4", "4"])
    assert result.scores == [1.0, 0.0]
    assert result.components == {"hit": [1.0, 0.0], "n": [5.0, 2.0]}


def test_bad_rules_fail_with_what_to_do(tmp_path):
    with pytest.raises(ScorerConfigError, match="did you mean `sentiment`"):
        RuleScorer("sentimnet")
    with pytest.raises(ScorerConfigError, match="does not exist"):
        RuleScorer(f"{tmp_path}/missing.py:fn")
    (tmp_path / "r.py").write_text("def good(p, c):\n    return [0.0] * len(c)\n")
    with pytest.raises(ScorerConfigError, match="no function `bad`; it defines: good"):
        RuleScorer(f"{tmp_path}/r.py:bad")
    with pytest.raises(ScorerConfigError, match="does not accept args"):
        RuleScorer("regex_match")  # `pattern` is required
    with pytest.raises(ScorerConfigError, match="does not accept args"):
        RuleScorer(f"{tmp_path}/r.py:good", {"oops": 1})


def test_rule_outputs_are_checked(tmp_path):
    (tmp_path / "r.py").write_text(
        "def short(p, c):\n    return [0.0]\n"
        "def nan(p, c):\n    return [float('nan')] * len(c)\n"
        "def boom(p, c):\n    raise KeyError('reference')\n"
    )
    with pytest.raises(ScorerError, match="returned 1 scores for 2"):
        RuleScorer(f"{tmp_path}/r.py:short").score(["p", "p"], ["a", "b"])
    with pytest.raises(ScorerError, match="non-finite"):
        RuleScorer(f"{tmp_path}/r.py:nan").score(["p"], ["a"])
    with pytest.raises(ScorerError, match="raised KeyError"):
        RuleScorer(f"{tmp_path}/r.py:boom").score(["p"], ["a"])


def test_registry_ships_the_documented_rules():
    assert {"sentiment", "length_penalty", "length_band", "regex_match", "exact_match"} <= set(RULES)
    assert RuleScorer("sentiment").score(["p"], [""]).scores == [0.0]


def test_length_band_ramps_to_the_requested_band_and_strict_is_in_or_out():
    one = "In one sentence, what is tea?"  # band 5-30 words
    detailed = "Describe tea in detail, in several paragraphs with examples."  # band 90-150 words
    prompts = [one, one, one, one, one, detailed, detailed]
    completions = [" ".join(["w"] * n) for n in (2, 5, 30, 45, 70, 60, 150)]
    # one sentence: 2 -> 2/5 = 0.4; 5 and 30 -> 1.0 (inside); 45 -> 1 - (45 - 30)/30 = 0.5;
    # 70 -> 1 - 40/30 < 0 -> 0.0; detailed: 60 -> 60/90 = 0.666..; 150 -> 1.0
    soft = RuleScorer("length_band").score(prompts, completions).scores
    assert soft == pytest.approx([0.4, 1.0, 1.0, 0.5, 0.0, 2 / 3, 1.0])
    strict = RuleScorer("length_band", {"strict": True}).score(prompts, completions).scores
    assert strict == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_length_band_refuses_a_prompt_that_asks_for_no_length():
    with pytest.raises(ScorerError, match="task.name: varlen"):
        RuleScorer("length_band").score(["Write a short review of tea."], ["Nice tea."])
