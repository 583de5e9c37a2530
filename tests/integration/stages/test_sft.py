import json

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.stages.sft import completion_nll, tokenize

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"Describe item {i}.", "completion": "A lovely, wonderful thing."} for i in range(8)]


def nll(model_path, rows):
    cfg = load_config(["configs/tiny.yaml"])
    tokenizer = load_tokenizer("tiny")
    examples = tokenize(cfg, tokenizer, rows)
    with torch.no_grad():
        return float(completion_nll(load_policy(model_path).eval(), examples, tokenizer.pad_token_id)[0])


# LoRA on the attention projections of a random 2-layer model moves the NLL less than full fine-tuning.
@pytest.mark.parametrize("lora, lr, gain", [(False, "3e-3", 0.5), (True, "1e-2", 0.1)])
def test_sft_on_jsonl_lowers_completion_nll_and_writes_an_hf_model(stage, tmp_path, lora, lr, gain):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert (
        stage(
            "sft",
            f"sft.data={data}",
            "sft.epochs=3",
            f"sft.lr={lr}",
            "sft.batch_size=4",
            "sft.micro_batch_size=2",
            f"sft.lora.enabled={str(lora).lower()}",
        )
        == 0
    )
    out = tmp_path / "sft"
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()  # LoRA merged
    assert nll(str(out), ROWS) < nll("tiny", ROWS) - gain
    summary = json.loads((tmp_path / "stages.jsonl").read_text().splitlines()[-1])
    assert (summary["stage"], summary["examples"], summary["steps"]) == ("sft", 8, 6)


def test_sft_without_data_uses_best_of_n_samples(stage, tmp_path):
    assert stage("sft", "sft.num_prompts=3", "sft.best_of_n=2", "generator.sampling.max_new_tokens=6") == 0
    rows = [json.loads(line) for line in (tmp_path / "sft_data.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all({"prompt", "completion", "gold_reward"} <= set(r) for r in rows)
    assert (tmp_path / "sft" / "model.safetensors").is_file()


def test_completion_loss_ignores_the_prompt():
    cfg = load_config(["configs/tiny.yaml"])
    tokenizer = load_tokenizer("tiny")
    model = load_policy("tiny").eval()
    a = tokenize(cfg, tokenizer, [{"prompt": "one prompt", "completion": "same answer"}])
    b = tokenize(cfg, tokenizer, [{"prompt": "one prompt", "completion": "same answer"}])
    ((ids, prompt_len),) = a
    assert prompt_len < len(ids) and ids[-1] == tokenizer.eos_token_id
    loss, tokens = completion_nll(model, a, tokenizer.pad_token_id)
    assert tokens == len(ids) - prompt_len  # "same answer" + EOS, nothing of the prompt
    assert torch.equal(loss, completion_nll(model, b, tokenizer.pad_token_id)[0])


def test_missing_data_file_exits_2(stage, tmp_path):
    assert stage("sft", f"sft.data={tmp_path / 'nope.jsonl'}") == 2
