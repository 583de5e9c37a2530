"""A policy and a reward model with different tokenizers (two tiny models built in code): the reward scorer
re-tokenises the text with the RM's own tokenizer; PPO's value model, which reads the policy's token ids,
refuses to start from such an RM."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy, load_score_model, load_tokenizer
from asyncrlhf.rewards.model import ModelScorer
from asyncrlhf.training.policies import value_source

pytestmark = pytest.mark.unit
WORDS = ["[PAD]", "[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "."]


@pytest.fixture(scope="module")
def word_rm(tmp_path_factory):
    """A reward model whose tokenizer splits on words (11 tokens), unlike the tiny byte-level policy."""
    path = tmp_path_factory.mktemp("word_rm")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, num_labels=1, pad_token_id=0))
    model.save_pretrained(path)
    return str(path)


def test_the_rm_scores_the_policy_s_text_through_its_own_tokenizer(word_rm):
    policy_tokenizer = load_tokenizer("tiny")
    completion_ids = policy_tokenizer(" sat on the mat .", add_special_tokens=False)["input_ids"]
    text = policy_tokenizer.decode(completion_ids)  # what the generator sends: text, not ids
    assert len(completion_ids) > len(text.split())  # the policy's tokens are not words
    result = ModelScorer(word_rm, device="cpu").score(["the cat"], [text])
    rm_ids = load_tokenizer(word_rm)("the cat" + text)["input_ids"]
    assert rm_ids == [2, 3, 4, 5, 2, 6, 10]  # the RM's own word ids
    with torch.no_grad():
        expected = load_score_model(word_rm).eval()(input_ids=torch.tensor([rm_ids])).logits[0, 0]
    assert result.scores == pytest.approx([float(expected)], abs=1e-6)


def test_ppo_value_init_from_an_rm_with_another_tokenizer_is_refused(word_rm):
    cfg = load_config(["configs/tiny.yaml"], ["learner.algorithm=ppo", "learner.ppo.value_init=reward_model",
                                              f"reward.scorers=[{{kind: model, path: {word_rm}}}]"])
    with pytest.raises(ValueError, match=r"another tokenizer than the policy tiny.*11 and \d+ tokens"):
        value_source(cfg)


def test_ppo_value_init_from_an_rm_with_the_same_tokenizer_is_allowed(tmp_path):
    load_policy("tiny").save_pretrained(tmp_path)
    load_tokenizer("tiny").save_pretrained(tmp_path)
    cfg = load_config(["configs/tiny.yaml"], ["learner.algorithm=ppo", "learner.ppo.value_init=reward_model",
                                              f"reward.scorers=[{{kind: model, path: {tmp_path}}}]"])
    assert value_source(cfg).name_or_path == str(tmp_path)
