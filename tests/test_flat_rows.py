"""Rows of one-level columns walked without objects (server/readers/flat_rows.py) serve the
very bytes the general walk (ipc_rows.py) serves.

Real Arrow IPC files, read by range through a real LocalStore: the same rows read by the
group path (`start_reads`, where flat rows apply) and one by one by `read` (the general
walk) encode to equal tables, for every one-level type, empty values, several record
batches and files, batches with nulls (left to the general walk, in the same chunk), a
selection narrower than what was read, and a file truncated after its pages were cached;
each with the native walk (_flatrows.c) and with its Python reference.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from croupier.server.readers import SampleError
from croupier.server.readers import flat_rows
from croupier.server.readers.arrow_ipc import ArrowIPCReader, RowItem
from croupier.server.storage.local import LocalStore

N, BATCH = 1_500, 400


@pytest.fixture(autouse=True, params=["native", "python"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the native walk (_flatrows.c) and with its Python reference."""
    if request.param == "python":
        monkeypatch.setattr(flat_rows, "_native", None)
    elif flat_rows._native is None:
        pytest.skip("croupier's native flat-row walk is not built (no C compiler at install time)")
    return request.param


def _table(start: int, n: int, nulls: bool = False) -> pa.Table:
    rng = np.random.default_rng(start)
    ids = np.arange(start, start + n)
    text = [("" if i % 11 == 0 else f"row {i} " + "x" * int(rng.integers(0, 300))) for i in ids]
    if nulls:
        text = [None if i % 5 == 0 else t for i, t in zip(ids, text)]
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "score": pa.array(rng.random(n, dtype=np.float32)),
        "text": pa.array(text, pa.string()),
        "blob": pa.array([bytes([i % 256]) * int(i % 40) for i in ids], pa.large_binary()),
        "tokens": pa.array([list(range(int(i % 17))) for i in ids], pa.list_(pa.int32())),
        "weights": pa.array([[float(i)] * int(i % 3) for i in ids], pa.large_list(pa.float64())),
        "digest": pa.array([int(i).to_bytes(24, "little") for i in ids], pa.binary(24)),
    })


def _write(path: Path, tables: list[pa.Table]) -> None:
    with ipc.new_file(str(path), tables[0].schema) as w:
        for t in tables:
            w.write_table(t, max_chunksize=BATCH)


async def _by_groups(reader: ArrowIPCReader, indices: list[int], columns: tuple[str, ...]) -> tuple[list[Any], list]:
    """Items of `indices` by `start_reads` in groups of 32 (cold rows by `read`), in order."""
    items: list[Any] = [None] * len(indices)
    errors: list = []
    left = [len(indices)]
    done = asyncio.get_running_loop().create_future()

    def landed(offset: int, results: list) -> None:
        for pos, item, err in results:
            items[offset + pos] = item
            if err is not None:
                errors.append(err)
            left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(None)

    for at in range(0, len(indices), 32):
        group = indices[at:at + 32]
        for pos in reader.start_reads(group, columns, lambda results, at=at: landed(at, results)):
            items[at + pos] = await reader.read(group[pos], columns)
            landed(at, [])
            left[0] -= 1
    if left[0] > 0:
        await done
    return items, errors


async def _warm(reader: ArrowIPCReader) -> None:
    for first in range(0, reader.num_rows, BATCH // 2):  # every batch's pages cached: rows are warm
        await reader.read(first)


def _both_ways(path: Path, indices: list[int], columns: tuple[str, ...] = (),
               encode: tuple[str, ...] | None = None) -> tuple[pa.Table, pa.Table, list[Any]]:
    async def go() -> tuple[pa.Table, pa.Table, list[Any]]:
        store = LocalStore(io_threads=8)
        reader = ArrowIPCReader("t", str(path), store=store)
        try:
            await _warm(reader)
            grouped, errors = await _by_groups(reader, indices, columns)
            assert not errors, errors
            general = [await reader.read(i, columns) for i in indices]
            cols = columns if encode is None else encode
            a = ipc.open_stream(reader.encode(grouped, cols).arrow_ipc).read_all()
            b = ipc.open_stream(reader.encode(general, cols).arrow_ipc).read_all()
            return a, b, grouped
        finally:
            reader.close()
            store.close()

    return asyncio.run(go())


def test_flat_rows_serve_the_bytes_the_general_walk_serves_for_every_one_level_type(tmp_path: Path) -> None:
    _write(tmp_path / "t.arrow", [_table(0, N)])
    indices = [int(i) for i in np.random.default_rng(1).integers(0, N, 700)] + [0, N - 1, BATCH - 1, BATCH]
    by_groups, general, items = _both_ways(tmp_path / "t.arrow", indices)
    assert by_groups.equals(general)
    assert by_groups.column("id").to_pylist() == indices
    assert all(type(it) is flat_rows.FlatRow for it in items)  # every row took the flat path
    expected = _table(0, N).take(indices)
    assert by_groups.equals(expected)


def test_rows_of_a_batch_with_nulls_take_the_general_walk_in_the_same_chunk(tmp_path: Path) -> None:
    # Batches 0-3 of the first table have no nulls; the second table's rows (ids 1500...) have nulls in `text`.
    _write(tmp_path / "t.arrow", [_table(0, N), _table(N, 600, nulls=True)])
    indices = [int(i) for i in np.random.default_rng(2).integers(0, N + 600, 400)]
    by_groups, general, items = _both_ways(tmp_path / "t.arrow", indices)
    assert by_groups.equals(general)
    kinds = {type(it) for it in items}
    assert kinds == {flat_rows.FlatRow, RowItem}  # both kinds, encoded together
    assert all(type(it) is RowItem for it, i in zip(items, indices) if i >= N)
    assert by_groups.column("text").null_count == sum(1 for i in indices if i >= N and i % 5 == 0)


def test_a_narrower_selection_encodes_from_rows_read_with_all_columns(tmp_path: Path) -> None:
    _write(tmp_path / "t.arrow", [_table(0, N)])
    indices = list(range(0, N, 7))
    by_groups, general, _ = _both_ways(tmp_path / "t.arrow", indices, columns=(), encode=("tokens", "id"))
    assert by_groups.equals(general)
    assert by_groups.schema.names == ["tokens", "id"]


def test_a_selection_of_columns_walks_only_those(tmp_path: Path) -> None:
    _write(tmp_path / "t.arrow", [_table(0, N)])
    indices = list(range(N - 1, 0, -13))
    by_groups, general, items = _both_ways(tmp_path / "t.arrow", indices, columns=("digest", "text"))
    assert by_groups.equals(general) and by_groups.schema.names == ["digest", "text"]
    assert all(len(it.values) == 2 for it in items)


def test_a_nested_column_is_not_flat() -> None:
    schema = pa.schema([("a", pa.int64()), ("s", pa.struct([("x", pa.int32())]))])
    from croupier.server.readers.ipc_rows import make_codecs

    codecs = make_codecs(schema)
    assert flat_rows.plan(codecs, ("a", "s")) is None
    assert flat_rows.plan(codecs[:1], ("a",)) is not None
    nested = make_codecs(pa.schema([("l", pa.list_(pa.list_(pa.int8())))]))
    assert flat_rows.plan(nested, ("l",)) is None


def test_a_file_truncated_after_its_pages_were_cached_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "t.arrow"
    _write(path, [_table(0, N)])

    async def go() -> list:
        store = LocalStore(io_threads=8)
        reader = ArrowIPCReader("t", str(path), store=store)
        try:
            await _warm(reader)
            os.truncate(path, os.path.getsize(path) // 2)
            _, errors = await _by_groups(reader, list(range(N - 64, N)), ("text",))
            return errors
        finally:
            reader.close()
            store.close()

    errors = asyncio.run(go())
    assert errors and all(isinstance(e, SampleError) for e in errors)
    assert any("is truncated" in str(e) and "t.arrow" in str(e) for e in errors), errors[:2]


@pytest.mark.parametrize("large", [False, True])
def test_flat_build_and_node_agree_with_the_general_build(large: bool) -> None:
    from croupier.server.readers.ipc_rows import make_codecs

    t = pa.table({"s": pa.array(["ab", "", "cde"], pa.large_string() if large else pa.string()),
                  "l": pa.array([[1, 2], [], [3]], pa.large_list(pa.int16()) if large else pa.list_(pa.int16()))})
    codecs = make_codecs(t.schema)
    p = flat_rows.plan(codecs, ("s", "l"))
    assert p is not None
    values = {"s": [b"ab", b"", b"cde"], "l": [np.array(v, np.int16).tobytes() for v in ([1, 2], [], [3])]}
    for col, name in zip(p.columns, ("s", "l")):
        flat = flat_rows.build(col, values[name])
        general = col.codec.build([flat_rows.node(col, v) for v in values[name]])
        assert flat.equals(general) and flat.equals(t.column(name).combine_chunks())


def test_a_table_wider_than_the_native_walk_takes_is_walked_in_python_with_the_same_bytes(tmp_path: Path) -> None:
    width = flat_rows.NATIVE_MAX_COLUMNS + 6
    t = pa.table({f"c{k}": pa.array([i * width + k for i in range(N)], pa.int32()) for k in range(width)}
                 | {"text": pa.array([f"row {i}" for i in range(N)], pa.string())})
    _write(tmp_path / "wide.arrow", [t])
    indices = [int(i) for i in np.random.default_rng(5).integers(0, N, 200)]
    by_groups, general, items = _both_ways(tmp_path / "wide.arrow", indices)
    assert by_groups.equals(general) and by_groups.equals(t.take(indices))
    assert all(type(it) is flat_rows.FlatRow for it in items)


def _landed_rows() -> tuple[list, list[bytes]]:
    rows, parts = [], []
    for pos in range(5):
        fetch = [(100 * pos + 10 * k, 3 + k, k) for k in range(1 + pos % 2)]  # one range or two
        rows.append((pos, flat_rows.FlatRow(1000 + pos, [None, None], 32, ("a", "b")), fetch, 0, pos))
        parts += [bytes([pos, k]) * 9 for _, _, k in fetch]
        parts[-len(fetch):] = [p[:s] for p, (_, s, _) in zip(parts[-len(fetch):], fetch)]
    return rows, parts


def test_a_files_landed_parts_go_into_its_rows_as_fill_puts_them_or_nothing_changes(walk: str) -> None:
    """`fill_landed` (one call for a file's rows) puts each part where `fill` would and counts
    it in nbytes; where a part is short or a row is not a FlatRow it changes nothing and
    says None, so the row-by-row loop names the short read."""
    rows, parts = _landed_rows()
    want, _ = _landed_rows()
    at = 0
    for _, item, fetch, _, _ in want:
        assert flat_rows.fill(item, fetch, parts[at:at + len(fetch)]) is None
        at += len(fetch)
    got = flat_rows.fill_landed(rows, parts)
    if walk == "python":
        assert got is None  # the loop's work
        return
    assert got == [(pos, item, None) for pos, item, *_ in rows]
    assert [(r[1].values, r[1].nbytes) for r in rows] == [(w[1].values, w[1].nbytes) for w in want]
    for spoil in ("short", "long", "row item", "too few parts"):
        rows, parts = _landed_rows()
        if spoil == "short":
            parts[3] = parts[3][:-1]
        elif spoil == "long":
            parts[-1] += b"x"
        elif spoil == "row item":
            rows[2] = (2, RowItem(1002, [], 32, ("a", "b")), rows[2][2], 0, 2)
        else:
            parts.pop()
        assert flat_rows.fill_landed(rows, parts) is None, spoil
        assert all(v is None for r in rows if type(r[1]) is flat_rows.FlatRow for v in r[1].values), spoil
        assert all(r[1].nbytes == 32 for r in rows), spoil


def test_a_chunk_of_rows_read_with_different_columns_encodes_each_row_by_its_own(tmp_path: Path) -> None:
    """Rows of one chunk read with other column sets (all of them, or others in another
    order) are encoded by where each holds the chunk's columns; a row read without one is
    refused, naming it."""
    _write(tmp_path / "t.arrow", [_table(0, N)])
    indices = [3, 700, 41, 1_200, 9, 555]

    async def go() -> tuple[pa.Table, Any]:
        store = LocalStore(io_threads=4)
        reader = ArrowIPCReader("t", str(tmp_path / "t.arrow"), store=store)
        try:
            await _warm(reader)
            sets = [(), ("text", "id"), ("tokens", "text", "id")]
            items = [await reader.read(i, sets[k % 3]) for k, i in enumerate(indices)]
            table = ipc.open_stream(reader.encode(items, ("id", "text")).arrow_ipc).read_all()
            with pytest.raises(ValueError, match="read without column 'tokens'"):
                reader.encode(items, ("tokens",))
            return table, items
        finally:
            reader.close()
            store.close()

    table, items = asyncio.run(go())
    assert len({it.names for it in items}) == 3
    expected = _table(0, N).take(indices).select(["id", "text"])
    assert table.equals(expected)
