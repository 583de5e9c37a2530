"""`generator.vllm`: defaults, keys that moved into it, and what vLLM cannot serve, refused at load."""

import pytest

from asyncrlhf.config import ConfigError, VLLMConfig, load_config

pytestmark = pytest.mark.unit


def test_defaults_follow_the_device_and_the_learner():
    v = VLLMConfig()
    assert v.enforce_eager is None and v.dtype == "auto" and v.cache_root is None
    assert v.kv_cache_gib >= 1 and 0 < v.gpu_memory_utilization <= 1


@pytest.mark.parametrize("old,new", [("gpu_memory_utilization=0.5", "generator.vllm.gpu_memory_utilization"),
                                     ("vllm_dtype=float32", "generator.vllm.dtype"),
                                     ("max_model_len=128", "generator.vllm.max_model_len")])
def test_a_flat_vllm_key_of_before_names_its_new_place(old, new):
    with pytest.raises(ConfigError, match=f"now `{new}`"):
        load_config([], [f"generator.{old}"])


def test_a_lora_rank_vllm_cannot_serve_is_refused_with_the_ranks_it_accepts():
    with pytest.raises(ConfigError, match=r"learner.lora.r=4.*1, 8, 16, 32, 64"):
        load_config([], ["generator.backend=vllm", "learner.lora.enabled=true", "learner.lora.r=4",
                         "generator.device=cuda"])
    assert load_config([], ["generator.backend=hf", "learner.lora.enabled=true", "learner.lora.r=4"])
    assert load_config([], ["generator.backend=vllm", "learner.lora.enabled=true", "learner.lora.r=8"])
    # folded into the weights, the adapter never meets vLLM's LoRA kernels: any rank
    assert load_config([], ["generator.backend=vllm", "learner.lora.enabled=true", "learner.lora.r=4",
                            "generator.vllm.merge_lora=true"])
    assert load_config([], ["generator.backend=vllm", "learner.lora.enabled=true", "learner.lora.r=4",
                            "generator.device=cpu"])


def test_a_tiny_head_size_the_cpu_kernels_lack_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"head size .* = 16\).*model.tiny.heads=2"):
        load_config(["configs/tiny.yaml"], ["generator.backend=vllm"])
    assert load_config(["configs/tiny.yaml"], ["generator.backend=vllm", "model.tiny.heads=2"])


def test_auto_picks_vllm_on_a_gpu_where_it_can_serve_the_run_and_hf_with_the_reason_elsewhere(monkeypatch):
    import importlib.util

    cpu = load_config(["configs/demo.yaml"], ["generator.backend=auto", "generator.device=cpu"])
    assert cpu.generator.backend == "hf" and "on CPU" in cpu.generator.auto_reason
    real = importlib.util.find_spec

    def vllm_installed(yes: bool) -> None:
        found = object() if yes else None
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: found if name == "vllm" else real(name, *a))

    vllm_installed(True)
    gpu = load_config(["configs/demo.yaml"], ["generator.backend=auto", "generator.device=cuda"])
    assert gpu.generator.backend == "vllm" and gpu.generator.auto_reason.startswith("auto: vLLM is installed")
    tiny = load_config(["configs/tiny.yaml"], ["generator.backend=auto", "generator.device=cuda"])
    assert tiny.generator.backend == "hf" and "head size" in tiny.generator.auto_reason
    vllm_installed(False)
    without = load_config(["configs/demo.yaml"], ["generator.backend=auto", "generator.device=cuda"])
    assert without.generator.backend == "hf" and "not installed" in without.generator.auto_reason
    assert load_config(["configs/demo.yaml"], ["generator.backend=hf"]).generator.auto_reason is None
