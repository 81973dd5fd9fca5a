"""Rows of an Arrow IPC record batch from range reads: a row costs about its own bytes.

A column is a tree of buffers (validity bitmaps, offsets, values). To serve row r the
reader needs a few *structural* values (the validity bit, offsets r and r+1, small
fixed-width values) and the row's own *data* bytes (a string's characters, a list's
values). Structural buffers are read by pages of PAGE_BYTES, clipped to the buffer,
and kept in a bounded cache (`PageCache`): a batch of 1,000 one-KB strings has a 4 KB
offsets buffer, read once for all its rows. A buffer counts as structural when it
holds at most DENSE_BYTES_PER_ROW bytes per row of its batch (bitmaps, offsets, ints,
floats, short strings); others are read by the exact byte range of the row.

`Codec` walks one field's buffers for a range of elements and returns a `Node` (what
was read, validated), or asks for the structural pages it lacks; `build` turns the
nodes of a chunk's rows back into one Arrow array, vectorised with numpy. Supported:
null, booleans, fixed-width types (ints, floats, decimals, dates, times, timestamps,
durations, fixed-size binary), binary/string and their large variants, lists, large
lists, fixed-size lists, maps and structs, nested in any way. Anything else (dictionary
encoding, unions, view types, run-end encoding, compressed buffers) is served by
reading whole record batches (arrow_ipc.WholeBatches). Rows of columns one level deep
usually take a shorter path, without Walk or Node objects (flat_rows.py); this walk is
theirs when their batch has nulls or their pages are missing, and everyone else's.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .ipc_layout import BatchLayout

PAGE_BYTES = 64 << 10
#: Buffers with at most this many bytes per row of their batch are read by page and cached.
DENSE_BYTES_PER_ROW = 16
#: Default bound of the structural page cache (per reader).
DEFAULT_PAGE_CACHE_BYTES = 64 << 20


class CorruptRow(Exception):
    """What was read is inconsistent (offsets out of bounds or not monotone)."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column = column


class Unsupported(Exception):
    """A type this module cannot walk; the reader falls back to whole batches."""


class PageCache:
    """(file, batch, buffer, page) -> bytes, oldest out past `max_bytes` (first in, first
    out: a hit costs one dict lookup, which is what the per-row walk can afford)."""

    def __init__(self, max_bytes: int = DEFAULT_PAGE_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._pages: dict[tuple[int, int, int, int], bytes] = {}
        self._lock = threading.Lock()  # encode threads never touch it, but tools may share a reader

    def get(self, key: tuple[int, int, int, int]) -> bytes | None:
        return self._pages.get(key)

    def put(self, key: tuple[int, int, int, int], page: bytes) -> None:
        with self._lock:
            if key in self._pages:
                return
            self._pages[key] = page
            self.nbytes += len(page)
            while self.nbytes > self.max_bytes and len(self._pages) > 1:
                old = self._pages.pop(next(iter(self._pages)))
                self.nbytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self.nbytes = 0


class Node:
    """What one field holds for a range of `n` elements of a batch."""

    __slots__ = ("n", "validity", "lengths", "data", "children")

    def __init__(self, n: int, validity: np.ndarray | None):
        self.n = n
        self.validity = validity  # bool per element, None when all are valid
        self.lengths: np.ndarray | None = None  # binary/list element lengths
        self.data: bytes | np.ndarray | None = None  # values (bytes), or bools for booleans
        self.children: list[Node] = []


class Walk:
    """One row's walk through a batch: what is missing, what to fetch, and where."""

    __slots__ = ("file", "batch", "layout", "pages", "page_map", "missing", "fetch", "buffers", "nodes", "dense_limit")

    def __init__(self, file: int, batch: int, layout: BatchLayout, pages: PageCache):
        self.file = file
        self.batch = batch
        self.layout = layout
        self.pages = pages
        self.page_map = pages._pages  # read without a call on the hot path
        self.missing: list[tuple[int, int]] = []  # (buffer, page) not cached
        self.fetch: list[tuple[int, int, Node]] = []  # (absolute offset, size, node whose .data it is)
        self.buffers = layout.buffer_list  # (absolute offset, length) per buffer
        self.nodes = layout.node_list  # (length, null count) per field
        self.dense_limit = DENSE_BYTES_PER_ROW * max(layout.rows, 1)

    def structural(self, buf: int, lo: int, hi: int) -> bytes | None:
        """Bytes [lo, hi) of buffer `buf` from cached pages, or None (pages noted missing)."""
        if hi <= lo:
            return b""
        first, last = lo // PAGE_BYTES, (hi - 1) // PAGE_BYTES
        if first == last:  # the common case: one page
            page = self.page_map.get((self.file, self.batch, buf, first))
            if page is None:
                self.missing.append((buf, first))
                return None
            base = first * PAGE_BYTES
            return page[lo - base : hi - base]
        parts = []
        for p in range(first, last + 1):
            page = self.pages.get((self.file, self.batch, buf, p))
            if page is None:
                self.missing.append((buf, p))
            else:
                parts.append(page)
        if len(parts) != last - first + 1:
            return None
        base = first * PAGE_BYTES
        return b"".join(parts)[lo - base : hi - base]

    def values(self, node: Node, buf: int, lo: int, hi: int) -> bool:
        """Ask for bytes [lo, hi) of value buffer `buf` into node.data: from pages when the
        buffer is dense, else as a range read. False when pages are missing."""
        start, length = self.buffers[buf]
        if length <= self.dense_limit:
            data = self.structural(buf, lo, hi)
            if data is None:
                return False
            node.data = data
        elif hi > lo:
            self.fetch.append((start + lo, hi - lo, node))
        else:
            node.data = b""
        return True


_NULL = np.zeros(1, dtype=bool)  # the validity of one null element (never written to)


def _bits(raw: bytes, a: int, n: int) -> np.ndarray:
    if n == 1:
        return np.array([(raw[0] >> (a % 8)) & 1], dtype=bool)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    return bits[a % 8 : a % 8 + n].astype(bool)


class Codec:
    """Walks and rebuilds one field; `node` and `buffers` index the batch's metadata."""

    nbuffers = 0

    def __init__(self, field: pa.Field, node: int, buffer: int, path: str):
        self.field = field
        self.type = field.type
        self.node = node
        self.buffer = buffer  # first buffer of this field
        self.path = path  # column name, dotted for children, for messages
        self.children: list[Codec] = []

    def end_buffer(self) -> int:
        """One past the last buffer of this field and its children."""
        end = self.buffer + self.nbuffers
        for c in self.children:
            end = c.end_buffer()
        return end

    def end_node(self) -> int:
        end = self.node + 1
        for c in self.children:
            end = c.end_node()
        return end

    def check(self, w: Walk, a: int, b: int) -> None:
        length = w.nodes[self.node][0]
        if not 0 <= a <= b <= length:
            raise CorruptRow(self.path, f"elements {a}..{b} are outside the field's {length} (corrupt offsets)")

    def validity(self, w: Walk, a: int, b: int) -> tuple[bool, np.ndarray | None]:
        if not self.nbuffers or w.nodes[self.node][1] == 0:
            return True, None
        if w.buffers[self.buffer][1] < -(-b // 8):
            raise CorruptRow(self.path, "the validity bitmap is shorter than the field (corrupt)")
        raw = w.structural(self.buffer, a // 8, -(-b // 8))
        if raw is None:
            return False, None
        if b - a == 1:
            return True, None if (raw[0] >> (a % 8)) & 1 else _NULL
        bits = _bits(raw, a, b - a)
        return True, None if bits.all() else bits

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        """The node of elements [a, b), or None when structural pages are missing."""
        raise NotImplementedError

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        raise NotImplementedError

    def _validity_buffer(self, nodes: Sequence[Node]) -> tuple[pa.Buffer | None, int]:
        if all(n.validity is None for n in nodes):
            return None, 0
        bits = np.concatenate([np.ones(n.n, dtype=bool) if n.validity is None else n.validity for n in nodes])
        return pa.py_buffer(np.packbits(bits, bitorder="little").tobytes()), int(len(bits) - bits.sum())


class NullCodec(Codec):
    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        self.check(w, a, b)
        return Node(b - a, None)

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        return pa.nulls(sum(n.n for n in nodes), self.type)


class FixedCodec(Codec):
    nbuffers = 2

    def __init__(self, field: pa.Field, node: int, buffer: int, path: str):
        super().__init__(field, node, buffer, path)
        self.width = self.type.bit_width // 8

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        width = self.width
        length, nulls = w.nodes[self.node]
        if nulls == 0 and b == a + 1 and b <= length:  # one valid value: the per-row case
            buf = self.buffer + 1
            size = w.buffers[buf][1]
            lo = a * width
            if size <= w.dense_limit and lo + width <= size and lo // PAGE_BYTES == (lo + width - 1) // PAGE_BYTES:
                page = w.page_map.get((w.file, w.batch, buf, lo // PAGE_BYTES))
                if page is not None:
                    node = Node(1, None)
                    base = lo - lo % PAGE_BYTES
                    node.data = page[lo - base : lo - base + width]
                    return node
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        node = Node(b - a, valid)
        data = self.buffer + 1
        if w.buffers[data][1] < b * self.width:
            raise CorruptRow(self.path, "the values buffer is shorter than the field (corrupt)")
        if not w.values(node, data, a * self.width, b * self.width) or not ok:
            return None
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        data = b"".join(n.data for n in nodes)  # type: ignore[misc]
        return pa.Array.from_buffers(self.type, sum(n.n for n in nodes), [validity, pa.py_buffer(data)], nulls)


class BoolCodec(Codec):
    nbuffers = 2

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        if w.buffers[self.buffer + 1][1] < -(-b // 8):
            raise CorruptRow(self.path, "the values bitmap is shorter than the field (corrupt)")
        raw = w.structural(self.buffer + 1, a // 8, -(-b // 8))
        if raw is None or not ok:
            return None
        node = Node(b - a, valid)
        node.data = _bits(raw, a, b - a) if b > a else np.zeros(0, dtype=bool)
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        bits = np.concatenate([n.data for n in nodes])  # type: ignore[misc]
        data = pa.py_buffer(np.packbits(bits, bitorder="little").tobytes())
        return pa.Array.from_buffers(self.type, len(bits), [validity, data], nulls)


class _OffsetsCodec(Codec):
    """Types with an offsets buffer: binary/string (values follow) and lists (a child)."""

    def __init__(self, field: pa.Field, node: int, buffer: int, path: str, large: bool):
        super().__init__(field, node, buffer, path)
        self.large = large
        self.dtype = np.dtype("<i8" if large else "<i4")
        self.pair = struct.Struct("<2q" if large else "<2i")

    def offsets(self, w: Walk, a: int, b: int, limit: int) -> tuple[bool, "np.ndarray | tuple[int, int] | None"]:
        """Offsets a..b (b - a + 1 of them), checked monotone and within [0, limit]; a
        plain (start, end) pair for one element."""
        size = self.dtype.itemsize
        if w.buffers[self.buffer + 1][1] < (b + 1) * size:
            raise CorruptRow(self.path, "the offsets buffer is shorter than the field (corrupt)")
        raw = w.structural(self.buffer + 1, a * size, (b + 1) * size)
        if raw is None:
            return False, None
        if b - a == 1:
            lo, hi = self.pair.unpack(raw)
            if not 0 <= lo <= hi <= limit:
                raise CorruptRow(self.path, f"offsets {lo}..{hi} are not monotone within 0..{limit} (corrupt)")
            return True, (lo, hi)
        offs = np.frombuffer(raw, dtype=self.dtype).astype(np.int64)
        if offs[0] < 0 or offs[-1] > limit or (len(offs) > 1 and (np.diff(offs) < 0).any()):
            raise CorruptRow(
                self.path, f"offsets {offs[:4].tolist()}... are not monotone within 0..{limit} (corrupt)"
            )
        return True, offs

    def one_offsets(self, w: Walk, a: int, limit: int) -> tuple[int, int] | None:
        """Offsets a and a+1 when element a is valid (no nulls in the field) and both sit on
        one cached page: the per-row fast path; None sends the caller down the checked one."""
        length, nulls = w.nodes[self.node]
        if nulls or a + 1 > length:
            return None
        size = self.pair.size // 2
        lo = a * size
        hi = lo + 2 * size
        if w.buffers[self.buffer + 1][1] < hi or lo // PAGE_BYTES != (hi - 1) // PAGE_BYTES:
            return None
        page = w.page_map.get((w.file, w.batch, self.buffer + 1, lo // PAGE_BYTES))
        if page is None:
            return None
        start, end = self.pair.unpack_from(page, lo % PAGE_BYTES)
        if not 0 <= start <= end <= limit:
            raise CorruptRow(self.path, f"offsets {start}..{end} are not monotone within 0..{limit} (corrupt)")
        return start, end

    def offsets_buffer(self, nodes: Sequence[Node]) -> pa.Buffer:
        if all(isinstance(n.lengths, int) for n in nodes):  # one element each: the common case
            lengths = np.fromiter((n.lengths for n in nodes), dtype=np.int64, count=len(nodes))
        else:
            lengths = np.concatenate([np.atleast_1d(n.lengths) for n in nodes])  # type: ignore[misc]
        offs = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offs[1:])
        if not self.large and offs[-1] > np.iinfo(np.int32).max:
            raise CorruptRow(self.path, f"a chunk of {offs[-1]} bytes overflows 32-bit offsets: use smaller chunks")
        return pa.py_buffer(offs.astype(self.dtype).tobytes())


class BinaryCodec(_OffsetsCodec):
    nbuffers = 3

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        if b == a + 1:
            one = self.one_offsets(w, a, w.buffers[self.buffer + 2][1])
            if one is not None:
                node = Node(1, None)
                node.lengths = one[1] - one[0]
                return node if w.values(node, self.buffer + 2, one[0], one[1]) else None
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        ok2, offs = self.offsets(w, a, b, w.buffers[self.buffer + 2][1])
        if not ok2:
            return None
        node = Node(b - a, valid)
        if isinstance(offs, tuple):
            lo, hi = offs
            node.lengths = hi - lo
        else:
            lo, hi = int(offs[0]), int(offs[-1])
            node.lengths = np.diff(offs)
        if not w.values(node, self.buffer + 2, lo, hi) or not ok:
            return None
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        data = b"".join(n.data for n in nodes)  # type: ignore[misc]
        offsets = self.offsets_buffer(nodes)
        return pa.Array.from_buffers(self.type, sum(n.n for n in nodes), [validity, offsets, pa.py_buffer(data)], nulls)


class ListCodec(_OffsetsCodec):
    nbuffers = 2

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        child = self.children[0]
        if b == a + 1:
            one = self.one_offsets(w, a, w.nodes[child.node][0])
            if one is not None:
                sub = child.walk(w, one[0], one[1])
                if sub is None:
                    return None
                node = Node(1, None)
                node.lengths = one[1] - one[0]
                node.children = [sub]
                return node
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        ok2, offs = self.offsets(w, a, b, w.nodes[child.node][0])
        if not ok2:
            return None
        if isinstance(offs, tuple):
            lo, hi = offs
            lengths: int | np.ndarray = hi - lo
        else:
            lo, hi = int(offs[0]), int(offs[-1])
            lengths = np.diff(offs)
        sub = child.walk(w, lo, hi)
        if sub is None or not ok:
            return None
        node = Node(b - a, valid)
        node.lengths = lengths
        node.children = [sub]
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        child = self.children[0].build([n.children[0] for n in nodes])
        return pa.Array.from_buffers(
            self.type, sum(n.n for n in nodes), [validity, self.offsets_buffer(nodes)], nulls, children=[child]
        )


class FixedSizeListCodec(Codec):
    nbuffers = 1

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        size = self.type.list_size
        sub = self.children[0].walk(w, a * size, b * size)
        if sub is None or not ok:
            return None
        node = Node(b - a, valid)
        node.children = [sub]
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        child = self.children[0].build([n.children[0] for n in nodes])
        return pa.Array.from_buffers(self.type, sum(n.n for n in nodes), [validity], nulls, children=[child])


class StructCodec(Codec):
    nbuffers = 1

    def walk(self, w: Walk, a: int, b: int) -> Node | None:
        self.check(w, a, b)
        ok, valid = self.validity(w, a, b)
        subs = [c.walk(w, a, b) for c in self.children]
        if not ok or any(s is None for s in subs):
            return None
        node = Node(b - a, valid)
        node.children = subs  # type: ignore[assignment]
        return node

    def build(self, nodes: Sequence[Node]) -> pa.Array:
        validity, nulls = self._validity_buffer(nodes)
        children = [c.build([n.children[i] for n in nodes]) for i, c in enumerate(self.children)]
        return pa.Array.from_buffers(self.type, sum(n.n for n in nodes), [validity], nulls, children=children)


def make_codec(field: pa.Field, node: int, buffer: int, path: str) -> Codec:
    """The codec of `field`, whose node and first buffer have these indices (pre-order)."""
    t = field.type
    if pa.types.is_null(t):
        codec: Codec = NullCodec(field, node, buffer, path)
    elif pa.types.is_boolean(t):
        codec = BoolCodec(field, node, buffer, path)
    elif pa.types.is_dictionary(t) or pa.types.is_union(t) or pa.types.is_run_end_encoded(t):
        raise Unsupported(f"column {path!r} has type {t}")
    elif pa.types.is_binary(t) or pa.types.is_string(t):
        codec = BinaryCodec(field, node, buffer, path, large=False)
    elif pa.types.is_large_binary(t) or pa.types.is_large_string(t):
        codec = BinaryCodec(field, node, buffer, path, large=True)
    elif pa.types.is_list(t) or pa.types.is_map(t):
        codec = ListCodec(field, node, buffer, path, large=False)
    elif pa.types.is_large_list(t):
        codec = ListCodec(field, node, buffer, path, large=True)
    elif pa.types.is_fixed_size_list(t):
        codec = FixedSizeListCodec(field, node, buffer, path)
    elif pa.types.is_struct(t):
        codec = StructCodec(field, node, buffer, path)
    else:
        try:
            width = t.bit_width
        except ValueError:
            raise Unsupported(f"column {path!r} has type {t}") from None
        if width % 8 or not hasattr(pa.Array, "from_buffers"):
            raise Unsupported(f"column {path!r} has type {t}")
        codec = FixedCodec(field, node, buffer, path)
    if isinstance(codec, (ListCodec, FixedSizeListCodec, StructCodec)):
        n, buf = node + 1, buffer + codec.nbuffers
        fields = [t.field(i) for i in range(t.num_fields)]
        for f in fields:
            child = make_codec(f, n, buf, f"{path}.{f.name}")
            codec.children.append(child)
            n, buf = child.end_node(), child.end_buffer()
    return codec


def make_codecs(schema: pa.Schema) -> list[Codec]:
    """One codec per top-level column, in schema order; raises Unsupported."""
    codecs, node, buf = [], 0, 0
    for f in schema:
        c = make_codec(f, node, buf, f.name)
        codecs.append(c)
        node, buf = c.end_node(), c.end_buffer()
    return codecs


def buffer_count(codecs: Sequence[Codec]) -> int:
    return codecs[-1].end_buffer() if codecs else 0


def node_count(codecs: Sequence[Codec]) -> int:
    return codecs[-1].end_node() if codecs else 0


