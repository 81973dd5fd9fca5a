"""Trainer-side library: the streaming `Loader` and the RTP engine (`croupier.client.rtp`)."""

from .assemble import BatchAssembler, ProtocolError, RawBatch
from .loader import Batch, Loader, LoaderError, LoaderStats
from .samples import SampleDecodeError

__all__ = [
    "Batch",
    "BatchAssembler",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "ProtocolError",
    "RawBatch",
    "SampleDecodeError",
]
