import pytest

from asyncrlhf.config import load_config
from asyncrlhf.models import load_tokenizer
from asyncrlhf.rewards import Item
from asyncrlhf.rewards.openrlhf import QueryReader

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def reader():
    cfg = load_config(["configs/tiny.yaml"])
    return QueryReader(load_tokenizer(cfg.model), cfg.model)


def test_a_templated_query_with_special_tokens_becomes_the_pipeline_item(reader):
    # tiny's template: <s>{role}\n{content}</s>\n ... <s>assistant\n; EOS is </s>, padding <pad>
    query = "<s>user\nHow was it?</s>\n<s>assistant\nGreat film</s><pad><pad>"
    assert reader.item(query) == Item("How was it?", "Great film", True, None, None)
    assert reader.item(query, prompt="<s>user\nHow was it?</s>\n<s>assistant\n", label="x") == Item(
        "How was it?", "Great film", True, None, "x")


def test_the_system_prompt_of_the_run_is_part_of_the_template():
    cfg = load_config(["configs/tiny.yaml"], ["model.system_prompt=be kind"])
    reader = QueryReader(load_tokenizer(cfg.model), cfg.model)
    query = "<s>system\nbe kind</s>\n<s>user\nHi</s>\n<s>assistant\nHello</s>"
    assert reader.item(query) == Item("Hi", "Hello")


@pytest.mark.parametrize("query", ["plain text, no template", "<s>user\nno generation prompt</s>",
                                   "junk before <s>user\nHi</s>\n<s>assistant\nHello"])
def test_a_query_that_does_not_follow_the_template_is_scored_as_sent_less_special_tokens(reader, query):
    item = reader.item(query)
    assert item.prompt == "" and item.completion == query.replace("<s>", "").replace("</s>", "")
