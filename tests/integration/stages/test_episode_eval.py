"""Gold evaluation of an episode task on the tiny model: each held-out prompt is one episode through the
environment, the gold reward scores the episode's answer (its last model turn, when the environment ended
it), and KL and perplexity count the model's tokens, not the environment's."""

import pytest
import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import load_config
from asyncrlhf.models import load_tokenizer
from asyncrlhf.sampling.offline import Generation, completion_token_logprobs
from asyncrlhf.stages.evaluation import GoldEvaluation

pytestmark = pytest.mark.integration


def evaluation(tmp_path, *overrides: str) -> GoldEvaluation:
    cfg = load_config(["configs/tiny.yaml"], [
        "task.name=arithmetic", "task.env.kind=class", "task.env.path=tests/unit/envs/scripted.py:Counter",
        "task.env.args={turns: 2}", "reward.scorers=[]", "evaluator.gold={kind: rule, name: math_answer}",
        "evaluator.missing_eos_penalty=null", "evaluator.num_prompts=3", "evaluator.max_new_tokens=5",
        "evaluator.device=cpu", f"run.dir={tmp_path}", *overrides])
    return GoldEvaluation(cfg, load_tokenizer(cfg.model))


def test_each_held_out_prompt_is_an_episode_scored_on_its_answer(tmp_path):
    ev = evaluation(tmp_path)
    generations = ev.generate(ev.reference)
    assert [g.prompt for g in generations] == ev.prompts
    tokenizer = ev.tokenizer
    for g in generations:
        # two model turns with the environment's "obs 1" between them (Counter, turns=2)
        mask = g.loss_mask
        assert mask is not None and len(mask) == len(g.completion_ids)
        observation = [i for i, m in enumerate(mask) if m == 0]
        assert observation and mask[0] == 1 and mask[-1] == 1
        assert "obs 1" in tokenizer.decode([g.completion_ids[i] for i in observation])
        answer = g.completion_ids[observation[-1] + 1 :]
        assert g.completion == tokenizer.decode(answer, skip_special_tokens=True)
    right = [Generation(g.prompt, g.prompt_ids, f"it is {label}", g.completion_ids, g.finish, g.loss_mask)
             for g, label in zip(generations, ev.labels or [], strict=True)]
    assert ev.score(right).tolist() == [1.0, 1.0, 1.0]  # the answer text, against the held-out reference


def test_an_episode_the_environment_did_not_end_has_no_answer(tmp_path):
    ev = evaluation(tmp_path, "task.env.args={turns: 5}", "task.env.max_turns=2")
    generations = ev.generate(ev.reference)
    assert [g.completion for g in generations] == ["", "", ""]
    assert ev.score(generations).tolist() == [0.0, 0.0, 0.0]


def test_kl_and_perplexity_count_the_models_tokens_only(tmp_path):
    ev = evaluation(tmp_path)
    generations = ev.generate(ev.reference)
    measures = ev.evaluate(ev.reference, generations)
    prompt_ids = [g.prompt_ids for g in generations]
    completion_ids = [g.completion_ids for g in generations]
    pad = ev.tokenizer.pad_token_id
    logps, every = completion_token_logprobs(ev.reference, prompt_ids, completion_ids, pad)
    model = torch.zeros_like(every)
    for row, g in enumerate(generations):
        model[row, : len(g.loss_mask or [])] = torch.tensor(g.loss_mask, dtype=model.dtype)
    expected = float(A.perplexity(logps, model).mean())
    assert measures["perplexity"] == pytest.approx(expected, rel=1e-6)
    assert expected != pytest.approx(float(A.perplexity(logps, every).mean()), rel=1e-3)
    assert measures["kl"] == 0.0 and measures["n_prompts"] == 3
