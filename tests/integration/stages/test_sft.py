import json

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.envs.episode import EpisodeRunner, episode_limits
from asyncrlhf.envs.loading import EnvFactory
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


def test_a_tools_task_trains_after_the_first_context_of_its_episodes():
    """With `task.env.kind: tools` the SFT prompt is an episode's first context (system prompt, question,
    the tools' signatures), so tool-call demonstrations warm-start the very turn the episodes sample."""
    cfg = load_config(["configs/tiny.yaml"], [
        "task.name=calculator", "task.env.kind=tools", "task.env.tools=[calculator]", "reward.scorers=[]",
        "model.system_prompt=Use the calculator.", "sft.max_length=4096"])
    tokenizer = load_tokenizer(cfg.model)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>'
    ((ids, prompt_len),) = tokenize(cfg, tokenizer, [{"prompt": "What is 12 * 3?", "completion": call}])
    runner = EpisodeRunner(tokenizer, EnvFactory(cfg.task.env), episode_limits(cfg, 8), "Use the calculator.")
    assert ids[:prompt_len] == runner.start("What is 12 * 3?", "36").prompt_ids
    assert '"calculator"' in tokenizer.decode(ids[:prompt_len])  # the tool's signature
    ((plain, plain_len),) = tokenize(load_config(["configs/tiny.yaml"], ["sft.max_length=4096"]), tokenizer,
                                     [{"prompt": "What is 12 * 3?", "completion": call}])
    assert plain[plain_len:] == ids[prompt_len:] and plain_len < prompt_len
