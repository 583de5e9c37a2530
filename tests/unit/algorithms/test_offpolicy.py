import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import (
    StalenessDecision,
    decoupled_ppo_loss,
    generates,
    generating_version,
    importance_weights,
    ppo_policy_loss,
    staleness_decision,
    with_rollout_correction,
)

pytestmark = pytest.mark.unit

# ratios π / μ = 1/2, 3/1, 1/1
CURRENT = torch.log(torch.tensor([[1.0, 3.0, 1.0]]))
BEHAVIOUR = torch.log(torch.tensor([[2.0, 1.0, 1.0]]))


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("is", [0.5, 3.0, 1.0]),
        ("tis", [0.5, 2.0, 1.0]),  # min(r, 2)
        ("mis", [0.5, 0.0, 1.0]),  # r > 2 is dropped
    ],
)
def test_importance_weights_hand_computed(kind, expected):
    weights = importance_weights(CURRENT.clone().requires_grad_(True), BEHAVIOUR, kind, cap=2.0)
    assert_close(weights, torch.tensor([expected]))
    assert not weights.requires_grad


@pytest.mark.parametrize("kind", ["is", "tis", "mis"])
def test_importance_weights_exactly_one_on_policy(kind):
    logprobs = -5 * torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(importance_weights(logprobs, logprobs.clone(), kind), torch.ones(4, 6))


def test_unknown_importance_kind():
    with pytest.raises(ValueError, match="valid options: 'is', 'tis', 'mis'"):
        importance_weights(CURRENT, BEHAVIOUR, "vtrace")


def test_decoupled_ppo_reduces_to_ppo_when_behaviour_is_proximal():
    g = torch.Generator().manual_seed(0)
    proximal = -torch.rand(3, 5, generator=g)
    advantages = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    logprobs_a = (proximal + 0.3 * torch.randn(3, 5, generator=g)).requires_grad_(True)
    logprobs_b = logprobs_a.detach().clone().requires_grad_(True)
    weights = importance_weights(proximal, proximal.clone(), "tis")  # behaviour == proximal: all 1
    loss_a, _ = decoupled_ppo_loss(logprobs_a, proximal, weights, advantages, mask, 0.2)
    loss_b, _ = ppo_policy_loss(logprobs_b, proximal, advantages, mask, 0.2)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(logprobs_a.grad, logprobs_b.grad)


def test_decoupled_ppo_hand_computed():
    logprobs = torch.tensor([[0.0, math.log(1.5)]], requires_grad=True)
    proximal = torch.zeros(1, 2)
    behaviour = torch.tensor([[math.log(0.5), 0.0]])  # weights π_prox / μ = 2, 1
    weights = importance_weights(proximal, behaviour, "is")
    loss, stats = decoupled_ppo_loss(logprobs, proximal, weights, torch.ones(1, 2), torch.ones(1, 2), 0.2)
    # t0: r = 1 vs proximal, -1 * 2 = -2; t1: r = 1.5 clipped to 1.2, -1.2 * 1; mean (-2 - 1.2) / 2
    assert_close(loss, torch.tensor(-1.6))
    assert_close(stats["behaviour_weight"], torch.tensor(1.5))
    assert_close(stats["clip_fraction"], torch.tensor(0.5))
    loss.backward()
    # t0 is not clipped: it is 3x off the behaviour policy but on the proximal one; grad -A r w / 2 = -1
    assert_close(logprobs.grad, torch.tensor([[-1.0, 0.0]]))


def test_staleness_decision_within_the_bound_is_fresh_whatever_the_policy():
    # learner at version 10, bound 2: versions 10, 9, 8 are 0, 1, 2 old
    for version, age in ((10, 0), (9, 1), (8, 2)):
        for policy in ("drop", "keep", "tis", "decoupled"):
            assert staleness_decision(version, 10, 2, policy) == StalenessDecision(age, "fresh")


@pytest.mark.parametrize(
    ("policy", "action", "trained", "corrected"),
    [("drop", "drop", False, False), ("keep", "keep", True, False), ("tis", "correct", True, True),
     ("decoupled", "correct", True, True)],
)
def test_staleness_decision_beyond_the_bound_follows_the_policy(policy, action, trained, corrected):
    decision = staleness_decision(7, 10, 2, policy)  # 3 versions old, bound 2
    assert decision == StalenessDecision(3, action)
    assert (decision.trained, decision.corrected) == (trained, corrected)


def test_staleness_decision_on_policy_bound():
    assert staleness_decision(10, 10, 0, "drop").action == "fresh"
    assert staleness_decision(9, 10, 0, "drop").action == "drop"


def test_staleness_decision_rejects_negative_bound_and_unknown_policy():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        staleness_decision(1, 1, -1, "drop")
    with pytest.raises(ValueError, match="unknown stale_policy 'sometimes'"):
        staleness_decision(1, 5, 0, "sometimes")


def test_generating_version_exact_is_n_behind_after_the_warm_up():
    # N = 2: versions 1, 2, 3 train on the initial policy's groups (1), then v trains on v - 2's
    assert [generating_version(v, 2, "exact") for v in range(1, 8)] == [1, 1, 1, 2, 3, 4, 5]
    # N = 0: the synchronous run, every version trains on its own groups
    assert [generating_version(v, 0, "exact") for v in range(1, 5)] == [1, 2, 3, 4]


def test_generating_version_paper_cycles_of_n_plus_one_batches():
    # N = 2 (the paper's N = 3): version 1 generates for 1, 2, 3 (staleness 0, 1, 2); version 4 for 4, 5, 6
    assert [generating_version(v, 2, "paper") for v in range(1, 8)] == [1, 1, 1, 4, 4, 4, 7]
    assert [generating_version(v, 0, "paper") for v in range(1, 5)] == [1, 2, 3, 4]


def test_generates_says_which_versions_sample():
    assert all(generates(v, 2, "exact") for v in range(1, 8))
    assert [v for v in range(1, 9) if generates(v, 2, "paper")] == [1, 4, 7]


def test_generating_version_rejects_the_bound_mode_and_bad_versions():
    with pytest.raises(ValueError, match="use exact or paper"):
        generating_version(3, 1, "bound")
    with pytest.raises(ValueError, match="trained_at >= 1"):
        generating_version(0, 1, "exact")


def test_a_group_spanning_versions_is_judged_on_its_oldest_token_and_corrected_per_token():
    # learner at 10, bound 2: tokens of 10 - 2 = 8 or newer are fresh; the group's oldest token (6) is 4 old
    decision = staleness_decision(6, 10, 2, "tis", newest=9)
    assert decision == StalenessDecision(4, "correct", fresh_from=8)
    assert [decision.corrects(v) for v in (6, 7, 8, 9, 10)] == [True, True, False, False, False]
    # every token beyond the bound (newest 7 < 8): one judgement for all, as in batch mode
    assert staleness_decision(6, 10, 2, "tis", newest=7) == StalenessDecision(4, "correct")
    # within the bound, or dropped: nothing per token
    assert staleness_decision(8, 10, 2, "tis", newest=10) == StalenessDecision(2, "fresh")
    assert staleness_decision(6, 10, 2, "drop", newest=9) == StalenessDecision(4, "drop")
    # "keep" trains every token as is, whichever side of the bound
    assert not staleness_decision(6, 10, 2, "keep", newest=9).corrects(6)


# The rollout correction composed with the staleness correction, by hand. Four tokens with ratios
# π_prox / μ = 0.5, 3, 1.5, 2.5; the staleness correction weights tokens 1 and 2 only.
RATIOS = torch.tensor([0.5, 3.0, 1.5, 2.5])
PROXIMAL, MU = torch.zeros(4), -torch.log(RATIOS)
STALE = torch.tensor([False, True, True, False])


def stale_weights(kind: str) -> torch.Tensor:
    """The staleness correction's weights as the objectives compute them: μ replaced by π_prox off STALE."""
    return importance_weights(PROXIMAL, torch.where(STALE, MU, PROXIMAL), kind, cap=2.0)


@pytest.mark.parametrize(
    "stale_kind, rollout, cap, expected",
    [
        ("tis", "none", 2.0, [1.0, 2.0, 1.5, 1.0]),  # the staleness weights alone: min(r, 2) on 1 and 2
        ("tis", "tis", 2.0, [0.5, 2.0, 1.5, 2.0]),  # every token min(r, 2); 1.5 is not squared to 2.25
        ("tis", "mis", 2.0, [0.5, 0.0, 1.5, 0.0]),  # r > 2 masked, the stale token 1 too (min(2, 0))
        ("mis", "tis", 4.0, [0.5, 0.0, 1.5, 2.5]),  # decoupled masks token 1 (3 > 2); 4 truncates nothing
        ("tis", "tis", 1.2, [0.5, 1.2, 1.2, 1.2]),  # the lower cap wins on the stale tokens
    ],
)
def test_the_rollout_correction_composes_with_the_staleness_weights(stale_kind, rollout, cap, expected):
    weights = with_rollout_correction(stale_weights(stale_kind), STALE, PROXIMAL, MU, rollout, cap)
    assert_close(weights, torch.tensor(expected))


def test_with_rollout_correction_none_the_staleness_weights_pass_through_unchanged():
    stale = stale_weights("tis")
    assert with_rollout_correction(stale, STALE, PROXIMAL, MU, "none") is stale
