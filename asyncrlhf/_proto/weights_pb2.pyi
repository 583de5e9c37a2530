from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType

class WeightChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "offset", "data", "checksum", "commit", "tensor_count", "partial", "lineage", "shm_segment", "shm_offset", "relay_targets", "relay_fanout", "data_ticket", "collective", "delta", "keep_base")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RELAY_TARGETS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FANOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    KEEP_BASE_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    checksum: int
    commit: bool
    tensor_count: int
    partial: bool
    lineage: int
    shm_segment: str
    shm_offset: int
    relay_targets: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    relay_fanout: int
    data_ticket: bytes
    collective: CollectiveSlot
    delta: TensorDelta
    keep_base: bool
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., commit: _Optional[bool] = ..., tensor_count: _Optional[int] = ..., partial: _Optional[bool] = ..., lineage: _Optional[int] = ..., shm_segment: _Optional[str] = ..., shm_offset: _Optional[int] = ..., relay_targets: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ..., relay_fanout: _Optional[int] = ..., data_ticket: _Optional[bytes] = ..., collective: _Optional[_Union[CollectiveSlot, _Mapping]] = ..., delta: _Optional[_Union[TensorDelta, _Mapping]] = ..., keep_base: _Optional[bool] = ...) -> None: ...

class CollectiveSlot(_message.Message):
    __slots__ = ("store", "group", "rank", "world_size", "backend", "timeout_ms", "round", "bucket_bytes", "bucket", "bucket_offset", "bucket_checksum")
    STORE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    store: str
    group: bytes
    rank: int
    world_size: int
    backend: str
    timeout_ms: int
    round: int
    bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    bucket: int
    bucket_offset: int
    bucket_checksum: int
    def __init__(self, store: _Optional[str] = ..., group: _Optional[bytes] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., round: _Optional[int] = ..., bucket_bytes: _Optional[_Iterable[int]] = ..., bucket: _Optional[int] = ..., bucket_offset: _Optional[int] = ..., bucket_checksum: _Optional[int] = ...) -> None: ...

class TensorDelta(_message.Message):
    __slots__ = ("elements", "base_lineage", "base_version")
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    BASE_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    elements: int
    base_lineage: int
    base_version: int
    def __init__(self, elements: _Optional[int] = ..., base_lineage: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class RelayTarget(_message.Message):
    __slots__ = ("id", "address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version", "tensor_count", "bytes", "apply_seconds", "lineage")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor_count: int
    bytes: int
    apply_seconds: float
    lineage: int
    def __init__(self, version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., bytes: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., lineage: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusReply(_message.Message):
    __slots__ = ("version", "updated_at", "tensor_count", "lineage", "shm_host", "relaying", "data_port", "collective_backends")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_FIELD_NUMBER: _ClassVar[int]
    RELAYING_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    updated_at: float
    tensor_count: int
    lineage: int
    shm_host: str
    relaying: bool
    data_port: int
    collective_backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., updated_at: _Optional[float] = ..., tensor_count: _Optional[int] = ..., lineage: _Optional[int] = ..., shm_host: _Optional[str] = ..., relaying: _Optional[bool] = ..., data_port: _Optional[int] = ..., collective_backends: _Optional[_Iterable[str]] = ...) -> None: ...
