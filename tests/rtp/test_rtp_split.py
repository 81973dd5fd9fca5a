"""Splits: uneven sizes are cut, not refused; shards reassemble exactly; spare units rotate."""

from __future__ import annotations

import torch

from croupier.client.rtp.split import Splitter, units


def test_uneven_split_covers_every_row_once_and_reassembles():
    splitter = Splitter(4)
    split = splitter.even((10, 3), 0)
    assert [split.length(s) for s in range(4)] == [3, 3, 2, 2]
    full = torch.arange(30.0).view(10, 3)
    assert torch.equal(split.assemble([split.take(full, s) for s in range(4)]), full)


def test_more_shards_than_rows_gives_empty_shards():
    split = Splitter(4).even((2, 5), 0)
    assert [split.shape(s) for s in range(4)] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    full = torch.randn(2, 5)
    assert torch.equal(split.assemble([split.take(full, s) for s in range(4)]), full)


def test_head_split_takes_the_same_heads_from_q_k_and_v():
    # 3 heads of width 2 in a packed (3 * 6, 4) projection, over 2 shards: heads {0, 1} and {2}
    split = units((18, 4), 0, [2, 1], unit_len=2, sections=3, section_len=6)
    assert split.ranges[0] == ((0, 4), (6, 10), (12, 16))
    assert split.ranges[1] == ((4, 6), (10, 12), (16, 18))
    full = torch.randn(18, 4)
    assert torch.equal(split.assemble([split.take(full, s) for s in range(2)]), full)


def test_spare_rows_rotate_between_ranks_so_totals_stay_balanced():
    splitter = Splitter(4)
    totals = [0] * 4
    for _ in range(8):
        for s, c in enumerate(splitter.counts(10)):  # 2 spare rows each time
            totals[s] += c
    assert totals == [20, 20, 20, 20]


def test_chunks_cut_each_shard_into_consecutive_slices_covering_it_once():
    split = Splitter(3).even((10, 4), 0)  # shards of 4, 3, 3 rows
    chunks = split.chunks(2)
    for s in range(3):
        pieces = [r for c in chunks for r in c.ranges[s]]
        assert pieces[0][0] == split.ranges[s][0][0] and pieces[-1][1] == split.ranges[s][0][1]
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert [c.length(0) for c in chunks] == [2, 2] and [c.length(1) for c in chunks] == [2, 1]
