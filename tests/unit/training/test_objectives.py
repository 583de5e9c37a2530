"""The off-policy correction per token, by hand-computed losses: a sample whose tokens span versions (its
first token sampled by an older policy than the learner's, beyond the bound, its second by the current one)
has only its first token importance-weighted; the same sample of one version is weighted on every token.
The rollout correction weights every token, fresh ones included, composed with the staleness weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.algorithms import staleness_decision
from asyncrlhf.config import load_config
from asyncrlhf.training.batch import SequenceBatch, TrainGroup, build_batch
from asyncrlhf.training.objectives import Totals, make_objective

pytestmark = pytest.mark.unit
LEARNER = 5  # the learner's version; max_staleness 0: a token of version 4 is beyond the bound
OLD = [[-1.0, -1.0], [-1.0, 0.0]]  # log pi_prox (pre-update) of each real token; 0 on padding
BEHAVIOUR = [[-1.5, -2.0], [-3.0]]  # log mu, recorded by the generator


def config(algorithm: str, stale_policy: str = "tis", rollout: str = "none", rollout_cap: float = 2.0):
    return load_config(["configs/tiny.yaml"], [f"learner.algorithm={algorithm}", "learner.max_staleness=0",
                                               f"learner.stale_policy={stale_policy}", "learner.tis_cap=2.0",
                                               "learner.kl.coef=0.0", f"learner.rollout_correction={rollout}",
                                               f"learner.rollout_correction_cap={rollout_cap}"])


def batch(token_versions: list[list[int]] | None, behaviour: list[list[float]] = BEHAVIOUR) -> SequenceBatch:
    """One group of two samples: sample 0 has two tokens, sample 1 one token. `token_versions` per sample
    (continuous mode), or None: every token sampled by version 4 (batch mode)."""
    versions = token_versions or [[], []]
    samples = [Sample(completion_token_ids=[7] * len(b), logprobs=b, reward=float(j), token_versions=v)
               for j, (b, v) in enumerate(zip(behaviour, versions, strict=True))]
    group = RolloutGroup(group_id="g00000000", prompt=PromptGroup(prompt_token_ids=[5, 6], k=2),
                         samples=samples, policy_version=4)
    newest = max(v for vs in versions for v in vs) if token_versions else None
    decision = staleness_decision(4, LEARNER, 0, "tis", newest=newest)
    rows = build_batch([TrainGroup(group, decision)], pad_id=0)
    return rows.with_extras(old_logps=torch.tensor(OLD), advantages=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
                            reward_kl=torch.zeros(2))


SPANNING = [[4, 5], [5]]  # sample 0: token 0 by version 4 (stale), token 1 by 5 (fresh); sample 1: fresh


def test_the_batch_carries_which_tokens_are_corrected_and_their_staleness():
    rows = batch(SPANNING)
    assert rows.corrected_tokens.tolist() == [[True, False], [False, False]]  # padding: False
    assert rows.token_staleness.tolist() == [[1, 0], [0, 0]]
    assert rows.fresh_tokens.tolist() == [[False, True], [True, False]]  # version 5 = the learner's; padding
    assert rows.corrected.tolist() == [True, True]  # the group's decision
    whole = batch(None)  # batch mode: version 4 for every token, all corrected
    assert whole.corrected_tokens.tolist() == [[True, True], [True, False]]
    assert whole.token_staleness.tolist() == [[1, 1], [1, 0]]
    assert not whole.fresh_tokens.any()


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_a_stale_token_is_weighted_and_a_fresh_one_is_not(algorithm):
    objective = make_objective(config(algorithm))
    logps = torch.tensor(OLD, requires_grad=True)  # pi_theta = pi_prox: ratio 1, no clipping
    rows = batch(SPANNING)
    if algorithm == "ppo":
        rows = rows.with_extras(old_values=torch.zeros(2, 2), returns=torch.zeros(2, 2))
    out = objective.loss(rows, logps, torch.zeros(2, 2), Totals(tokens=3, items=2))
    # token (0, 0), version 4: w = min(exp(-1.0 - -1.5), 2) = e^0.5 = 1.6487; tokens (0, 1) and (1, 0) are
    # version 5, fresh: mu replaced by pi_prox, w = exp(0) = 1. loss = -(A r w) summed / 3 tokens
    w = math.exp(0.5)
    assert_close(out.policy, torch.tensor(-(w + 1 + 1) / 3))
    assert_close(out.stats["behaviour_weight"], torch.tensor((w + 1 + 1) / 3))
    # batch mode, the same tokens all of version 4: token (0, 1) w = min(exp(-1 - -2), 2) = min(e, 2) = 2,
    # token (1, 0) w = min(exp(-1 - -3), 2) = 2
    whole = batch(None)
    if algorithm == "ppo":
        whole = whole.with_extras(old_values=torch.zeros(2, 2), returns=torch.zeros(2, 2))
    out = objective.loss(whole, logps, torch.zeros(2, 2), Totals(tokens=3, items=2))
    assert_close(out.policy, torch.tensor(-(w + 2 + 2) / 3))


def test_best_of_n_weights_only_the_stale_tokens_nll():
    objective = make_objective(config("best_of_n"))
    logps = torch.tensor(OLD)
    rows = batch(SPANNING)
    # -(log pi * w) over sample 0's tokens / 3: -(-1 * e^0.5 + -1 * 1) / 3, and sample 1's -(-1 * 1) / 3
    out = objective.loss(rows, logps, None, Totals(tokens=3, items=2))
    assert_close(out.policy, torch.tensor((math.exp(0.5) + 1 + 1) / 3))


def test_online_dpo_weighs_a_pair_by_the_ratio_over_its_corrected_tokens_only():
    objective = make_objective(config("online_dpo"))
    rows = batch(SPANNING)  # chosen = sample 0, rejected = sample 1 (rows in pair order)
    # only token (0, 0) is corrected: log ratio = -1.0 - -1.5 = 0.5, w = min(e^0.5, 2)
    assert_close(objective._pair_weights(rows), torch.tensor([math.exp(0.5)]))
    # batch mode: (-1 + -1) - (-1.5 + -2.0) + (-1) - (-3) = 1.5 + 2 = 3.5, w = min(e^3.5, 2) = 2
    assert_close(objective._pair_weights(batch(None)), torch.tensor([2.0]))


def test_decoupled_masks_a_stale_token_above_the_cap_and_never_a_fresh_one():
    objective = make_objective(config("rloo", "decoupled"))
    logps = torch.tensor([[-1.0, -1.0], [1.0, 0.0]])  # sample 1's token: pi_prox e^2 times mu, but fresh
    rows = batch([[4, 4], [5]]).with_extras(old_logps=logps)
    # token (0, 0): exp(0.5) <= 2 kept; token (0, 1): exp(-1 - -2) = e > 2, masked (w = 0); token (1, 0) of
    # version 5 is fresh: w = 1 although exp(1 - -3) = e^4 is far above the cap
    out = objective.loss(rows, logps, None, Totals(tokens=3, items=2))
    assert_close(out.policy, torch.tensor(-(math.exp(0.5) + 0 + 1) / 3))


def test_reinforce_pp_uses_per_turn_rewards_and_grpo_their_sum():
    """Two episodes of one prompt, tokens (turn 1, observation, turn 2): episode 0's first step rewarded 1.0
    (its score 1.0), episode 1's nothing (0.0). REINFORCE++ credits turn 1's reward to turn 1 only; GRPO gives
    every token of a sequence the same advantage, from the sequence's score (the sum)."""
    samples = [Sample(completion_token_ids=[7, 8, 9], logprobs=[-1.0] * 3, loss_mask=[1, 0, 1],
                      turn_ends=[1, 3], turn_rewards=rewards, reward=sum(rewards))
               for rewards in ([1.0, 0.0], [0.0, 0.0])]
    group = RolloutGroup(group_id="g00000000", prompt=PromptGroup(prompt_token_ids=[5, 6], k=2),
                         samples=samples, policy_version=5)
    rows = build_batch([TrainGroup(group)], pad_id=0)
    reinforce = make_objective(config("reinforce_pp")).prepare(rows).extras["advantages"]
    grpo = make_objective(config("grpo")).prepare(rows).extras["advantages"]
    # REINFORCE++-baseline: centred scores 0.5, -0.5; row 0 rewards (1.0, -, 0.5 - 1.0 = -0.5), returns
    # (0.5, -, -0.5); row 1 (0, -, -0.5), returns (-0.5, -, -0.5): whitened, turn 1 of episode 0 alone is up
    assert reinforce[0, 0] > 0 > reinforce[0, 2] and reinforce[0, 2] == pytest.approx(reinforce[1, 0].item())
    assert grpo[0, 0] == grpo[0, 2] > 0 > grpo[1, 0] == grpo[1, 2]


def policy_loss(algorithm: str, rows: SequenceBatch, *, logps=None, **correction) -> torch.Tensor:
    """The objective's loss on `rows` with pi_theta = pi_prox (ratio 1, nothing clipped), A = 1."""
    objective = make_objective(config(algorithm, **correction))
    if algorithm == "ppo":
        rows = rows.with_extras(old_values=torch.zeros(2, 2), returns=torch.zeros(2, 2))
    if algorithm == "online_dpo":
        rows = rows.with_extras(ref_logps=torch.tensor(OLD))
    logps = torch.tensor(OLD) if logps is None else logps
    return objective.loss(rows, logps, torch.zeros(2, 2), Totals(tokens=3, items=1)).policy


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_the_rollout_correction_weights_fresh_tokens_too(algorithm):
    rows = batch(SPANNING)
    # ratios pi_prox / mu: token (0, 0) e^0.5 (stale), (0, 1) e^1, (1, 0) e^2 (both fresh)
    # tis at 2: min(e^0.5, 2) = 1.6487 (the stale weight, the same ratio: not squared), min(e, 2), min(e^2, 2)
    tis = policy_loss(algorithm, rows, rollout="tis")
    assert_close(tis, torch.tensor(-(math.exp(0.5) + 2 + 2) / 3))
    # mis at 2: both fresh tokens are above it and masked (w = 0); the stale one keeps e^0.5
    assert_close(policy_loss(algorithm, rows, rollout="mis"), torch.tensor(-math.exp(0.5) / 3))
    # tis at 1.5: the lower cap wins on the stale token too: min(e^0.5, 2, 1.5) = 1.5
    assert_close(policy_loss(algorithm, rows, rollout="tis", rollout_cap=1.5), torch.tensor(-(1.5 * 3) / 3))
    # decoupled (mis at tis_cap 2) masks stale tokens above 2; tis at 3 then weighs the fresh e^1 fully
    whole = batch([[4, 4], [5]])  # token (0, 1) now stale at e^1 > 2: masked by the staleness correction
    decoupled = policy_loss(algorithm, whole, stale_policy="decoupled", rollout="tis", rollout_cap=3.0)
    assert_close(decoupled, torch.tensor(-(math.exp(0.5) + 0 + 3) / 3))  # (1, 0): min(e^2, 3) = 3


def test_best_of_n_weighs_every_tokens_nll_with_the_rollout_correction():
    rows = batch(SPANNING)
    # the loss of the rows it is given (both here): -(log pi * w) / 3 with log pi = -1, w = e^0.5, 2, 2
    out = policy_loss("best_of_n", rows, rollout="tis")
    assert_close(out, torch.tensor((math.exp(0.5) + 2 + 2) / 3))


def test_online_dpo_weighs_a_fresh_pair_by_its_whole_ratio_truncated():
    fresh = batch([[5, 5], [5]])  # nothing stale: without the rollout correction the weight is 1
    assert_close(make_objective(config("online_dpo"))._pair_weights(fresh), torch.tensor([1.0]))
    # log ratio over the pair: (-1 + -1 + -1) - (-1.5 + -2 + -3) = 3.5
    for rollout, cap, expected in (("tis", 2.0, 2.0), ("tis", 40.0, math.exp(3.5)), ("mis", 2.0, 0.0)):
        objective = make_objective(config("online_dpo", rollout=rollout, rollout_cap=cap))
        assert_close(objective._pair_weights(fresh), torch.tensor([expected]))
    # a stale pair: its corrected tokens' weight min(e^0.5, 2) is below the whole pair's min(e^3.5, 40)
    objective = make_objective(config("online_dpo", rollout="tis", rollout_cap=40.0))
    assert_close(objective._pair_weights(batch(SPANNING)), torch.tensor([math.exp(0.5)]))


@pytest.mark.parametrize("algorithm", ["rloo", "ppo", "best_of_n", "online_dpo"])
def test_without_the_rollout_correction_a_fresh_tokens_behaviour_log_prob_changes_nothing(algorithm):
    """The invariant that keeps `rollout_correction: none` the loss of before: only corrected tokens read
    mu, so any fresh token's recorded log-prob gives the bit-identical loss; the rollout correction reads
    every token's."""
    other = [[BEHAVIOUR[0][0], -0.5], [-0.25]]  # the stale token's mu kept, the fresh ones' changed
    same = policy_loss(algorithm, batch(SPANNING))
    assert torch.equal(policy_loss(algorithm, batch(SPANNING, other)), same)
    assert not torch.equal(policy_loss(algorithm, batch(SPANNING, other), rollout="tis", rollout_cap=40.0),
                           policy_loss(algorithm, batch(SPANNING), rollout="tis", rollout_cap=40.0))
