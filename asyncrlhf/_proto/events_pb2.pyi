from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_POLICY_VERSION: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT_SAVED: _ClassVar[EventKind]
    EVENT_KIND_GROUPS_TRAINED: _ClassVar[EventKind]
    EVENT_KIND_GROUPS_DROPPED: _ClassVar[EventKind]
    EVENT_KIND_RUN_FINISHED: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_POLICY_VERSION: EventKind
EVENT_KIND_CHECKPOINT_SAVED: EventKind
EVENT_KIND_GROUPS_TRAINED: EventKind
EVENT_KIND_GROUPS_DROPPED: EventKind
EVENT_KIND_RUN_FINISHED: EventKind

class Event(_message.Message):
    __slots__ = ("event_id", "kind", "policy_version", "timestamp", "source", "checkpoint_path", "group_ids", "detail", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    kind: EventKind
    policy_version: int
    timestamp: float
    source: str
    checkpoint_path: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    detail: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, event_id: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., policy_version: _Optional[int] = ..., timestamp: _Optional[float] = ..., source: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., detail: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...
