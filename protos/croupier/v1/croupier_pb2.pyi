from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATASET_KIND_UNSPECIFIED: _ClassVar[DatasetKind]
    DATASET_KIND_TABLE: _ClassVar[DatasetKind]
    DATASET_KIND_IMAGE: _ClassVar[DatasetKind]

class FetchOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FETCH_ORDER_UNORDERED: _ClassVar[FetchOrder]
    FETCH_ORDER_ORDERED: _ClassVar[FetchOrder]
DATASET_KIND_UNSPECIFIED: DatasetKind
DATASET_KIND_TABLE: DatasetKind
DATASET_KIND_IMAGE: DatasetKind
FETCH_ORDER_UNORDERED: FetchOrder
FETCH_ORDER_ORDERED: FetchOrder

class Column(_message.Message):
    __slots__ = ("name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "num_rows", "kind", "columns", "format", "path", "classes", "arrow_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    ARROW_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    kind: DatasetKind
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    format: str
    path: str
    classes: _containers.RepeatedScalarFieldContainer[str]
    arrow_schema: bytes
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., kind: _Optional[_Union[DatasetKind, str]] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., format: _Optional[str] = ..., path: _Optional[str] = ..., classes: _Optional[_Iterable[str]] = ..., arrow_schema: _Optional[bytes] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StreamEpochRequest(_message.Message):
    __slots__ = ("dataset", "seed", "epoch", "rank", "world_size", "batch_size", "drop_last", "start_batch", "order", "prefetch", "columns", "end_batch", "decode_images", "plan_position", "plan_delivered")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    END_BATCH_FIELD_NUMBER: _ClassVar[int]
    DECODE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PLAN_POSITION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    seed: int
    epoch: int
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    start_batch: int
    order: FetchOrder
    prefetch: int
    columns: _containers.RepeatedScalarFieldContainer[str]
    end_batch: int
    decode_images: bool
    plan_position: int
    plan_delivered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dataset: _Optional[str] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., batch_size: _Optional[int] = ..., drop_last: _Optional[bool] = ..., start_batch: _Optional[int] = ..., order: _Optional[_Union[FetchOrder, str]] = ..., prefetch: _Optional[int] = ..., columns: _Optional[_Iterable[str]] = ..., end_batch: _Optional[int] = ..., decode_images: _Optional[bool] = ..., plan_position: _Optional[int] = ..., plan_delivered: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("dataset", "epoch", "num_batches", "num_samples", "start_batch", "end_batch", "batch_size", "last_batch_size", "plan_position", "plan_delivered")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    END_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLAN_POSITION_FIELD_NUMBER: _ClassVar[int]
    PLAN_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    epoch: int
    num_batches: int
    num_samples: int
    start_batch: int
    end_batch: int
    batch_size: int
    last_batch_size: int
    plan_position: int
    plan_delivered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., epoch: _Optional[int] = ..., num_batches: _Optional[int] = ..., num_samples: _Optional[int] = ..., start_batch: _Optional[int] = ..., end_batch: _Optional[int] = ..., batch_size: _Optional[int] = ..., last_batch_size: _Optional[int] = ..., plan_position: _Optional[int] = ..., plan_delivered: _Optional[_Iterable[int]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "label", "format", "height", "width", "channels", "key")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    label: int
    format: str
    height: int
    width: int
    channels: int
    key: str
    def __init__(self, data: _Optional[bytes] = ..., label: _Optional[int] = ..., format: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("epoch", "batches", "positions", "indices", "padding", "arrow_ipc", "images", "completed_batches")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batches: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    padding: _containers.RepeatedScalarFieldContainer[bool]
    arrow_ipc: bytes
    images: _containers.RepeatedCompositeFieldContainer[Image]
    completed_batches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., batches: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ..., padding: _Optional[_Iterable[bool]] = ..., arrow_ipc: _Optional[bytes] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., completed_batches: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamEpochResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...
