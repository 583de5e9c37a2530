"""The vLLM backend: what runs anywhere (lazy import, names of pushable tensors), and on a GPU with vLLM."""

import importlib.util
import sys

import pytest
import torch

from asyncrlhf.config import LoraConfig, load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.vllm import (
    import_vllm,
    model_dir_for_vllm,
    peft_adapter_names,
    weight_skeleton,
)
from asyncrlhf.weights.codec import adapter_tensors
from tests.unit.generator.peaked import peaked_state_dict, perturbed_state_dict

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_gpu_and_vllm = pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()),
                                        reason="needs vllm (pip install 'asyncrlhf[vllm]') and a CUDA GPU")


@pytest.mark.unit
def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(ImportError, match=r"asyncrlhf\[vllm\]"):
        import_vllm()


@pytest.mark.unit
@pytest.mark.parametrize("lora_enabled", [False, True])
def test_skeleton_names_and_shapes_match_the_learners_model(tmp_path, lora_enabled):
    cfg = load_config(["configs/tiny.yaml"], [f"model.cache_dir={tmp_path}"])
    lora = LoraConfig(enabled=lora_enabled, r=4)
    skeleton = weight_skeleton(model_dir_for_vllm(cfg.model), torch.float32, lora)
    learner = load_policy(cfg.model, lora=lora).state_dict()
    expected = adapter_tensors(learner) if lora_enabled else learner
    shapes = lambda tensors: {n: tuple(t.shape) for n, t in tensors.items()}  # noqa: E731
    assert shapes(skeleton) == shapes(expected)
    assert all(t.is_meta for t in skeleton.values())


@pytest.mark.unit
def test_adapter_names_drop_the_peft_adapter_name():
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    names = peft_adapter_names({f"{prefix}.lora_A.default.weight": torch.ones(1)})
    assert list(names) == [f"{prefix}.lora_A.weight"]


@pytest.mark.gpu
@needs_gpu_and_vllm
def test_vllm_backend_logprobs_and_weight_pushes(tmp_path):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = load_config(["configs/tiny.yaml"], [
        f"model.cache_dir={tmp_path}", "generator.backend=vllm", "generator.vllm_dtype=float32",
        "generator.gpu_memory_utilization=0.3"])
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    reference = load_policy(cfg.model).eval()
    weights = perturbed_state_dict(reference, seed=11)
    reference.load_state_dict(weights)
    backend.apply_weights(weights, version=1)
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt"], cfg.model)
    for prompt, group in zip(prompts, backend.generate(prompts, 3, cfg.generator.sampling), strict=True):
        assert len(group) == 3
        for c in group:
            full = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = reference(input_ids=full).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)
    a = tokenizer("a", add_special_tokens=False)["input_ids"][0]
    backend.apply_weights(peaked_state_dict(reference, a), version=2)
    (group,) = backend.generate(prompts[:1], 2, cfg.generator.sampling)
    assert backend.version == 2
    assert [c.token_ids for c in group] == [[a] * cfg.generator.sampling.max_new_tokens] * 2
