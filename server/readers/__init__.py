"""Dataset readers: random access by global index with async reads, one module per format."""

from .arrow_ipc import ArrowIPCReader
from .base import DatasetError, DatasetInfo, OutsideRootsError, Reader, SampleError, UnknownColumnError
from .hf_disk import HFDiskReader
from .imagefolder import ImageFolderReader
from .latency import LatencyInjected, LatencySampler
from .parquet import ParquetReader
from .registry import FORMATS, default_name, detect_format, open_dataset, resolve_under_roots
from .webdataset import WebDatasetReader

__all__ = [
    "FORMATS",
    "ArrowIPCReader",
    "DatasetError",
    "DatasetInfo",
    "HFDiskReader",
    "ImageFolderReader",
    "LatencyInjected",
    "LatencySampler",
    "OutsideRootsError",
    "ParquetReader",
    "Reader",
    "SampleError",
    "UnknownColumnError",
    "WebDatasetReader",
    "default_name",
    "detect_format",
    "open_dataset",
    "resolve_under_roots",
]
