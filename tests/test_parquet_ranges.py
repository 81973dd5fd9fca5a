"""The Parquet reader reads through its Store, by range: a row costs its row group's
column chunks (counted in store.stats), never the whole file; reads of different row
groups are in flight at once; bad footers and short reads are errors naming the file."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stores import WrappedStore

from croupier.server.readers import DatasetError, SampleError
from croupier.server.readers.parquet import TAIL_BYTES, ParquetReader
from croupier.server.storage import LocalStore, Range

ROWS_PER_GROUP = 200
GROUPS = 50


def _text_table(n: int, start: int = 0, width: int = 1000, seed: int = 0) -> pa.Table:
    """Rows of ~`width` bytes of hex text (incompressible for snappy) and their id."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, width // 2), dtype=np.uint8)
    return pa.table({"id": np.arange(start, start + n, dtype=np.int64), "text": [r.tobytes().hex() for r in raw]})


def _group_compressed_bytes(md: pq.FileMetaData, g: int) -> int:
    rg = md.row_group(g)
    return sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))


def _rows(reader: ParquetReader, items: Sequence[pa.RecordBatch]) -> list[dict]:
    return pa.ipc.open_stream(reader.encode(items).arrow_ipc).read_all().to_pylist()


def test_a_row_costs_its_row_group_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "text.parquet"
    pq.write_table(_text_table(GROUPS * ROWS_PER_GROUP), str(path), row_group_size=ROWS_PER_GROUP)
    file_size = path.stat().st_size
    md = pq.read_metadata(str(path))
    assert md.num_row_groups == GROUPS

    store = LocalStore(io_threads=8)
    try:
        before_open = store.stats.snapshot()
        reader = ParquetReader("text", str(path), store=store)
        after_open = store.stats.snapshot()
        open_bytes = after_open["bytes"] - before_open["bytes"]
        assert open_bytes <= TAIL_BYTES + md.serialized_size + 8, "opening reads the footer, nothing more"

        g = 37
        index = g * ROWS_PER_GROUP + 123

        async def go() -> tuple[dict, dict, dict, pa.RecordBatch, pa.RecordBatch]:
            s0 = store.stats.snapshot()
            first = await reader.read(index)
            s1 = store.stats.snapshot()
            second = await reader.read(index - 100)  # same row group: cached
            s2 = store.stats.snapshot()
            return s0, s1, s2, first, second

        s0, s1, s2, first, second = asyncio.run(go())
        row_bytes = s1["bytes"] - s0["bytes"]
        group_bytes = _group_compressed_bytes(md, g)
        print(
            f"\nparquet ranges: file {file_size} B; open {open_bytes} B in "
            f"{after_open['reads'] - before_open['reads']} reads; row {index}: {row_bytes} B in "
            f"{s1['reads'] - s0['reads']} reads; its row group {group_bytes} B compressed "
            f"({ROWS_PER_GROUP} rows); a second row of the group: {s2['bytes'] - s1['bytes']} B"
        )
        assert row_bytes <= group_bytes + 256
        assert row_bytes >= group_bytes, "the column chunks are read whole"
        assert row_bytes * 20 < file_size
        assert s1["reads"] - s0["reads"] == md.num_columns, "one range per column chunk"
        assert (s2["bytes"], s2["reads"]) == (s1["bytes"], s1["reads"]), "a cached row group reads nothing"
        assert reader.decodes == 1
        assert _rows(reader, [second, first]) == pq.read_table(str(path)).take([index - 100, index]).to_pylist()
    finally:
        store.close()


def test_random_rows_across_a_folder_equal_pyarrow(tmp_path: Path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    sizes_and_groups = [(130, 7), (1, 1), (400, 64), (257, 1000)]
    start = 0
    tables = []
    for k, (n, rg) in enumerate(sizes_and_groups):
        t = _text_table(n, start, width=40, seed=k)
        suffix = ".PARQUET" if k == 1 else ".parquet"  # any case
        pq.write_table(t, str(folder / f"part-{k:02d}{suffix}"), row_group_size=rg)
        tables.append(t)
        start += n
    (folder / "README.txt").write_text("not data")
    expected = pa.concat_tables(tables)

    store = LocalStore(io_threads=16)
    try:
        reader = ParquetReader("pq", str(folder), store=store, cache_bytes=4096)  # small: groups are evicted
        assert len(reader) == expected.num_rows == start
        indices = np.random.default_rng(7).integers(0, len(reader), size=300)

        async def go() -> list[pa.RecordBatch]:
            return list(await asyncio.gather(*(reader.read(int(i)) for i in indices)))

        assert _rows(reader, asyncio.run(go())) == expected.take(indices).to_pylist()
        assert pq.read_table(str(folder / "part-02.parquet")).equals(tables[2])  # files untouched
    finally:
        store.close()


def _write(tmp_path: Path, n: int = 500) -> Path:
    path = tmp_path / "x.parquet"
    pq.write_table(_text_table(n, width=40), str(path), row_group_size=50)
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        ("footer-bytes", r"x\.parquet is not a readable Parquet file"),
        ("footer-length", r"x\.parquet .*footer length \d+ does not fit"),
        ("magic", r"x\.parquet .*not the magic"),
        ("truncated", r"x\.parquet .*not the magic"),
        ("tiny", r"x\.parquet is not a Parquet file: 6 bytes"),
    ],
)
def test_a_bad_footer_is_a_dataset_error_naming_the_file(tmp_path: Path, damage: str, message: str) -> None:
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    if damage == "footer-bytes":
        data[-8 - footer_len : -8 - footer_len + 40] = b"\xff" * 40
    elif damage == "footer-length":
        data[-8:-4] = (len(data)).to_bytes(4, "little")
    elif damage == "magic":
        data[-4:] = b"PAR2"
    elif damage == "truncated":
        data = data[: len(data) * 2 // 3]
    else:
        data = data[:6]
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=message):
        ParquetReader("x", str(path), store=LocalStore(io_threads=2))


def test_a_footer_longer_than_the_tail_read_costs_one_more_read(tmp_path: Path) -> None:
    path = tmp_path / "wide.parquet"
    table = pa.table({f"c{c:03d}": np.arange(c, c + 2000, dtype=np.int64) for c in range(60)})
    pq.write_table(table, str(path), row_group_size=50)  # 40 groups x 60 columns of metadata
    md = pq.read_metadata(str(path))
    assert md.serialized_size > TAIL_BYTES
    store = LocalStore(io_threads=4)
    try:
        reader = ParquetReader("wide", str(path), store=store)
        assert store.stats.reads == 2 and store.stats.bytes == md.serialized_size + 8
        rows = [1999, 0, 777]

        async def go() -> list[pa.RecordBatch]:
            return list(await asyncio.gather(*(reader.read(i) for i in rows)))

        got = asyncio.run(go())
        assert _rows(reader, got) == table.take(rows).to_pylist()
    finally:
        store.close()


def test_a_file_shortened_after_open_is_a_sample_error_naming_file_and_row(tmp_path: Path) -> None:
    path = _write(tmp_path)
    store = LocalStore(io_threads=2)
    try:
        reader = ParquetReader("x", str(path), store=store)
        with open(path, "r+b") as f:
            f.truncate(reader.chunk_ranges(5)[0][0] + 10)  # inside row group 5's first chunk
        assert _rows(reader, [asyncio.run(reader.read(3))])[0]["id"] == 3  # row group 0 is whole
        with pytest.raises(SampleError, match=r"row 260: .*x\.parquet: row group 5: read \d+ of \d+ bytes") as err:
            asyncio.run(reader.read(260))
        assert err.value.index == 260 and err.value.path == str(path)
    finally:
        store.close()


def test_metadata_pointing_outside_the_file_is_a_sample_error_naming_group_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path)
    store = LocalStore(io_threads=2)
    try:
        reader = ParquetReader("x", str(path), store=store)
        reader._data_ends[0] = reader.chunk_ranges(2)[1][0]  # as if the metadata said column 1 ran past the data
        reads = store.stats.reads
        with pytest.raises(SampleError, match=r"row 120: .*x\.parquet: row group 2, column 'text': .*corrupt metadata"):
            asyncio.run(reader.read(120))
        assert store.stats.reads == reads, "nothing is read for a range outside the file"
    finally:
        store.close()


class GatedStore(WrappedStore):
    """A LocalStore whose async reads wait for `gate`, counting the calls in flight."""

    scheme = "file"

    def __init__(self, inner: LocalStore):
        super().__init__(inner)
        self.gate: asyncio.Event | None = None
        self.calls_in_flight = 0
        self.max_calls_in_flight = 0
        self.calls_done = 0

    async def _gated(self, call):
        assert self.gate is not None
        self.calls_in_flight += 1
        self.max_calls_in_flight = max(self.max_calls_in_flight, self.calls_in_flight)
        try:
            await self.gate.wait()
            return await call()
        finally:
            self.calls_in_flight -= 1
            self.calls_done += 1

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        return await self._gated(lambda: self.inner._read(path, offset, size))

    async def _read_ranges(self, path: str, ranges: Sequence[Range]) -> list[bytes]:
        return await self._gated(lambda: self.inner._read_ranges(path, ranges))


def test_reads_of_different_row_groups_are_in_flight_at_once(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = _text_table(8 * 100, width=100)
    pq.write_table(table, str(path), row_group_size=100)
    inner = LocalStore(io_threads=16)
    store = GatedStore(inner)
    try:
        reader = ParquetReader("t", str(path), store=store)
        rows = [g * 100 + g for g in range(8)] + [5 * 100 + 50]  # the last shares group 5's fetch

        async def go() -> list[pa.RecordBatch]:
            store.gate = asyncio.Event()
            reads = [asyncio.ensure_future(reader.read(i)) for i in rows]
            for _ in range(1000):  # scheduling steps, not time
                if store.calls_in_flight == 8:
                    break
                await asyncio.sleep(0)
            assert store.calls_in_flight == 8 and store.calls_done == 0
            assert store.stats.in_flight == sum(len(reader.chunk_ranges(g)) for g in range(8))
            assert not any(r.done() for r in reads)
            store.gate.set()
            return list(await asyncio.gather(*reads))

        got = asyncio.run(go())
        assert store.max_calls_in_flight == 8 and store.calls_done == 8
        assert reader.decodes == 8
        assert _rows(reader, got) == table.take(rows).to_pylist()
    finally:
        inner.close()
