"""The vLLM backend's parts that run anywhere: lazy import, engine settings, names of pushable tensors. The
engine itself: tests/integration/vllm (marker `vllm`)."""

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from asyncrlhf.config import LoraConfig, load_config
from asyncrlhf.models import load_policy
from asyncrlhf.sampling.hops import shared_memory
from asyncrlhf.sampling.hops.factory import shared_handoff
from asyncrlhf.sampling.vllm import import_vllm, peft_adapter_names, version_tuple
from asyncrlhf.sampling.vllm_engine import (
    engine_settings,
    lora_base_name,
    merged_weights,
    merges_lora,
    model_dir_for_vllm,
    pristine_targets,
    weight_skeleton,
)
from asyncrlhf.weights.codec import adapter_tensors

VLLM = ["generator.backend=vllm", "model.tiny.heads=2"]


@pytest.mark.unit
def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(ImportError, match=r"make vllm.*asyncrlhf\[vllm\]"):
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


@pytest.mark.unit
def test_cpu_engine_runs_eager_in_the_learners_dtype_with_a_kv_cache_in_gib(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cpu", f"model.cache_dir={tmp_path}",
                                              "generator.vllm.kv_cache_gib=3"])
    kwargs, env = engine_settings(cfg, tmp_path / "model")
    assert kwargs["enforce_eager"] is True and kwargs["dtype"] == "float32"
    assert "gpu_memory_utilization" not in kwargs  # vLLM's CPU build would take it as a share of host RAM
    # vLLM's own binding would reserve one core of two for its scheduler: unpinned, generator.threads threads
    # and its engine core in this process: a separate one busy-polls a core of its own
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(os.cpu_count()),
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert kwargs["logprobs_mode"] == "processed_logprobs" and "enable_lora" not in kwargs


@pytest.mark.unit
def test_cpu_engine_threads_follow_the_generator_or_a_binding_the_user_names(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cpu", "generator.threads=3"])
    assert engine_settings(cfg, tmp_path)[1]["OMP_NUM_THREADS"] == "3"
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cpu",
                                              "generator.vllm.cpu_threads_bind=0-3"])
    env = engine_settings(cfg, tmp_path)[1]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and "OMP_NUM_THREADS" not in env


@pytest.mark.unit
def test_gpu_engine_compiles_and_takes_a_memory_fraction(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cuda", "model.dtype=bfloat16",
                                              "generator.vllm.gpu_memory_utilization=0.5",
                                              "learner.lora.enabled=true", "learner.lora.r=8",
                                              f"generator.vllm.cache_root={tmp_path}/c"])
    kwargs, env = engine_settings(cfg, Path("m"))
    assert kwargs["enforce_eager"] is False and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["dtype"] == "bfloat16" and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CACHE_ROOT"] == f"{tmp_path}/c" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 8


@pytest.mark.unit
def test_a_dtype_other_than_the_learners_is_a_warning_with_the_gap(tmp_path, caplog):
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cpu", "generator.vllm.dtype=bfloat16"])
    with caplog.at_level(logging.WARNING):
        kwargs, _ = engine_settings(cfg, tmp_path)
    assert kwargs["dtype"] == "bfloat16"
    assert "model.dtype" in caplog.text and "nats/token" in caplog.text
    caplog.clear()
    engine_settings(load_config(["configs/tiny.yaml"], [*VLLM, "generator.device=cpu"]), tmp_path)
    assert "nats/token" not in caplog.text


@pytest.mark.unit
def test_version_tuple_reads_release_and_local_versions():
    assert version_tuple("0.32.0") == (0, 32, 0) > (0, 10, 2)
    assert version_tuple("0.10.1+cpu") == (0, 10, 1) < (0, 10, 2)
    assert version_tuple("0.11.0rc1") == (0, 11, 0)


@pytest.mark.unit
def test_a_merged_adapter_is_pefts_merge_of_the_base_weights(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [*VLLM, f"model.cache_dir={tmp_path}", "generator.device=cpu",
                                              "learner.lora.enabled=true", "learner.lora.r=4"])
    model_dir = model_dir_for_vllm(cfg.model)
    skeleton = weight_skeleton(model_dir, torch.float32, cfg.learner.lora)
    pristine = pristine_targets(model_dir, skeleton, torch.float32)
    peft = load_policy(cfg.model, lora=cfg.learner.lora)
    gen = torch.Generator().manual_seed(0)
    adapter = {n: 0.1 * torch.randn(t.shape, generator=gen)
               for n, t in adapter_tensors(peft.state_dict()).items()}
    peft.load_state_dict(adapter, strict=False)
    expected = peft.merge_and_unload().state_dict()
    merged = merged_weights(pristine, adapter, cfg.learner.lora)
    assert set(merged) == set(pristine)  # whole layers: vLLM's reload rebuilds a layer from what it is given
    # every tensor of each adapted module and nothing else: q, k, v, o of attention (vLLM fuses q/k/v), no MLP
    # or embedding (tiny.yaml adapts attention only)
    assert pristine and all(".self_attn." in n for n in pristine)
    assert {n.rsplit(".", 2)[1] for n in pristine} >= {"q_proj", "k_proj", "v_proj"}
    changed = {lora_base_name(n) for n in adapter}
    assert changed and all(n in merged for n in changed)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    for name in set(pristine) - changed:
        assert merged[name] is pristine[name]  # untouched weights are not copied


@pytest.mark.unit
def test_lora_merges_on_cpu_and_serves_adapters_on_gpu_unless_told(tmp_path):
    lora = ["learner.lora.enabled=true", "learner.lora.r=8"]
    cpu = load_config(["configs/tiny.yaml"], [*VLLM, *lora, "generator.device=cpu"])
    assert merges_lora(cpu) and "enable_lora" not in engine_settings(cpu, tmp_path)[0]
    gpu = load_config(["configs/tiny.yaml"], [*VLLM, *lora, "generator.device=cuda"])
    assert not merges_lora(gpu) and engine_settings(gpu, tmp_path)[0]["enable_lora"]
    told = load_config(["configs/tiny.yaml"], [*VLLM, *lora, "generator.device=cpu",
                                               "generator.vllm.merge_lora=false"])
    assert not merges_lora(told)


def test_an_engine_process_gets_pushes_through_shared_memory_unless_told_or_there_is_none(monkeypatch):
    def cfg(choice: str):
        return load_config(["configs/tiny.yaml"], [*VLLM, f"generator.vllm.handoff={choice}"])

    assert shared_handoff(cfg("auto")) is shared_memory.available()
    assert shared_handoff(cfg("file")) is False
    monkeypatch.setattr(shared_memory, "shm_host", lambda: "")  # no writable /dev/shm here
    assert shared_handoff(cfg("auto")) is False
    with pytest.raises(RuntimeError, match="handoff=shm needs a writable /dev/shm.*handoff=auto"):
        shared_handoff(cfg("shm"))
