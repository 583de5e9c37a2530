import pytest
import torch

from asyncrlhf.models import build_tiny_tokenizer, load_score_model
from asyncrlhf.rewards.model import ModelScorer

pytestmark = pytest.mark.unit

PROMPTS = ["Tell me about cats.", "Hi", "Write a poem about the sea and the sky."]
COMPLETIONS = [" Cats are small.", " Hello there, how are you today?", ""]


def direct_scores(texts, keep_last=None):
    """One unpadded forward pass per text: the reference the batched scorer must match."""
    model, tokenizer = load_score_model("tiny").eval(), build_tiny_tokenizer()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"][-keep_last if keep_last else None :]
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


def test_batched_padded_scores_equal_one_forward_pass_each():
    scorer = ModelScorer("tiny", batch_size=2, max_length=512, device="cpu")
    result = scorer.score(PROMPTS, COMPLETIONS)
    expected = direct_scores([p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    assert result.scores == pytest.approx(expected, abs=1e-5)
    assert result.truncated == 0
    assert len(set(round(s, 6) for s in result.scores)) == 3  # not a constant head


def test_long_inputs_keep_their_last_tokens_and_are_counted():
    scorer = ModelScorer("tiny", batch_size=4, max_length=16, device="cpu")
    prompts, completions = ["Hi", PROMPTS[0], PROMPTS[2]], [" yo", COMPLETIONS[0], COMPLETIONS[2]]
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    # byte-level tokenizer, one token per byte: 5, 35 and 39 tokens, so the last two exceed 16
    assert [len(t.encode()) for t in texts] == [5, 35, 39]
    result = scorer.score(prompts, completions)
    assert result.truncated == 2
    assert result.scores == pytest.approx(direct_scores(texts, keep_last=16), abs=1e-5)


def test_max_length_is_capped_by_the_model_positions():
    assert ModelScorer("tiny", max_length=100_000, device="cpu").max_length == 512
