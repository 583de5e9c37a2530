import json
import random

import pytest

from asyncrlhf.rewards.model import ModelScorer

pytestmark = pytest.mark.integration


def toy_pairs(n: int, seed: int = 0) -> list[dict]:
    """Separable: the chosen completion ends in "good", the rejected one in "bad", after random filler."""
    rng = random.Random(seed)
    words = ["red", "blue", "cat", "tree", "moon", "sand", "fish", "lamp", "road", "cup"]
    out = []
    for i in range(n):
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        out.append({"prompt": f"Q{i}: ", "chosen": f"{filler} good", "rejected": f"{filler} bad"})
    return out


def test_reward_model_separates_a_toy_preference_set(stage, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in toy_pairs(80)))
    assert (
        stage(
            "train-rm",
            f"rm.data={data}",
            "rm.eval_fraction=0.25",
            "rm.epochs=3",
            "rm.lr=1e-3",
            "rm.batch_size=8",
            "rm.micro_batch_size=4",
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["pairs"], summary["heldout_pairs"]) == (60, 20)
    assert summary["heldout_accuracy"] > 0.9
    assert summary["last_loss"] < summary["first_loss"]

    scorer = ModelScorer(str(tmp_path / "rm"), device="cpu")  # what the reward service loads as `model`
    held = toy_pairs(10, seed=1)
    scores = scorer.score(
        [p["prompt"] for p in held] * 2, [p["chosen"] for p in held] + [p["rejected"] for p in held]
    ).scores
    assert sum(c > r for c, r in zip(scores[:10], scores[10:], strict=True)) >= 9


def test_train_rm_reads_relabel_output_by_default(stage, tmp_path):
    (tmp_path / "preferences.jsonl").write_text("".join(json.dumps(p) + "\n" for p in toy_pairs(8)))
    assert stage("train-rm", "rm.eval_fraction=0.0") == 0
    assert (tmp_path / "rm" / "config.json").is_file()
    assert json.loads((tmp_path / "rm" / "training.json").read_text())["heldout_accuracy"] is None
