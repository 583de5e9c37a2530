"""Each algorithm trains for a few steps on fixed scored groups and moves its objective the right way
(real DeepSpeed on CPU, tiny model)."""

import math

import pytest
import torch

from asyncrlhf import algorithms as A
from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.models import ReferencePolicy, load_policy, load_score_model
from asyncrlhf.training import engine
from asyncrlhf.training.batch import build_batch
from asyncrlhf.training.objectives import make_objective
from asyncrlhf.training.policies import LearnerModels
from asyncrlhf.training.trainer import Trainer
from services.learner.metrics import LearnerMetrics, step_summary
from tests.integration.learner.groups import scored_groups, train_groups

pytestmark = pytest.mark.integration


def make_trainer(*overrides: str, lora: bool = False):
    cfg = load_config(["configs/tiny.yaml"], ["learner.lr=3e-3", "learner.micro_batch_size=4", *overrides,
                                              f"learner.lora.enabled={str(lora).lower()}"])
    engine.init_distributed()
    objective = make_objective(cfg)
    policy = engine.initialize(load_policy(cfg.model, lora=cfg.learner.lora), cfg.learner)
    reference = ReferencePolicy(policy.module if lora else load_policy(cfg.model))
    value = engine.initialize(load_score_model(cfg.model), cfg.learner) if objective.needs_values else None
    return Trainer(cfg, LearnerModels(policy, reference, value), objective=objective, pad_id=0), policy


def sequence_logps(model, groups):
    """Computed independently of the trainer: full logits, then the columns that predict completions."""
    batch = build_batch(train_groups(groups), pad_id=0)
    width = batch.completion_width
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, -width - 1 : -1]
    return A.sequence_logprobs(A.token_logprobs(logits, batch.labels), batch.mask).view(len(groups), -1)


def test_online_dpo_raises_the_chosen_minus_rejected_log_ratio():
    trainer, policy = make_trainer("learner.algorithm=online_dpo", "learner.online_dpo.beta=0.1")
    groups = scored_groups(4, 2)  # sample 1 is chosen (reward 1 > 0)
    ref = sequence_logps(trainer.reference, groups)

    def margin() -> torch.Tensor:  # chosen minus rejected log-ratio against the reference
        ratio = sequence_logps(policy, groups) - ref
        return (ratio[:, 1] - ratio[:, 0]).mean()

    assert abs(float(margin())) < 1e-5  # policy == reference at start
    losses, kls, expected_kls = [], [], []
    for _ in range(4):
        expected_kls.append(float((sequence_logps(policy, groups) - ref).mean()))  # before the update
        stats = trainer.train_step(train_groups(groups))
        losses.append(stats["loss"])
        kls.append(float(stats["kl"]))
    assert float(margin()) > 0.5
    assert losses[-1] < losses[0]
    # the reported KL is the mean sequence log-ratio to the reference of the trained completions
    assert kls[0] == pytest.approx(0.0, abs=1e-5) and abs(kls[-1]) > 1e-3
    assert kls == pytest.approx(expected_kls, abs=1e-4)


def test_online_dpo_skips_and_counts_ties():
    trainer, _ = make_trainer("learner.algorithm=online_dpo")
    groups = scored_groups(3, 2, rewards=[[1.0, 1.0], [0.0, 2.0], [3.0, 3.0]])
    stats = trainer.train_step(train_groups(groups))
    assert (stats["pairs"], stats["ties_skipped"]) == (1.0, 2.0)
    assert trainer.train_step(train_groups(scored_groups(1, 2, rewards=[[1.0, 1.0]])))["skipped_step"] == 1.0


def test_a_step_where_every_pair_ties_logs_why_and_is_counted_never_nan():
    trainer, _ = make_trainer("learner.algorithm=online_dpo")
    tied = train_groups(scored_groups(2, 2, rewards=[[1.0, 1.0], [0.5, 0.5]]))
    stats = trainer.train_step(tied)
    assert step_summary(stats) == "skipped: all pairs tied (ties: 2)"
    metrics = LearnerMetrics()
    metrics.record_step(stats, tied, version=1)
    count = metrics.registry.get_sample_value(names.LEARNER_SKIPPED_STEPS_TOTAL, {"reason": "all_pairs_tied"})
    assert count == 1.0
    trained = trainer.train_step(train_groups(scored_groups(1, 2)))
    summary = step_summary(trained)
    assert summary.startswith("loss ") and "nan" not in summary


@pytest.mark.parametrize("algorithm", ["rloo", "grpo", "dr_grpo", "reinforce_pp"])
def test_policy_gradient_family_raises_the_best_sample(algorithm):
    trainer, policy = make_trainer(f"learner.algorithm={algorithm}", "learner.kl.coef=0.0")
    groups = scored_groups(4, 3)  # sample 2 best, sample 0 worst
    before = sequence_logps(policy, groups)
    for _ in range(3):
        trainer.train_step(train_groups(groups))
    gain = sequence_logps(policy, groups) - before
    assert (gain[:, 2] - gain[:, 0]).mean() > 0.3


def test_best_of_n_lowers_the_nll_of_the_best_sample():
    trainer, policy = make_trainer("learner.algorithm=best_of_n")
    groups = scored_groups(4, 3)
    before = sequence_logps(policy, groups)[:, 2]
    nll = [trainer.train_step(train_groups(groups))["nll"] for _ in range(3)]
    assert (sequence_logps(policy, groups)[:, 2] - before).mean() > 0.5
    assert nll[-1] < nll[0]


def test_ppo_value_loss_falls_on_a_fixed_batch():
    trainer, _ = make_trainer("learner.algorithm=ppo", "learner.ppo.epochs=2", "learner.ppo.minibatches=2",
                              "learner.ppo.vf_coef=1.0")
    groups = scored_groups(4, 2)
    value_losses = [trainer.train_step(train_groups(groups))["value_loss"] for _ in range(4)]
    assert value_losses[-1] < 0.5 * value_losses[0]


def test_lora_trains_only_the_adapter():
    trainer, policy = make_trainer("learner.algorithm=online_dpo", lora=True)
    frozen = {n: p.detach().clone() for n, p in policy.module.named_parameters() if "lora_" not in n}
    trainer.train_step(train_groups(scored_groups(4, 2)))
    for name, p in policy.module.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, frozen[name]), name
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in policy.module.named_parameters())


def test_stale_groups_with_tis_are_trained_with_capped_weights():
    trainer, _ = make_trainer("learner.algorithm=rloo", "learner.stale_policy=tis", "learner.tis_cap=1.5",
                              "learner.kl.coef=0.0")
    # behaviour log-probs of -20 per token make pi/mu huge: every weight must be clamped to the cap
    groups = scored_groups(2, 2, logprob=-20.0)
    stats = trainer.train_step(train_groups(groups, corrected=[True, False]))
    assert 1.0 < stats["behaviour_weight"] <= 1.5
    fresh = trainer.train_step(train_groups(groups))
    assert fresh["behaviour_weight"] == pytest.approx(1.0)


def test_zero3_trains_and_gathers_full_weights_to_push():
    trainer, policy = make_trainer("learner.algorithm=online_dpo", "learner.deepspeed.zero_stage=3")
    groups = scored_groups(4, 2)
    before = engine.full_state_dict(policy.module, 3, only_adapters=False)
    trainer.train_step(train_groups(groups))
    after = engine.full_state_dict(policy.module, 3, only_adapters=False)
    reference = load_policy("tiny").state_dict()
    assert {n: t.shape for n, t in after.items()} == {n: t.shape for n, t in reference.items()}
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the step changed the gathered weights


@pytest.mark.parametrize("algorithm", ["rloo", "online_dpo"])
def test_each_step_measures_the_mismatch_of_its_fresh_tokens_against_the_pre_update_policy(algorithm):
    """rloo reads pi_old from its frozen pass, online DPO (no frozen pass of the policy) from its update pass:
    both give the mismatch of the fresh tokens' recorded log-probs against the policy before the step; the
    group one version old is not measured."""
    trainer, policy = make_trainer(f"learner.algorithm={algorithm}", "learner.kl.coef=0.0")
    groups = scored_groups(3, 2, logprob=-6.0)
    admitted = train_groups(groups, corrected=[False, True, False]) if algorithm == "rloo" \
        else train_groups(groups)  # a corrected group would give online DPO a frozen pass
    fresh = [groups[0], groups[2]] if algorithm == "rloo" else groups
    batch = build_batch(train_groups(fresh), pad_id=0)
    with torch.no_grad():  # the policy's log-probs before the step, computed apart from the trainer
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids).logits[:, -batch.completion_width - 1 : -1]
    delta = (A.token_logprobs(logits, batch.labels) + 6.0)[batch.mask.bool()]
    stats = trainer.train_step(admitted)
    assert stats["mismatch_tokens"] == delta.numel()
    assert stats["mismatch_abs_log_ratio_mean"] == pytest.approx(float(delta.abs().mean()), abs=1e-4)
    assert stats["mismatch_abs_log_ratio_max"] == pytest.approx(float(delta.abs().max()), abs=1e-4)
    assert stats["mismatch_kl"] == pytest.approx(float((delta.exp() - 1 - delta).mean()), rel=1e-4)
    outside = (delta.abs() > math.log(2.0)).float().mean()  # the ratio outside [1/2, 2]
    assert stats["mismatch_outside_share"] == pytest.approx(float(outside))
    metrics = LearnerMetrics()
    metrics.record_step(stats, admitted, version=2)
    sample = metrics.registry.get_sample_value
    assert sample(names.LEARNER_MISMATCH_TOKENS_TOTAL) == delta.numel()
    assert sample(names.LEARNER_MISMATCH_ABS_LOG_RATIO, {"stat": "max"}) == \
        stats["mismatch_abs_log_ratio_max"]
    assert sample(names.LEARNER_MISMATCH_KL) == stats["mismatch_kl"]


def test_the_rollout_correction_weighs_fresh_pairs_of_online_dpo():
    """Online DPO has no frozen pass of the policy: the rollout correction adds one. Behaviour log-probs of
    -20 per token make every pair's ratio pi_old / mu huge, so each pair weighs the cap: the first step's loss
    is twice the uncorrected one (the same initial weights and groups)."""
    groups = train_groups(scored_groups(2, 2, logprob=-20.0))
    plain, _ = make_trainer("learner.algorithm=online_dpo")
    corrected, _ = make_trainer("learner.algorithm=online_dpo", "learner.rollout_correction=tis",
                                "learner.rollout_correction_cap=2.0")
    uncorrected = plain.train_step(groups)["loss"]
    assert corrected.train_step(groups)["loss"] == pytest.approx(2 * uncorrected, rel=1e-5)
