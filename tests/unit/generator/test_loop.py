import pytest

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup
from asyncrlhf.models import build_tiny_tokenizer
from asyncrlhf.sampling import Completion
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.version import PolicyVersion
from services.generator.loop import prompt_token_ids

pytestmark = pytest.mark.unit


def test_rollout_group_carries_identity_version_and_every_sample():
    prompt = PromptGroup(group_id="g1", prompt_token_ids=[5, 6], k=2)
    completions = [Completion([7, 2], [-0.5, -0.25], "stop"),
                   Completion([8, 9, 10], [-1.0, -2.0, -3.0], "length")]
    group = rollout_group(prompt, completions, version=PolicyVersion(0, 4), generator_id="gen-a",
                          started_at=10.0, generated_at=12.5, decode=lambda ids: ",".join(map(str, ids)))
    assert (group.group_id, group.policy_version, group.generator_id) == ("g1", 4, "gen-a")
    assert (group.generation_started_at, group.generated_at, group.prompt) == (10.0, 12.5, prompt)
    assert [list(s.completion_token_ids) for s in group.samples] == [[7, 2], [8, 9, 10]]
    assert [list(s.logprobs) for s in group.samples] == [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    assert [s.finish_reason for s in group.samples] == [FinishReason.FINISH_REASON_STOP,
                                                        FinishReason.FINISH_REASON_LENGTH]
    assert [s.text for s in group.samples] == ["7,2", "8,9,10"]
    assert not group.samples[0].HasField("reward")


def test_prompt_ids_come_from_the_group_else_from_its_text():
    tokenizer = build_tiny_tokenizer()
    assert prompt_token_ids(PromptGroup(group_id="a", prompt_token_ids=[3, 4]), tokenizer, 64) == [3, 4]
    # byte tokenizer: 3 specials, then the 256 bytes; "hey" is three tokens, left-truncated to the last two
    assert len(prompt_token_ids(PromptGroup(group_id="b", prompt="hey"), tokenizer, 2)) == 2
    with pytest.raises(ValueError, match="neither"):
        prompt_token_ids(PromptGroup(group_id="c"), tokenizer, 64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prompt_token_ids(PromptGroup(group_id="d", prompt_token_ids=[1, 259]), tokenizer, 64)
