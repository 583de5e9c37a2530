"""`asyncrlhf export` on a real LoRA checkpoint: one step of the library's training loop (the in-process
pipeline, DeepSpeed on CPU, `python -m asyncrlhf.bench.inprocess`) from a base saved as an HF directory,
then each export loaded by the tools a user would use. Merged: transformers' AutoModelForCausalLM gives the
checkpoint's logits within 1e-5, and vLLM's CPU build loads the directory and scores as transformers does.
Adapter: PEFT loads it onto the base it names (an absolute path, not a cache copy), same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.export import ExportError, export, find_checkpoint
from asyncrlhf.sampling.vllm_engine import model_dir_for_vllm
from asyncrlhf.training.checkpoint import load_checkpoint_policy, step_dir

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[5, 40, 41, 42, 7, 9, 80]])


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(run dir, its config): a LoRA run of one step that moves the adapter's B off 0 (its initial value),
    so a merge that lost the adapter would not match: best-of-n (a gradient whatever the rewards; online
    DPO on a random model's equal rewards has no pair to learn from) at a large learning rate. Trained once
    for the session: the vLLM test runs at its end (tests/conftest.py), after other modules, where a
    module's fixture would train again."""
    tmp = tmp_path_factory.mktemp("export")
    base = model_dir_for_vllm(load_config(["configs/tiny.yaml"], ["model.tiny.heads=2",
                                                                   f"model.cache_dir={tmp}"]).model)
    overrides = [f"model.name_or_path={base}", "learner.algorithm=best_of_n", "learner.lora.enabled=true",
                 "learner.lora.r=8", "learner.total_steps=1", "learner.checkpoint_every=1", "learner.lr=1e-2",
                 f"run.dir={tmp}/run"]
    subprocess.run([sys.executable, "-m", "asyncrlhf.bench.inprocess", "--config", "configs/tiny.yaml",
                    *overrides], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
                   capture_output=True)
    return tmp / "run", load_config(["configs/tiny.yaml"], overrides)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.eval()(input_ids=IDS).logits


def test_a_merged_export_has_the_checkpoints_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run, cfg = trained
    exported = export(run, tmp_path / "merged", merge_lora=True)
    assert exported == step_dir(run, 2) == find_checkpoint(run, 1)  # the newest: one step, version 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    expected = logits(load_checkpoint_policy(exported, cfg.model))
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path)
    assert (logits(base) - expected).abs().max() > 1e-3  # the adapter is in there
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    generation = GenerationConfig.from_pretrained(tmp_path / "merged")
    assert generation.eos_token_id == [tokenizer.eos_token_id] and generation.max_new_tokens == 16
    assert (tmp_path / "merged" / "training_config.yaml").is_file()


def test_an_adapter_export_names_its_base_portably(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, cfg = trained
    export(run, tmp_path / "adapter", step=1)
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(Path(cfg.model.name_or_path).resolve())
    base = AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"])
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    expected = logits(load_checkpoint_policy(step_dir(run, 2), cfg.model))
    torch.testing.assert_close(logits(model), expected, atol=1e-5, rtol=0)
    export(run, tmp_path / "named", base="org/base-model")
    named = json.loads((tmp_path / "named" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == "org/base-model"


def test_exports_that_cannot_be_written_say_what_to_do(trained, tmp_path):
    run, _ = trained
    with pytest.raises(ExportError, match=r"no checkpoint after 3 steps; it has: 1 \(step-000002\)"):
        export(run, tmp_path / "x", step=3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    with pytest.raises(ExportError, match="not empty"):
        export(run, tmp_path / "full")
    with pytest.raises(ExportError, match="holds no checkpoint"):
        export(tmp_path, tmp_path / "y")


@pytest.mark.vllm
def test_vllm_serves_a_merged_export(trained, tmp_path):
    """One vLLM engine start (its CPU build: 30-60 s here) on the export directory as its model."""
    from transformers import AutoModelForCausalLM

    from asyncrlhf.models import load_tokenizer
    from asyncrlhf.sampling import create_backend
    from tests.integration.vllm.helpers import PARITY_ATOL, vllm_config

    run, _ = trained
    export(run, tmp_path / "merged", merge_lora=True)
    cfg = vllm_config(tmp_path / "cache", f"model.name_or_path={tmp_path / 'merged'}")
    backend = create_backend(cfg, load_tokenizer(cfg.model))
    try:
        (scores,) = backend.score_tokens([IDS[0].tolist()], 0)
        completion = backend.generate([IDS[0].tolist()], 1, cfg.generator.sampling)[0][0]
    finally:
        backend.close()
    expected = torch.log_softmax(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))[0], -1)
    token_lps = expected[:-1].gather(-1, IDS[0, 1:, None])[:, 0]
    assert (torch.tensor([lp for lp, _ in scores]) - token_lps).abs().max() <= PARITY_ATOL
    assert completion.token_ids
