"""Dataset readers: random access by global index with async reads, one module per format."""

from .base import DatasetError, DatasetInfo, OutsideRootsError, Reader, SampleError
from .latency import LatencyInjected, LatencySampler
from .registry import FORMATS, detect_format, open_dataset, resolve_under_roots

__all__ = [
    "FORMATS",
    "DatasetError",
    "DatasetInfo",
    "LatencyInjected",
    "LatencySampler",
    "OutsideRootsError",
    "Reader",
    "SampleError",
    "detect_format",
    "open_dataset",
    "resolve_under_roots",
]
