import pytest
import torch

from asyncrlhf.config import LoraConfig, ModelConfig
from asyncrlhf.models import (
    ModelLoadError,
    ReferencePolicy,
    encode_prompts,
    load_policy,
    load_score_model,
    load_tokenizer,
    per_token_scores,
)

pytestmark = pytest.mark.unit


def test_tiny_is_deterministic_across_loads():
    a, b = load_policy("tiny"), load_policy("tiny")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_tiny_tokenizer_round_trips_any_text_and_has_chat_template():
    tok = load_tokenizer("tiny")
    text = "Héllo, wörld! 123 🙂"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    cfg = ModelConfig(name_or_path="tiny", max_prompt_tokens=8)
    (ids,) = encode_prompts(tok, ["a long prompt that will be cut"], cfg)
    assert len(ids) == 8  # left-truncated
    assert tok.decode(ids) == "sistant\n"  # the last 8 bytes: the generation prompt is kept, the start cut
    assert tok.padding_side == "left" and tok.pad_token_id == 0


def test_tiny_model_generates():
    tok, model = load_tokenizer("tiny"), load_policy("tiny")
    batch = tok(["hi", "a longer prompt"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape == (2, batch["input_ids"].shape[1] + 5) or out.shape[1] < batch["input_ids"].shape[1] + 5


def test_lora_reference_is_the_base_model():
    base = load_policy("tiny").eval()
    policy = load_policy("tiny", lora=LoraConfig(enabled=True, r=4, alpha=8)).eval()
    with torch.no_grad():  # make the adapter matter: peft starts lora_B at zero
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.fill_(0.05)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    reference = ReferencePolicy(policy)
    ref_logits = reference(input_ids=ids).logits
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        policy_logits = policy(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, base_logits)
    assert not torch.allclose(policy_logits, base_logits)


def test_frozen_reference_does_not_follow_training():
    policy = load_policy("tiny")
    reference = ReferencePolicy(policy)
    ids = torch.tensor([[5, 6, 7]])
    before = reference(input_ids=ids).logits
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1)
    torch.testing.assert_close(reference(input_ids=ids).logits, before)
    assert all(not p.requires_grad for p in reference._frozen.parameters())


def test_score_model_shares_the_backbone_and_gives_per_token_values():
    lm, scorer = load_policy("tiny"), load_score_model("tiny")
    torch.testing.assert_close(scorer.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    ids = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]])
    mask = (ids != 0).long()
    values = per_token_scores(scorer, ids, mask)
    assert values.shape == (2, 4)
    pooled = scorer(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(pooled, values[:, -1])  # left padding: the last position is the last token


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("/no/such/dir", "does not exist"),
        ("/no/such/file.gguf", "does not exist"),
        ("HuggingFaceTB/SmolLM2-135M", "hub downloads are off"),
    ],
)
def test_missing_models_fail_clearly(name, fragment):
    with pytest.raises(ModelLoadError, match=fragment):
        load_policy(name)


def test_directory_without_config_fails_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_tokenizer(str(tmp_path))


def test_saved_tiny_loads_back_as_hf_directory(tmp_path):
    model, tok = load_policy("tiny"), load_tokenizer("tiny")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = load_policy(str(tmp_path))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert load_tokenizer(str(tmp_path)).decode([40, 41]) == tok.decode([40, 41])
