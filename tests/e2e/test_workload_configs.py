"""The workload configs (the seeds' `configs/tldr.yaml`, `alpacafarm_lora_ppo.yaml`, `gsm8k.yaml`, and
`varlen.yaml`, variable-length answers on the demo model) run as written, with only what needs a GPU node, a
network or minutes swapped: the tiny model for the hub and demo models, a tiny local dataset of the same
schema for a hub dataset, the HF backend for vLLM, and a few small steps."""

import json

import pytest
from datasets import Dataset, DatasetDict

from asyncrlhf.config import load_config
from tests.e2e.test_up import finish, up

pytestmark = pytest.mark.e2e

ROWS = {
    "tldr": [{"prompt": f"SUBREDDIT: r/advice\nTITLE: question {i}\nPOST: my cat {i} sat.\nTL;DR:",
              "completion": f" cat {i} sat"} for i in range(8)],
    "alpacafarm_lora_ppo": [{"instruction": f"List {i} colours.", "input": "", "output": "red"}
                            for i in range(8)],
    "gsm8k": [{"question": f"Tom has {i} apples and buys 2 more. How many?",
               "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"} for i in range(8)],
}
SMALL = ["model.name_or_path=tiny", "model.allow_hub=false", "model.max_prompt_tokens=64",
         "generator.backend=hf", "generator.batch_prompts=2", "generator.sampling.max_new_tokens=8",
         "learner.groups_per_step=2", "learner.micro_batch_size=2", "learner.total_steps=2",
         "learner.checkpoint_every=2", "learner.deepspeed.bf16=false", "reward.max_length=128",
         "launch.evaluator=false"]


@pytest.mark.parametrize("name", ["varlen"])  # the seeds' configs run on their recipe pages (test_docs_pages)
def test_workload_config_runs_with_a_tiny_model_and_local_data(tmp_path, name):
    cfg = load_config([f"configs/{name}.yaml"], [])
    swaps = []
    if name in ROWS:  # a hub dataset; `varlen` builds its prompts in code
        rows = Dataset.from_list(ROWS[name])
        DatasetDict({cfg.task.split: rows, cfg.task.eval_split: rows}).save_to_disk(tmp_path / "data")
        swaps.append(f"task.dataset={tmp_path}/data")
    if any(s.kind == "model" for s in cfg.reward.scorers):  # the RM: the tiny scorer in its place
        swaps.append("reward.scorers=[{kind: model, path: tiny}]")
    code, out = finish(up(tmp_path, *SMALL, *swaps, config=f"configs/{name}.yaml"), timeout=400)
    assert code == 0, out[-4000:]
    summary = json.loads((tmp_path / "run" / "up_summary.json").read_text())
    assert summary["learner_version"] == 3  # two steps

    saved = load_config([str(tmp_path / "run" / "checkpoints" / "step-000003" / "config.yaml")], [])
    assert saved.learner.algorithm == cfg.learner.algorithm
    assert saved.task.prompt_field == cfg.task.prompt_field
    assert saved.learner.lora.enabled == cfg.learner.lora.enabled
