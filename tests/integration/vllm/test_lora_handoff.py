"""Unmerged LoRA pushes (`generator.vllm.merge_lora=false`, vLLM's LoRA kernels) into a vLLM engine in a
process of its own (`generator.vllm.engine_in_process=false`, the GPU defaults): each worker registers the
adapter from the generator's shared-memory handoff (`vllm_engine.register_lora`), so no file or directory is
created or written per version (a watchdog observer on the cache directory, the engine's work directory
within it, and /dev/shm), and the served log-probs are HF + PEFT's with that adapter. An adapter whose bytes
change after the generator's check, or one naming a module vLLM serves no LoRA on, is refused by the workers
and the previous adapter keeps serving."""

from __future__ import annotations

import pytest
from asyncrlhf.weights.handoff import HandoffMismatch
from watchdog.observers import Observer

from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.shm import SHM_DIR
from tests.integration.vllm.helpers import (
    PARITY_ATOL,
    hf_backend,
    max_gap,
    score_gap,
    vllm_config,
)
from tests.integration.vllm.test_handoff import Corrupting, Writes
from tests.integration.vllm.test_lora import random_adapter

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=6)


def test_adapters_reach_an_engine_process_with_no_file_and_a_refused_one_keeps_the_last(tmp_path):
    from asyncrlhf.sampling.vllm import ADAPTER_ID, VLLMBackend

    cfg = vllm_config(tmp_path, "learner.lora.enabled=true", "learner.lora.r=8", "learner.lora.alpha=16",
                      "generator.vllm.merge_lora=false", "generator.vllm.engine_in_process=false")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    hf = hf_backend(cfg, tokenizer)
    assert not backend.in_process and backend.handoff is not None and backend.pristine is None
    reference = load_policy(cfg.model, lora=cfg.learner.lora).eval()
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
    writes, observer = Writes(), Observer()
    observer.schedule(writes, str(tmp_path), recursive=True)
    observer.schedule(writes, str(SHM_DIR), recursive=False)
    try:
        backend.apply_weights(random_adapter(reference, seed=1), PolicyVersion(0, 1))  # makes the segment
        segment = backend.handoff.segment.name
        observer.start()
        previous = None
        for version in (2, 3, 4):
            adapter = random_adapter(reference, seed=version)
            backend.apply_weights(adapter, PolicyVersion(0, version))
            reference.load_state_dict(adapter, strict=False)
            hf.apply_weights(adapter, PolicyVersion(0, version))
            groups = backend.generate(prompts, 2, SAMPLING)
            assert max_gap(reference, prompts, groups, SAMPLING) <= PARITY_ATOL
            sequences = [p + c.token_ids for p, g in zip(prompts, groups, strict=True) for c in g]
            assert score_gap(backend.score_tokens(sequences, 3), hf.score_tokens(sequences, 3)) <= PARITY_ATOL
            if previous is not None:  # the last version's samples score differently: the adapter changed
                assert max_gap(reference, prompts, previous, SAMPLING) > 0.05
            previous = groups
            assert set(backend.llm.llm_engine.list_loras()) == {ADAPTER_ID}  # in place of the last one
        observer.stop()
        observer.join()
        assert writes.take() == []
        assert backend.handoff.segment.name == segment and list(backend.work_dir.iterdir()) == []

        honest, backend.handoff = backend.handoff, Corrupting()
        try:
            with pytest.raises(Exception, match=HandoffMismatch.__name__ + "|not those the generator"):
                backend.apply_weights(random_adapter(reference, seed=9), PolicyVersion(0, 5))
        finally:
            backend.handoff.close()
            backend.handoff = honest
        stray = {**random_adapter(reference, seed=9),
                 "base_model.model.model.norm.lora_A.default.weight": next(iter(reference.parameters()))}
        with pytest.raises(Exception, match="not among those vLLM serves LoRA on"):
            backend.apply_weights(stray, PolicyVersion(0, 5))
        assert backend.version == 4 and backend.lora_request.lora_name == "policy-v4"
        groups = backend.generate(prompts, 2, SAMPLING)
        assert max_gap(reference, prompts, groups, SAMPLING) <= PARITY_ATOL  # still version 4's adapter
    finally:
        if observer.is_alive():
            observer.stop()
        backend.close()

