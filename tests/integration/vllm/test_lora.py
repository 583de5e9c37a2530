"""LoRA pushes into a real vLLM engine (vLLM's CPU build here), served by vLLM's LoRA kernels and folded into
the weights (`generator.vllm.merge_lora`, the CPU default): adapter versions 1, 2, 3 each give the log-probs
HF + PEFT give with that adapter, sampling and scoring (`score_tokens`, what the API's log-probs are); the
previous adapter is unloaded; closing the backend deletes the work directory. Unmerged adapters are registered
in the engine's workers from their tensors, with no file per version (every hop: `test_hop_contract.py`),
under one adapter id: a sequence in flight across a push (continuous mode) goes on with the new adapter."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt
from asyncrlhf.sampling.hops.hop import HopKind
from asyncrlhf.sampling.single_turn import Completions, Progress
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors
from tests.integration.vllm.helpers import (
    PARITY_ATOL,
    hf_backend,
    max_gap,
    reference_logprobs,
    score_gap,
    vllm_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=6)
LONG = SamplingConfig(temperature=1.0, max_new_tokens=32)


def random_adapter(peft_model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Adapter tensors large enough that each version's log-probs differ clearly from the last."""
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(t.shape, generator=gen)
            for name, t in adapter_tensors(peft_model.state_dict()).items()}


@pytest.mark.parametrize(("merge", "in_process"), [(False, True), (True, True), (True, False)],
                         ids=["lora-kernels", "merged", "merged-engine-process"])
def test_adapter_versions_match_hf_peft_and_old_ones_are_unloaded(tmp_path, merge, in_process):
    """In the generator's process (the CPU default) a merged push hands the engine's worker its tensors; an
    engine in a process of its own gets them through the generator's shared-memory handoff."""
    from asyncrlhf.sampling.vllm import ADAPTER_ID, VLLMBackend

    cfg = vllm_config(tmp_path, "learner.lora.enabled=true", "learner.lora.r=8", "learner.lora.alpha=16",
                      f"generator.vllm.merge_lora={str(merge).lower()}",
                      f"generator.vllm.engine_in_process={str(in_process).lower()}")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    assert (backend.hop.kind is HopKind.IN_PROCESS) is in_process
    hf = hf_backend(cfg, tokenizer)
    try:
        prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
        reference = load_policy(cfg.model, lora=cfg.learner.lora).eval()
        assert set(backend.named_tensors()) == set(adapter_tensors(reference.state_dict()))
        previous = None
        for version in (1, 2, 3):
            adapter = random_adapter(reference, seed=version)
            backend.apply_weights(adapter, PolicyVersion(0, version))
            reference.load_state_dict(adapter, strict=False)
            groups = backend.generate(prompts, 3, SAMPLING)
            assert backend.version == version
            assert max_gap(reference, prompts, groups, SAMPLING) <= PARITY_ATOL
            hf.apply_weights(adapter, PolicyVersion(0, version))
            sequences = [p + c.token_ids for p, g in zip(prompts, groups, strict=True) for c in g]
            assert score_gap(backend.score_tokens(sequences, 3), hf.score_tokens(sequences, 3)) <= PARITY_ATOL
            if previous is not None:  # what the last version's samples score now: a different adapter
                assert max_gap(reference, prompts, previous, SAMPLING) > 0.05
            previous = groups
            if merge:  # a full-weight reload into an engine without LoRA; no push file
                assert backend.pristine is not None and list(backend.work_dir.iterdir()) == []
                assert backend.llm.llm_engine.vllm_config.lora_config is None
            else:  # registered from tensors in place of the last one: no adapter directory
                assert list(backend.work_dir.iterdir()) == []
                assert set(backend.llm.llm_engine.list_loras()) == {ADAPTER_ID}
                assert backend.lora_request.lora_name == f"policy-v{version}"
        if not merge:
            in_flight_across_a_push(backend, reference, prompts)
    finally:
        work_dir = backend.work_dir
        backend.close()
    assert not work_dir.exists()


def in_flight_across_a_push(backend, reference, prompts) -> None:
    """Continuous mode, KV re-computed at the push: the tokens after it are exactly the new adapter's."""
    from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine

    backend.driver, backend.recompute_inflight = VLLMStepEngine(backend), True
    sampler: ContinuousSampler[str, Progress] = ContinuousSampler(backend.driver, Completions(), LONG)
    runs = [sampler.start(f"t{i}", f"g{i}", GroupPrompt(p), 2, lineage=0) for i, p in enumerate(prompts)]
    for _ in range(4):
        sampler.step(3)
    before = [[len(s.token_ids) for s in run.samples] for run in runs]
    adapter = random_adapter(reference, seed=4)
    backend.apply_weights(adapter, PolicyVersion(0, 4))
    reference.load_state_dict(adapter, strict=False)
    while sampler.running_samples:
        sampler.step(4)
    checked = 0
    for run, lengths in zip(runs, before, strict=True):
        for sample, n in zip(run.samples, lengths, strict=True):
            assert sample.versions == [3] * n + [4] * (len(sample.token_ids) - n)
            if len(sample.token_ids) > n:
                checked += 1
                expected = reference_logprobs(reference, run.prompt.ids + sample.token_ids[:n],
                                              sample.token_ids[n:], LONG)
                assert (torch.tensor(sample.logprobs[n:]) - expected).abs().max().item() <= PARITY_ATOL
    assert checked, "no sample outlived the push: lengthen LONG"
