"""A verifiable gold reward in evaluation: the held-out split's reference answers (task `hf`,
`reference_field`) reach the gold scorer, and chat `messages` prompts are evaluated through the template."""

import pytest
from datasets import Dataset, DatasetDict

from asyncrlhf.config import load_config
from asyncrlhf.models import load_tokenizer
from asyncrlhf.sampling.offline import Generation
from asyncrlhf.stages.evaluation import GoldEvaluation

pytestmark = pytest.mark.integration


def test_gsm8k_style_held_out_answers_reach_the_math_gold_reward(tmp_path):
    rows = [{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(3)]
    splits = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)})
    splits.save_to_disk(tmp_path / "d")
    cfg = load_config(["configs/tiny.yaml"], [
        "task.name=hf", f"task.dataset={tmp_path}/d", "task.prompt_field=question", "task.eval_split=test",
        "task.reference_field=answer", "evaluator.gold={kind: rule, name: math_answer}",
        "evaluator.missing_eos_penalty=null", "evaluator.num_prompts=3", f"run.dir={tmp_path}/run"])
    evaluation = GoldEvaluation(cfg, load_tokenizer(cfg.model))
    assert evaluation.prompts == [r["question"] for r in rows]
    completions = ["so the answer is \\boxed{2}", "#### 4", "I think 2 + 2 = 4."]  # right, wrong, right
    generations = [Generation(p, ids, c, [1], "stop")
                   for p, ids, c in zip(evaluation.prompts, evaluation.prompt_ids, completions, strict=True)]
    assert evaluation.score(generations).tolist() == [1.0, 0.0, 1.0]
