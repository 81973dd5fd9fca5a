"""Faults on purpose, samples counted (issue 13, item 4): the goal is 0 lost, 0 duplicated.

Real `croupier serve` subprocesses on loopback, real Loaders; the fault points are drawn
from a seeded generator, so a failure replays. See bench/faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from croupier.bench import faults


@pytest.mark.slow
def test_twenty_replica_kills_and_restarts_over_an_epoch_lose_and_repeat_nothing(tmp_path: Path) -> None:
    result = faults.replica_churn(tmp_path, kills=20, seed=11, rows=4000)
    assert result.faults == 20
    assert (result.lost, result.duplicated, result.delivered) == (0, 0, 4000), result.summary()
    # The busier replica died each time, with a stream open: every fault cut a rank's
    # stream, and the rank moved to the other replica.
    assert result.reconnects >= 20, result.summary()


def test_connections_reset_mid_stream_lose_and_repeat_nothing(tmp_path: Path) -> None:
    result = faults.connection_cuts(tmp_path, cuts=20, seed=12, rows=4000)
    assert result.faults == 20
    assert (result.lost, result.duplicated, result.delivered) == (0, 0, 4000), result.summary()
    assert result.reconnects >= 20, result.summary()  # every cut was felt, and survived


@pytest.mark.slow
def test_a_trainer_killed_and_resumed_from_its_state_dict_loses_and_repeats_nothing(tmp_path: Path) -> None:
    result = faults.trainer_kills(tmp_path, kills=4, seed=13, rows=3000)
    assert result.faults == 4
    assert (result.lost, result.duplicated, result.delivered) == (0, 0, 3000), result.summary()


def test_the_counts_see_a_loss_and_a_repeat() -> None:
    # The verdict above is only as good as this arithmetic.
    assert faults.count(range(5), [0, 1, 1, 3, 4]) == (1, 1)
    assert faults.count(range(3), [0, 1, 2, 7]) == (0, 1)
    assert faults.count(range(3), [2, 1, 0]) == (0, 0)
