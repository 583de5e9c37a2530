"""The judge's pieces that need no model: its template, how a reply becomes a value, its cache, and the
config errors a user can make (asyncrlhf.rewards.judge; the engines: tests/integration/reward/judge)."""

import math

import pytest

from asyncrlhf.config import JudgeConfig, load_config
from asyncrlhf.config.base import ConfigError
from asyncrlhf.rewards import ScorerConfigError
from asyncrlhf.rewards.judge.cache import VerdictCache, request_key
from asyncrlhf.rewards.judge.reply import Reply, ReplyReader, Unparsed, choice_share, first_json_object
from asyncrlhf.rewards.judge.template import JudgeTemplate

pytestmark = pytest.mark.unit


def judge(**kw) -> JudgeConfig:
    return JudgeConfig(**kw)


# -- the template -------------------------------------------------------------------------------------------

def test_a_jinja_template_sees_prompt_completion_and_reference():
    source = "Q: {{ prompt }}|A: {{ completion }}|{{ reference or '-' }}"
    t = JudgeTemplate.from_config(judge(template=source))
    assert t.render(prompt="2+2?", completion="4", reference="") == "Q: 2+2?|A: 4|-"


def test_a_format_template_from_a_file(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("{prompt} / {completion_a} vs {completion_b} ({reference})")
    t = JudgeTemplate.from_config(judge(template_path=str(path), template_format="format",
                                        compare="pairwise"))
    assert t.render(prompt="p", completion_a="x", completion_b="y", reference="r") == "p / x vs y (r)"


def test_the_shipped_templates_render_with_and_without_a_reference():
    single = JudgeTemplate.from_config(judge())
    assert "Reference answer" not in single.render(prompt="p", completion="c", reference="")
    assert "Reference answer: r" in single.render(prompt="p", completion="c", reference="r")
    pair = JudgeTemplate.from_config(judge(compare="pairwise"))
    text = pair.render(prompt="p", completion_a="x", completion_b="y", reference="")
    assert "Answer A: x\nAnswer B: y" in text


@pytest.mark.parametrize("kw, message", [
    (dict(template="{{ answer }}"), "not given"),
    (dict(template="{{ completion_a }}"), "not given"),  # a pairwise name in a single judge
    (dict(template="{answer}", template_format="format"), "can use {prompt}"),
    (dict(template="{{ prompt.__class__.__mro__ }}"), "not given"),  # the sandbox
    (dict(template="{% if %}"), "does not parse"),
    (dict(template_path="/nonexistent/judge.j2"), "does not exist"),
    (dict(template_format="format"), "shipped judge templates are Jinja"),
])
def test_a_template_that_cannot_render_fails_when_the_judge_is_built(kw, message):
    with pytest.raises(ScorerConfigError, match=message):
        JudgeTemplate.from_config(judge(**kw))


# -- the reply ----------------------------------------------------------------------------------------------

def test_logprob_is_the_first_choices_share_with_spellings_merged():
    # p(" Yes") = 0.5, p("yes") = 0.1 -> yes 0.6; p("No") = 0.2; "Maybe" is no choice: 0.6 / 0.8 = 0.75
    top = {" Yes": math.log(0.5), "yes": math.log(0.1), "No": math.log(0.2), "Maybe": math.log(0.2)}
    assert choice_share(top, ["yes", "no"]) == pytest.approx(0.75)
    assert ReplyReader(judge()).value(Reply("Yes", top)) == pytest.approx(0.75)
    with pytest.raises(Unparsed, match="none of"):
        choice_share({"Maybe": 0.0}, ["yes", "no"])


@pytest.mark.parametrize("kw, text, value", [
    (dict(reply="number"), "I give it 7/10.", 7.0),
    (dict(reply="number"), "score: -2.5e1", -25.0),
    (dict(reply="number", pattern=r"Score: (\d+)"), "Out of 3 tries. Score: 9", 9.0),
    (dict(reply="number", json_field="score"), 'Sure! {"score": 4, "why": "ok"} done', 4.0),
    (dict(reply="label"), "Yes, it is.", 1.0),
    (dict(reply="label"), "  NO", 0.0),
    (dict(reply="label", compare="pairwise"), "tie", 0.5),
    (dict(reply="label", labels={"good": 1, "bad": -1}, pattern=r"Verdict: (\w+)"), "Verdict: BAD", -1.0),
    (dict(reply="label", json_field="verdict", labels={"pass": 1, "fail": 0}), '{"verdict": "pass"}', 1.0),
])
def test_numbers_and_labels_parse(kw, text, value):
    assert ReplyReader(judge(**kw)).value(Reply(text)) == value


@pytest.mark.parametrize("kw, text", [
    (dict(reply="number"), "no idea"),
    (dict(reply="number", pattern=r"Score: (\d+)"), "Score: high"),
    (dict(reply="number", json_field="score"), '{"grade": 3}'),
    (dict(reply="number", json_field="score"), "{not json"),
    (dict(reply="number"), "1e999"),
    (dict(reply="label"), "Perhaps"),
    (dict(reply="label"), ""),
])
def test_a_malformed_reply_is_unparsed_not_an_error(kw, text):
    with pytest.raises(Unparsed):
        ReplyReader(judge(**kw)).value(Reply(text))


def test_first_json_object_skips_braces_that_are_not_json():
    assert first_json_object('{oops} then {"a": 1}') == {"a": 1}


def test_a_pattern_without_a_group_or_that_is_no_regex_fails_at_build():
    with pytest.raises(ScorerConfigError, match="needs a group"):
        ReplyReader(judge(reply="number", pattern=r"\d+"))
    with pytest.raises(ScorerConfigError, match="not a regex"):
        ReplyReader(judge(reply="number", pattern="(unclosed"))


# -- the cache ----------------------------------------------------------------------------------------------

def test_the_cache_keeps_the_most_recent_and_remembers_parse_failures():
    cache = VerdictCache(2)
    cache.put("a", 1.0)
    cache.put("b", None)  # a reply that did not parse is remembered too
    assert cache.get("a") == (True, 1.0)  # a is now the most recent
    cache.put("c", 0.5)
    assert cache.get("b") == (False, None) and cache.get("c") == (True, 0.5) and len(cache) == 2
    off = VerdictCache(0)
    off.put("a", 1.0)
    assert off.get("a") == (False, None)


def test_a_request_key_changes_with_the_model_the_reading_and_the_text():
    base = request_key("m", "logprob", "text")
    assert base == request_key("m", "logprob", "text")
    assert len({base, request_key("m2", "logprob", "text"), request_key("m", "number", "text"),
                request_key("m", "logprob", "text2")}) == 4


# -- the config ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("reward.scorers=[{kind: judge, template: a, template_path: b}]", "not both"),
    ("reward.scorers=[{kind: judge, choices: [Yes]}]", "at least two choices"),
    ("reward.scorers=[{kind: judge, pattern: 'a(b)', json_field: c}]", "not both"),
    ("reward.scorers=[{kind: judge, engine: {backend: tgi}}]", "engine.backend"),
    ("reward.scorers=[{kind: judge, endpont: {url: x}}]", "did you mean `reward.scorers[0].endpoint`"),
    ("evaluator.judge={compare: single}", "compare: pairwise"),
    ("evaluator.judge={bootstrap_samples: 10}", "bootstrap_samples"),
    ("evaluator.judge={engin: {}}", "did you mean `evaluator.judge.engine`"),  # an optional section's keys
])
def test_judge_config_errors_say_what_to_change(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(["configs/tiny.yaml"], [override])


def test_a_bare_yes_in_yaml_is_the_word_not_true():
    cfg = load_config(["configs/tiny.yaml"], ["reward.scorers=[{kind: judge, choices: [Yes, No], "
                                              "reply: label, labels: {Yes: 1, No: 0}}]"]).reward.scorers[0]
    assert cfg.choices == ["yes", "no"] and cfg.labels_or_default == {"yes": 1.0, "no": 0.0}


def test_an_endpoint_judge_needs_an_http_url_and_its_key_variable_set(monkeypatch):
    from asyncrlhf.rewards.judge.endpoint import EndpointEngine

    with pytest.raises(ScorerConfigError, match="http://"):
        EndpointEngine(judge(endpoint={"url": "judge:8000/v1"}))
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST", raising=False)
    with pytest.raises(ScorerConfigError, match=r"\$JUDGE_KEY_FOR_TEST, which is not set"):
        EndpointEngine(judge(endpoint={"url": "http://judge/v1", "api_key_env": "JUDGE_KEY_FOR_TEST"}))
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "k3y")
    engine = EndpointEngine(judge(endpoint={"url": "http://judge/v1", "api_key_env": "JUDGE_KEY_FOR_TEST"}))
    assert engine.client.headers["authorization"] == "Bearer k3y"
    engine.close()
