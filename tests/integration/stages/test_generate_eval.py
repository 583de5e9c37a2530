import json

import pytest

from asyncrlhf.training.checkpoint import HF
from tests.integration.evaluator.checkpoints import write_checkpoint

pytestmark = pytest.mark.integration

SMALL = ["evaluator.num_prompts=4", "evaluator.max_new_tokens=8"]


def test_generate_then_eval_per_checkpoint(stage, tmp_path, capsys):
    full = write_checkpoint(tmp_path, 3, scale=2.0)
    lora = write_checkpoint(tmp_path / "lora-run", 5, lora=True)
    assert stage("generate", *SMALL, "--checkpoint", "initial", str(full), str(lora / HF)) == 0
    rows = [json.loads(line) for line in (tmp_path / "eval" / "generations.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1] * 4 + [3] * 4 + [5] * 4
    assert {"prompt", "prompt_ids", "completion", "completion_ids", "finish"} <= set(rows[0])
    capsys.readouterr()

    out = tmp_path / "results.json"
    assert (
        stage(
            "eval",
            *SMALL,
            "--generations",
            str(tmp_path / "eval" / "generations.jsonl"),
            "--output",
            str(out),
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert [r["version"] for r in results] == [1, 3, 5]
    initial, scaled, adapted = results
    assert (initial["win_rate"], initial["kl"], initial["checkpoint"]) == (0.5, 0.0, "initial")
    assert scaled["kl"] != 0.0 and adapted["kl"] != 0.0
    assert all(r["n_prompts"] == 4 and r["perplexity"] > 1 for r in results)
    assert (tmp_path / "eval" / "references.jsonl").is_file()  # the initial policy's greedy completions


def test_eval_with_dataset_references(stage, tmp_path, capsys):
    refs = tmp_path / "refs.jsonl"
    refs.write_text(
        "".join(
            json.dumps({"prompt": f"Say hi {i}", "completion": "What a great day!"}) + "\n" for i in range(3)
        )
    )
    assert stage("generate", *SMALL, f"evaluator.references_path={refs}", "--checkpoint", "initial") == 0
    assert (
        stage(
            "eval",
            *SMALL,
            f"evaluator.references_path={refs}",
            "--generations",
            str(tmp_path / "eval" / "generations.jsonl"),
        )
        == 0
    )
    (result,) = json.loads((tmp_path / "eval" / "generations.results.json").read_text())
    # gibberish from the random tiny model scores 0 under VADER; the references score > 0: every prompt lost
    assert (result["n_prompts"], result["win_rate"], result["kl"]) == (3, 0.0, 0.0)


def test_generate_needs_a_checkpoint(stage):
    assert stage("generate") == 2
