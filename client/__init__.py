"""Trainer-side library: the streaming `Loader` and the RTP engine (`croupier.client.rtp`)."""

from croupier.client.assemble import BatchAssembler, ProtocolError, RawBatch
from croupier.client.loader import Batch, Loader, LoaderError, LoaderStats
from croupier.client.samples import SampleDecodeError

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
