import pytest

from asyncrlhf._proto.rollout_pb2 import (
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    PromptGroup,
    RolloutGroup,
    Sample,
)
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.training.batch import TrainGroup, build_batch

pytestmark = pytest.mark.unit


def group(gid, prompt, completions, version=1):
    samples = [Sample(completion_token_ids=c, logprobs=[-0.5 * (j + 1)] * len(c),
                      finish_reason=FINISH_REASON_STOP if j == 0 else FINISH_REASON_LENGTH, reward=float(j))
               for j, c in enumerate(completions)]
    return RolloutGroup(group_id=gid, prompt=PromptGroup(prompt_token_ids=prompt), samples=samples,
                        policy_version=version)


def test_prompts_left_padded_completions_aligned_at_one_column():
    stale = StalenessDecision(2, "correct")
    batch = build_batch([TrainGroup(group("a", [5, 6], [[7], [8, 9, 10]])),
                         TrainGroup(group("b", [4, 5, 6], [[11, 12], [13]], version=3), stale)], pad_id=0)
    # P = 3 (longest prompt), T = 3 (longest completion)
    assert batch.input_ids.tolist() == [
        [0, 5, 6, 7, 0, 0],
        [0, 5, 6, 8, 9, 10],
        [4, 5, 6, 11, 12, 0],
        [4, 5, 6, 13, 0, 0],
    ]
    assert batch.mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert batch.labels.tolist() == [[7, 0, 0], [8, 9, 10], [11, 12, 0], [13, 0, 0]]
    # positions count real tokens: the padded row starts at 0 on its first real token
    assert batch.position_ids[0].tolist() == [0, 0, 1, 2, 2, 2]
    assert batch.behaviour_logps[1].tolist() == [-1.0, -1.0, -1.0]
    assert batch.versions.tolist() == [1, 1, 3, 3] and batch.group.tolist() == [0, 0, 1, 1]
    assert batch.eos.tolist() == [True, False, True, False]
    assert batch.corrected.tolist() == [False, False, True, True]
    assert batch.scores_by_group().tolist() == [[0.0, 1.0], [0.0, 1.0]]
    picked = batch.rows([3, 0])
    assert picked.input_ids[0].tolist() == [4, 5, 6, 13, 0, 0] and picked.scores.tolist() == [1.0, 0.0]


def test_groups_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="same number of samples"):
        build_batch([TrainGroup(group("a", [5], [[7], [8]])), TrainGroup(group("b", [5], [[7]]))], pad_id=0)


def test_an_episodes_turn_rewards_sit_at_each_turns_last_model_token():
    # turn 1: tokens 0-1; observation 2-3 (masked); turn 2: 4-5; the steps rewarded 0.5 and 1.0
    episode = Sample(completion_token_ids=[11, 12, 13, 14, 15, 16], logprobs=[-1.0] * 6,
                     loss_mask=[1, 1, 0, 0, 1, 1], turn_ends=[2, 6], turn_rewards=[0.5, 1.0], reward=1.5)
    single = Sample(completion_token_ids=[11, 12], logprobs=[-1.0] * 2, reward=0.0)
    rows = build_batch([TrainGroup(RolloutGroup(group_id="g", prompt=PromptGroup(prompt_token_ids=[1]),
                                                samples=[episode, single], policy_version=1))], pad_id=0)
    assert rows.turn_rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 1.0], [0.0] * 6]


@pytest.mark.parametrize("ends, rewards", [([3], [1.0]), ([7], [1.0]), ([2], [1.0, 2.0])],
                         ids=["at-an-environment-token", "past-the-end", "more-rewards-than-turns"])
def test_turn_ends_that_do_not_fit_the_model_tokens_are_refused(ends, rewards):
    from asyncrlhf.training.batch import validate_group

    episode = Sample(completion_token_ids=[11, 12, 13, 14, 15, 16], logprobs=[-1.0] * 6,
                     loss_mask=[1, 1, 0, 0, 1, 1], turn_ends=ends, turn_rewards=rewards, reward=1.0)
    group = RolloutGroup(group_id="g", prompt=PromptGroup(prompt_token_ids=[1]), samples=[episode])
    assert "turn ends" in validate_group(group, 1)
