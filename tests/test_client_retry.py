"""RetryPolicy: how long the Loader waits before it tries a failed stream again."""

from __future__ import annotations

import random

import pytest

from croupier.client import RetryPolicy
from croupier.client.connection import LIMIT_BACKOFF_S


@pytest.fixture
def no_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "random", lambda: 1.0)  # the top of the jitter range: the whole backoff


def test_the_backoff_doubles_from_the_initial_delay_up_to_the_cap(no_jitter) -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0)
    assert [policy.delay(k) for k in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_jitter_keeps_each_delay_between_half_and_all_of_the_backoff() -> None:
    policy = RetryPolicy(initial_backoff_s=0.4, max_backoff_s=5.0)
    delays = [policy.delay(2) for _ in range(200)]
    assert all(0.4 <= d <= 0.8 for d in delays)
    assert max(delays) - min(delays) > 0.1  # spread out, not one value for every client


def test_a_server_limit_waits_at_least_the_limit_backoff_but_the_idle_timeout_does_not(no_jitter) -> None:
    policy = RetryPolicy(initial_backoff_s=0.01)
    assert policy.delay(1, "max_streams") == LIMIT_BACKOFF_S
    assert policy.delay(1, "stream_idle_timeout_s") == pytest.approx(0.01)
    assert policy.delay(1) == pytest.approx(0.01)


def test_the_defaults_are_ten_retries_from_a_tenth_of_a_second_to_five() -> None:
    assert RetryPolicy() == RetryPolicy(max_retries=10, initial_backoff_s=0.1, max_backoff_s=5.0)
