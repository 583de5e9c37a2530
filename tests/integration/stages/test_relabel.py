import json

import pytest

pytestmark = pytest.mark.integration

PAIRS = [
    {"prompt": "Review: ", "chosen": "I love it, wonderful!", "rejected": "I hate it, awful."},  # agrees
    {"prompt": "Opinion: ", "chosen": "Terrible, the worst.", "rejected": "Great fun, happy."},  # flipped
    {"prompt": "Say: ", "chosen": "the table", "rejected": "the chair"},  # VADER 0 vs 0: a tie, dropped
    {"prompt": "Say: ", "chosen": "Happy joy", "rejected": "Sad pain"},  # agrees
]


def test_relabel_orders_given_pairs_by_gold_and_reports_agreement(stage, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    assert stage("relabel", f"relabel.input={data}") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["pairs"], summary["ties_dropped"]) == (3, 1)
    assert summary["agreement"] == pytest.approx(2 / 3)
    rows = [json.loads(line) for line in (tmp_path / "preferences.jsonl").read_text().splitlines()]
    assert [r["chosen"] for r in rows] == ["I love it, wonderful!", "Great fun, happy.", "Happy joy"]
    assert all(r["chosen_score"] > r["rejected_score"] for r in rows)


def test_relabel_samples_pairs_from_the_policy(stage, tmp_path, capsys):
    # a gold reward that orders almost any two samples: minus the length in characters
    assert (
        stage(
            "relabel",
            "relabel.num_prompts=4",
            "generator.sampling.max_new_tokens=12",
            "evaluator.gold.kind=rule",
            "evaluator.gold.name=length_penalty",
            "evaluator.gold.args={unit: chars, coef: 1.0}",
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pairs"] + summary["ties_dropped"] == 4 and "agreement" not in summary
    rows = [json.loads(line) for line in (tmp_path / "preferences.jsonl").read_text().splitlines()]
    assert len(rows) == summary["pairs"] and all(len(r["chosen"]) < len(r["rejected"]) for r in rows)
