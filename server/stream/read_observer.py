"""The metrics hooks a stream calls around each read it issues."""

from __future__ import annotations

from typing import Protocol


class FetchObserver(Protocol):
    """Hooks for metrics; every method must be cheap and never raise."""

    def read_started(self, count: int = 1) -> None:
        """`count` reads started (a group's, with one call)."""

    def read_finished(self, seconds: float, ok: bool, count: int = 1) -> None:
        """`count` reads of `seconds` each landed, all ok or all failed."""

    def reads_abandoned(self, count: int) -> None:
        """`count` started reads will never finish (their stream ended first)."""


class NoObserver:
    """The observer of a stream nobody measures."""

    def read_started(self, count: int = 1) -> None:
        pass

    def read_finished(self, seconds: float, ok: bool, count: int = 1) -> None:
        pass

    def reads_abandoned(self, count: int) -> None:
        pass
