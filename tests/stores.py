"""Test stores: a LocalStore seen through a wrapper whose async reads a test can hold."""

from __future__ import annotations

from croupier.server.storage import LocalStore
from croupier.server.storage.base import ForwardingStore


class WrappedStore(ForwardingStore):
    """Everything is `inner`'s (a LocalStore); subclasses override `_read`/`_read_ranges`."""

    def __init__(self, inner: LocalStore):
        super().__init__(inner)

    def close(self) -> None:
        self.inner.close()
