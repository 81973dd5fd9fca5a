"""Rows of one-level columns walked without objects: the per-row hot path of most tables.

Most tables people train on are flat, or one level deep: ints and floats, strings and
binary, lists of numbers (a tokenised text's `list<int32>`). For those, a row's walk
(ipc_rows.py) is always the same few steps per column: an offsets pair from a cached page,
then the value bytes from a cached page (a dense buffer) or one range read. The general
walk pays for what it does not need there (a `Walk`, a `Node` per column and child, three
method calls per column); that was the largest part of the server's CPU per row once reads
went in groups (bench/results/cpu_per_sample.md). Here a `Plan` of the selected columns
says how to walk each, and `walk_rows` walks a group's rows in one native call, each row's item
a `FlatRow`: its values, one bytes object per column. `build` turns a chunk's FlatRows
into one Arrow array per column.

A row takes this path only when its batch has no nulls in the selected columns and every
page it needs is cached; otherwise (nulls, missing pages, values across pages, corrupt
offsets) the caller walks it the general way, which checks and names what is wrong. So the
bytes served never depend on which path read them; `tests/test_flat_rows.py` compares
the two on the same rows.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from .ipc_layout import BatchLayout
from .ipc_rows import PAGE_BYTES, BinaryCodec, Codec, DENSE_BYTES_PER_ROW, FixedCodec, ListCodec, Node

try:  # optional: an install without a C compiler walks in Python (walk_rows_py)
    from . import _flatrows as _native
except ImportError:  # pragma: no cover - built by the package's install
    _native = None

#: The most selected columns the native walk takes (its column table is on the C stack);
#: wider selections walk in Python.
NATIVE_MAX_COLUMNS = 64

#: What a column is: fixed-width values, binary/string values, or a list of fixed-width values.
FIXED, BYTES, LIST = 0, 1, 2


class Column(NamedTuple):
    """How to walk one selected column in one level."""

    kind: int
    node: int  # the field's node (length, null count)
    offsets: int  # its offsets buffer (BYTES, LIST); -1 for FIXED
    values: int  # its values buffer (LIST: the child's)
    width: int  # bytes per value (BYTES: 1)
    pair: struct.Struct | None  # the offsets pair's layout (BYTES, LIST)
    child_node: int  # LIST: the child's node; -1 otherwise
    codec: Codec


class FlatRow:
    """One row's item: its values, one bytes object per selected column (`names`)."""

    __slots__ = ("index", "values", "nbytes", "names")

    def __init__(self, index: int, values: list[bytes | None], nbytes: int, names: tuple[str, ...]):
        self.index = index
        self.values = values
        self.nbytes = nbytes
        self.names = names


class Plan(NamedTuple):
    columns: tuple[Column, ...]
    names: tuple[str, ...]
    #: The columns as plain ints for the native walk: (kind, node, offsets, values, width,
    #: offset size, child node) each.
    spec: tuple[tuple[int, ...], ...]


def plan(codecs: Sequence[Codec], names: tuple[str, ...]) -> Plan | None:
    """The plan of these columns, or None when one is not one level deep."""
    out = []
    for c in codecs:
        if type(c) is FixedCodec:
            out.append(Column(FIXED, c.node, -1, c.buffer + 1, c.width, None, -1, c))
        elif type(c) is BinaryCodec:
            out.append(Column(BYTES, c.node, c.buffer + 1, c.buffer + 2, 1, c.pair, -1, c))
        elif type(c) is ListCodec and type(c.children[0]) is FixedCodec:
            child = c.children[0]
            out.append(Column(LIST, c.node, c.buffer + 1, child.buffer + 1, child.width, c.pair, child.node, c))
        else:
            return None
    spec = tuple((c.kind, c.node, c.offsets, c.values, c.width, c.pair.size >> 1 if c.pair else 0, c.child_node)
                 for c in out)
    return Plan(tuple(out), names, spec)


def walk_rows(p: Plan, page_map: dict, batches: list[list[BatchLayout]], starts: list[int],
              where: list[tuple[int, int]], indices: Sequence[int]) -> tuple[dict[int, list], list[int], list]:
    """Walk the rows `indices` (global; all within the table) by plan `p`, each by its
    cached pages: ({file: [(position, FlatRow, fetch, batch, row)]}, positions left to the
    general walk, [(position, FlatRow)] rows whose values are all in hand). `fetch` lists
    the row's range reads as (absolute offset, size, column), in column order; the
    FlatRow's value there is None until `fill` puts the bytes in. In one native call
    where it is built (_flatrows.c), else in `walk_rows_py`, which it follows step for step."""
    if _native is not None and len(p.spec) <= NATIVE_MAX_COLUMNS:
        return _native.walk_rows(p.spec, page_map, batches, starts, where, indices, FlatRow, p.names)
    return walk_rows_py(p, page_map, batches, starts, where, indices)


def walk_rows_py(p: Plan, page_map: dict, batches: Sequence[Sequence[BatchLayout]], starts: list[int],
                 where: list[tuple[int, int]], indices: Sequence[int]) -> tuple[dict[int, list], list[int], list]:
    """`walk_rows` in Python: the reference the native walk follows."""
    per_file: dict[int, list] = {}
    slow: list[int] = []
    ready: list = []
    columns, names = p.columns, p.names
    per_row = 16 * len(columns)
    right = bisect.bisect_right
    for pos, index in enumerate(indices):
        k = right(starts, index) - 1
        f, b = where[k]
        r = index - starts[k]
        layout = batches[f][b]
        bufs, nodes = layout.buffer_list, layout.node_list
        dense = DENSE_BYTES_PER_ROW * layout.rows
        values: list[bytes | None] = []
        fetch: list[tuple[int, int, int]] = []
        for c in columns:
            length, nulls = nodes[c.node]
            if nulls or r >= length:
                break
            kind = c.kind
            if kind == FIXED:
                lo, hi = r * c.width, (r + 1) * c.width
            else:
                pair = c.pair
                size = pair.size >> 1  # type: ignore[union-attr]
                at = r * size
                olen = bufs[c.offsets][1]
                if at + 2 * size > olen or at // PAGE_BYTES != (at + 2 * size - 1) // PAGE_BYTES:
                    break
                page = page_map.get((f, b, c.offsets, at // PAGE_BYTES))
                if page is None:
                    break
                lo, hi = pair.unpack_from(page, at % PAGE_BYTES)  # type: ignore[union-attr]
                if kind == LIST:
                    child_len, child_nulls = nodes[c.child_node]
                    if child_nulls or not 0 <= lo <= hi <= child_len:
                        break  # nulls, or corrupt offsets: the general walk says which
                elif not 0 <= lo <= hi:
                    break
                lo, hi = lo * c.width, hi * c.width
            start, vlen = bufs[c.values]
            if hi > vlen:
                break  # corrupt (the general walk names it)
            if hi == lo:
                values.append(b"")
            elif vlen <= dense:  # a dense buffer: from its cached page
                first = lo // PAGE_BYTES
                if first != (hi - 1) // PAGE_BYTES:
                    break
                page = page_map.get((f, b, c.values, first))
                if page is None:
                    break
                base = first * PAGE_BYTES
                values.append(page[lo - base:hi - base])
            else:
                fetch.append((start + lo, hi - lo, len(values)))
                values.append(None)
        else:
            item = FlatRow(index, values, per_row, names)  # counted as RowItem is: its reads' bytes added as they land
            if not fetch:
                ready.append((pos, item))
                continue
            group = per_file.get(f)
            if group is None:
                group = per_file[f] = []
            group.append((pos, item, fetch, b, r))
            continue
        slow.append(pos)
    return per_file, slow, ready


def fill(item: FlatRow, fetch: list[tuple[int, int, int]], parts: Sequence[bytes]) -> tuple[int, int, int] | None:
    """The fetched parts into the row's values; the (offset, size, got) of a short read
    (a truncated file), else None."""
    values = item.values
    for (o, s, k), part in zip(fetch, parts):
        if len(part) != s:
            return o, s, len(part)
        values[k] = part
        item.nbytes += s
    return None


def fill_landed(rows: list, parts: list[bytes]) -> list | None:
    """A file's landed `parts` into its rows (walk_rows' [(position, FlatRow, fetch, batch,
    row)]) by one native call: [(position, item, None)]; None, with nothing changed, where
    a row is not a FlatRow or a part is short (or the C is not built): `fill` row by row."""
    return _native.fill_landed(rows, parts, FlatRow) if _native is not None else None


def build(c: Column, values: list[bytes]) -> pa.Array:
    """One column of a chunk's FlatRows as an Arrow array (no nulls)."""
    n = len(values)
    data = pa.py_buffer(b"".join(values))
    codec = c.codec
    if c.kind == FIXED:
        return pa.Array.from_buffers(codec.type, n, [None, data], 0)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
    if c.kind == LIST:
        lengths //= c.width
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    assert isinstance(codec, (BinaryCodec, ListCodec))
    if not codec.large and offs[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"column {codec.path!r}: a chunk of {offs[-1]} values overflows 32-bit offsets: use smaller chunks")
    offsets = pa.py_buffer(offs.astype(codec.dtype).tobytes())
    if c.kind == BYTES:
        return pa.Array.from_buffers(codec.type, n, [None, offsets, data], 0)
    child = pa.Array.from_buffers(codec.children[0].type, int(offs[-1]), [None, data], 0)
    return pa.Array.from_buffers(codec.type, n, [None, offsets], 0, children=[child])


def node(c: Column, value: bytes) -> Node:
    """One FlatRow value as the general walk's Node (a chunk mixing both kinds of item)."""
    out = Node(1, None)
    if c.kind == FIXED:
        out.data = value
    elif c.kind == BYTES:
        out.lengths = len(value)
        out.data = value
    else:
        count = len(value) // c.width
        out.lengths = count
        child = Node(count, None)
        child.data = value
        out.children = [child]
    return out
