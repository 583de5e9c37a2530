"""`learner` is a union on `learner.algorithm`: the data picks the member, each algorithm reads its own
section, and a knob of another algorithm, or a key of the old flat section, fails naming where it lives."""

import pytest

from asyncrlhf.config import (
    BestOfNLearnerConfig,
    Config,
    ConfigError,
    OnlineDPOLearnerConfig,
    PolicyGradientLearnerConfig,
    PPOLearnerConfig,
    load_config,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "algorithm, member",
    [
        ("online_dpo", OnlineDPOLearnerConfig),
        ("ppo", PPOLearnerConfig),
        ("rloo", PolicyGradientLearnerConfig),
        ("grpo", PolicyGradientLearnerConfig),
        ("dr_grpo", PolicyGradientLearnerConfig),
        ("reinforce_pp", PolicyGradientLearnerConfig),
        ("best_of_n", BestOfNLearnerConfig),
    ],
)
def test_the_algorithm_picks_the_member(algorithm, member):
    learner = load_config(["configs/tiny.yaml"], [f"learner.algorithm={algorithm}"]).learner
    assert type(learner) is member and learner.algorithm == algorithm


def test_without_an_algorithm_the_learner_is_online_dpo():
    assert type(load_config([], ["learner.lr=1e-5"]).learner) is OnlineDPOLearnerConfig
    assert type(Config().learner) is OnlineDPOLearnerConfig


def test_each_algorithm_reads_its_own_section():
    dpo = load_config([], ["learner.online_dpo.beta=0.2", "learner.online_dpo.loss_type=ipo"]).learner
    assert isinstance(dpo, OnlineDPOLearnerConfig)
    section = dpo.online_dpo
    assert (section.beta, section.loss_type, section.label_smoothing) == (0.2, "ipo", 0.0)
    ppo = load_config([], ["learner.algorithm=ppo", "learner.ppo.epochs=2", "learner.kl.coef=0.1"]).learner
    assert isinstance(ppo, PPOLearnerConfig) and (ppo.ppo.epochs, ppo.kl.coef) == (2, 0.1)
    grpo = load_config([], ["learner.algorithm=grpo", "learner.policy_gradient.clip_eps=0.3"]).learner
    assert isinstance(grpo, PolicyGradientLearnerConfig) and grpo.policy_gradient.clip_eps == 0.3


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["learner.algorithm=ppo", "learner.beta=0.2"],
         ["`learner.beta` is online DPO's", "`learner.online_dpo.beta`", "`learner.algorithm` is `ppo`",
          "PPO's KL weight lives in `learner.kl.coef`"]),
        (["learner.algorithm=grpo", "learner.beta=0.2"],
         ["`learner.beta` is online DPO's", "KL weight lives in `learner.kl.coef`"]),
        (["learner.algorithm=ppo", "learner.clip_eps=0.3"],
         ["`learner.policy_gradient.clip_eps`", "PPO's clip is `learner.ppo.clip_eps`"]),
        (["learner.algorithm=ppo", "learner.online_dpo.beta=0.2"],
         ["`learner.online_dpo` belongs to `algorithm: online_dpo`", "`learner.algorithm` is `ppo`"]),
        (["learner.ppo.epochs=2"],
         ["`learner.ppo` belongs to `algorithm: ppo`", "`learner.algorithm` is `online_dpo`"]),
        (["learner.algorithm=rloo", "learner.ppo.vf_coef=1"], ["`learner.ppo` belongs to `algorithm: ppo`"]),
        (["learner.algorithm=ppo", "learner.policy_gradient.clip_eps=0.3"],
         ["`learner.policy_gradient` belongs to `algorithm: rloo | grpo | dr_grpo | reinforce_pp`"]),
        (["learner.algorithm=best_of_n", "learner.online_dpo.beta=0.2"],
         ["`learner.online_dpo` belongs to `algorithm: online_dpo`", "is `best_of_n`"]),
    ],
)
def test_another_algorithms_knob_fails_naming_it(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(["configs/tiny.yaml"], overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "algorithm, old, new",
    [
        ("online_dpo", "beta", "online_dpo.beta"),
        ("online_dpo", "dpo_loss_type", "online_dpo.loss_type"),
        ("online_dpo", "label_smoothing", "online_dpo.label_smoothing"),
        ("grpo", "clip_eps", "policy_gradient.clip_eps"),
        ("reinforce_pp", "clip_eps", "policy_gradient.clip_eps"),
    ],
)
def test_an_old_flat_key_names_its_new_place(algorithm, old, new):
    with pytest.raises(ConfigError, match=f"`learner.{old}` is .*, now `learner.{new}`; move it there"):
        load_config([], [f"learner.algorithm={algorithm}", f"learner.{old}=0.1"])


def test_a_file_written_before_the_union_fails_naming_the_new_place(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("learner:\n  algorithm: online_dpo\n  lr: 5.0e-4\n  beta: 0.1\n")
    with pytest.raises(ConfigError, match="`learner.online_dpo.beta`"):
        load_config([old])


def test_controlled_staleness_needs_a_push_every_step():
    cfg = load_config(["configs/tiny.yaml"], ["learner.staleness_mode=exact", "learner.max_staleness=2"])
    assert cfg.learner.staleness_mode == "exact"
    with pytest.raises(ConfigError, match="set learner.sync_every=1"):
        load_config(["configs/tiny.yaml"], ["learner.staleness_mode=paper", "learner.sync_every=2"])
    with pytest.raises(ConfigError, match="staleness_mode"):
        load_config(["configs/tiny.yaml"], ["learner.staleness_mode=exactly"])


def test_dynamic_sampling_refuses_ppo_and_the_controlled_staleness_modes_saying_why():
    with pytest.raises(ConfigError, match="PPO's advantages come from its value model"):
        load_config(["configs/tiny.yaml"], ["learner.algorithm=ppo", "learner.dynamic_sampling.enabled=true"])
    with pytest.raises(ConfigError, match="use staleness_mode=bound"):
        load_config(["configs/tiny.yaml"], ["learner.staleness_mode=exact",
                                            "learner.dynamic_sampling.enabled=true"])
    cfg = load_config(["configs/tiny.yaml"], ["learner.algorithm=rloo",
                                              "learner.dynamic_sampling.enabled=true"])
    assert cfg.learner.dynamic_sampling.refill_cap == 3.0


def test_delta_pushes_need_full_fine_tuning_saying_why():
    with pytest.raises(ConfigError, match="only the adapters are pushed.*learner.lora.enabled=false"):
        load_config(["configs/tiny.yaml"], ["learner.push_delta=true", "learner.lora.enabled=true"])
    assert load_config(["configs/tiny.yaml"], ["learner.push_delta=true"]).learner.push_delta
