"""Reward, gold and value models by hub id: they load as the policy does, under the run's `model.allow_hub`,
at their own pinned revision, in their own dtype (auto: bfloat16 on a GPU, float32 on the CPU), from a hub
cache laid out as huggingface_hub writes it (tests/offline_hub.py), offline; and `up` refuses a run whose
reward model cannot be found, naming its key, before anything starts."""

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.models import load_score_model, load_tokenizer, resolve_dtype
from asyncrlhf.prestart import prepare_models
from asyncrlhf.rewards import build_reward
from asyncrlhf.training.policies import value_source
from tests.offline_hub import COMMIT, save_snapshot

pytestmark = pytest.mark.unit
RM = "acme/tiny-rm"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A hub cache holding RM (the tiny score model) at COMMIT, `main` pointing at it; the client offline."""
    from huggingface_hub import constants

    def write(directory):
        load_score_model("tiny").save_pretrained(directory)
        load_tokenizer("tiny").save_pretrained(directory)

    save_snapshot(tmp_path, RM, write)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def hub_run(*overrides):
    return load_config(["configs/tiny.yaml"], ["model.allow_hub=true", *overrides])


@pytest.mark.parametrize("revision", [COMMIT, "main"])
def test_a_reward_model_by_hub_id_loads_under_the_runs_allow_hub(offline_hub, revision):
    cfg = hub_run(f"reward.scorers=[{{kind: model, path: {RM}, revision: {revision}}}]", "reward.device=cpu")
    scorer = build_reward(cfg.reward, cfg.model).scorers[0].scorer
    snapshot = offline_hub / "hub" / f"models--{RM.replace('/', '--')}" / "snapshots" / COMMIT
    direct = load_score_model(str(snapshot))
    with torch.no_grad():
        expected = direct.eval()(input_ids=torch.tensor([[5, 6, 7]])).logits[0, 0].item()
    assert scorer.model.dtype == torch.float32  # auto on the CPU
    assert scorer.model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, 0].item() == pytest.approx(expected)


def test_without_allow_hub_a_hub_reward_model_is_refused_saying_which_switch(offline_hub):
    cfg = load_config(["configs/tiny.yaml"], [f"reward.scorers=[{{kind: model, path: {RM}}}]"])
    with pytest.raises(Exception, match="set `model.allow_hub=true`"):
        build_reward(cfg.reward, cfg.model)


def test_a_reward_model_loads_in_its_dtype_and_auto_is_bf16_on_a_gpu(offline_hub):
    cfg = hub_run(f"reward.scorers=[{{kind: model, path: {RM}, dtype: bfloat16}}]", "reward.device=cpu")
    assert build_reward(cfg.reward, cfg.model).scorers[0].scorer.model.dtype == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("float16", torch.device("cpu")) == "float16"


def test_ppo_value_model_from_a_hub_reward_model_keeps_its_revision_and_the_hub_switch(offline_hub):
    cfg = hub_run("learner.algorithm=ppo", "learner.ppo.value_init=reward_model",
                  f"reward.scorers=[{{kind: model, path: {RM}, revision: {COMMIT}}}]")
    source = value_source(cfg)
    assert (source.name_or_path, source.revision, source.allow_hub) == (RM, COMMIT, True)
    assert sum(p.numel() for p in load_score_model(source).parameters()) > 0


def test_up_refuses_a_reward_model_it_cannot_find_naming_its_key():
    cfg = load_config(["configs/tiny.yaml"], ["reward.scorers=[{kind: rule, name: sentiment}, "
                                              "{kind: model, path: /no/such/rm}]"])
    assert prepare_models(cfg, ["configs/tiny.yaml"]) == (
        "reward.scorers[1].path: model path /no/such/rm does not exist; use a local HF directory, a .gguf "
        "file, or one of: tiny, smollm2-135m-instruct")
