from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "prompt", "prompt_token_ids", "k", "enqueued_at", "learner_version", "dataset_index", "epoch", "lineage", "reference", "partial_samples", "partial_lineage", "handoffs")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATASET_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    enqueued_at: float
    learner_version: int
    dataset_index: int
    epoch: int
    lineage: int
    reference: str
    partial_samples: _containers.RepeatedCompositeFieldContainer[Sample]
    partial_lineage: int
    handoffs: int
    def __init__(self, group_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., enqueued_at: _Optional[float] = ..., learner_version: _Optional[int] = ..., dataset_index: _Optional[int] = ..., epoch: _Optional[int] = ..., lineage: _Optional[int] = ..., reference: _Optional[str] = ..., partial_samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., partial_lineage: _Optional[int] = ..., handoffs: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("completion_token_ids", "logprobs", "finish_reason", "text", "reward", "reward_components", "token_versions", "continued_from", "loss_mask", "env_reward", "turns", "episode_end", "turn_ends", "turn_rewards", "episode_context_ids")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FROM_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ENV_REWARD_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_END_FIELD_NUMBER: _ClassVar[int]
    TURN_ENDS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    text: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    continued_from: int
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    env_reward: float
    turns: int
    episode_end: str
    turn_ends: _containers.RepeatedScalarFieldContainer[int]
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    episode_context_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, completion_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., continued_from: _Optional[int] = ..., loss_mask: _Optional[_Iterable[int]] = ..., env_reward: _Optional[float] = ..., turns: _Optional[int] = ..., episode_end: _Optional[str] = ..., turn_ends: _Optional[_Iterable[int]] = ..., turn_rewards: _Optional[_Iterable[float]] = ..., episode_context_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "prompt", "samples", "policy_version", "generator_id", "generation_started_at", "generated_at", "scored_at", "scorer_id", "lineage")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_FIELD_NUMBER: _ClassVar[int]
    SCORER_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt: PromptGroup
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    generator_id: str
    generation_started_at: float
    generated_at: float
    scored_at: float
    scorer_id: str
    lineage: int
    def __init__(self, group_id: _Optional[str] = ..., prompt: _Optional[_Union[PromptGroup, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., generator_id: _Optional[str] = ..., generation_started_at: _Optional[float] = ..., generated_at: _Optional[float] = ..., scored_at: _Optional[float] = ..., scorer_id: _Optional[str] = ..., lineage: _Optional[int] = ...) -> None: ...
