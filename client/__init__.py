"""Trainer-side library: the streaming `Loader` and the RTP engine (`croupier.client.rtp`)."""

from croupier.protocol.security import ClientSecurity
from croupier.client.assemble import BatchAssembler, ProtocolError, RawBatch
from croupier.client.connection import RetryPolicy
from croupier.client.device_copy import NoCudaError
from croupier.client.loader import Batch, Loader, LoaderError, LoaderStats
from croupier.client.resume import ResumeError
from croupier.client.samples import ImageDecoding, SampleDecodeError, numpy_collate

__all__ = [
    "Batch",
    "BatchAssembler",
    "ClientSecurity",
    "ImageDecoding",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "NoCudaError",
    "ProtocolError",
    "RawBatch",
    "ResumeError",
    "RetryPolicy",
    "SampleDecodeError",
    "numpy_collate",
]
