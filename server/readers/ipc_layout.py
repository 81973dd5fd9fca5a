"""Where every buffer of every record batch of an Arrow IPC file lies, read from its
metadata alone, with range reads: no record batch body is read, mapped or validated.

An IPC file (format "ARROW1 ... footer") lists its record batches in its footer, each
as (offset, metadata length, body length); each batch's metadata (a flatbuffer
`Message` holding a `RecordBatch`) gives its row count, one (length, null count) node
per field and one (offset, length) per buffer, relative to the body. The stream format
(what Hugging Face `save_to_disk` writes) has no footer: its messages are walked one
after the other, each read costing one small range read.

Only the few flatbuffer tables of Arrow's Message.fbs/File.fbs that locate buffers are
decoded here, by hand (a handful of vtable lookups); the schema itself is parsed by
pyarrow from its encapsulated message. Every offset read is bounds-checked: corrupt
metadata raises DatasetError naming the file, never reads outside it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..storage import Store
from .base import DatasetError
from .listing import FilesProgress

_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF
#: First read of a stream message: the length prefix and, usually, all its metadata.
_MESSAGE_PEEK = 4096
#: Metadata reads at open, in flight at once (each is one small range read).
OPEN_CONCURRENCY = 64

# Message.header_type values (Message.fbs MessageHeader union).
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3


class _Table:
    """A flatbuffer table at `pos` of `buf`: fields by vtable slot."""

    __slots__ = ("buf", "pos", "vt", "vt_size")

    def __init__(self, buf: bytes, pos: int):
        self.buf = buf
        self.pos = pos
        self.vt = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vt_size = struct.unpack_from("<H", buf, self.vt)[0]

    def _field(self, slot: int) -> int:
        off = 4 + 2 * slot
        return struct.unpack_from("<H", self.buf, self.vt + off)[0] if off < self.vt_size else 0

    def scalar(self, slot: int, fmt: str, default: int = 0) -> int:
        o = self._field(slot)
        return struct.unpack_from("<" + fmt, self.buf, self.pos + o)[0] if o else default

    def table(self, slot: int) -> "_Table | None":
        o = self._field(slot)
        if not o:
            return None
        p = self.pos + o
        return _Table(self.buf, p + struct.unpack_from("<I", self.buf, p)[0])

    def struct_vector(self, slot: int, fields: int) -> np.ndarray:
        """A vector of structs of `fields` int64s each, as an (n, fields) array."""
        o = self._field(slot)
        if not o:
            return np.zeros((0, fields), dtype=np.int64)
        p = self.pos + o
        p += struct.unpack_from("<I", self.buf, p)[0]
        n = struct.unpack_from("<I", self.buf, p)[0]
        return np.frombuffer(self.buf, dtype="<i8", count=n * fields, offset=p + 4).reshape(n, fields)


def _root(buf: bytes) -> _Table:
    return _Table(buf, struct.unpack_from("<I", buf, 0)[0])


@dataclass
class BatchLayout:
    """One record batch: rows, body offset in the file, and per field / per buffer arrays."""

    rows: int
    body: int  # absolute offset of the body in the file
    body_length: int
    nodes: np.ndarray  # (fields, 2): length, null count, in schema pre-order
    buffers: np.ndarray  # (buffers, 2): offset (from body), length
    compressed: bool
    message_offset: int  # where its encapsulated message starts (the whole-batch fallback)
    message_length: int  # prefix + metadata + body

    def __post_init__(self) -> None:
        # Plain ints for the per-row walk (indexing numpy costs more than the walk itself).
        self.buffer_list: list[tuple[int, int]] = [(self.body + int(o), int(n)) for o, n in self.buffers]
        self.node_list: list[tuple[int, int]] = [(int(n), int(c)) for n, c in self.nodes]


@dataclass
class IPCLayout:
    """What an IPC file holds, from its metadata."""

    path: str
    size: int
    schema: pa.Schema
    format: str  # "file" or "stream"
    batches: list[BatchLayout]
    has_dictionaries: bool

    @property
    def num_rows(self) -> int:
        return sum(b.rows for b in self.batches)


def _parse_message(path: str, meta: bytes, where: int) -> tuple[int, _Table | None, int]:
    """(header type, header table, body length) of a Message flatbuffer."""
    try:
        msg = _root(meta)
        kind = msg.scalar(1, "B")
        header = msg.table(2)
        body_length = msg.scalar(3, "q")
    except struct.error as exc:
        raise DatasetError(f"{path}: corrupt Arrow IPC message metadata at byte {where}: {exc}") from None
    return kind, header, body_length


def _batch(path: str, size: int, header: _Table, body: int, body_length: int, msg_off: int, msg_len: int) -> BatchLayout:
    try:
        rows = header.scalar(0, "q")
        nodes = header.struct_vector(1, 2).copy()
        buffers = header.struct_vector(2, 2).copy()
        compressed = header.table(3) is not None
    except (struct.error, ValueError) as exc:
        raise DatasetError(f"{path}: corrupt record batch metadata at byte {msg_off}: {exc}") from None
    if rows < 0 or body < 0 or body_length < 0 or body + body_length > size:
        raise DatasetError(
            f"{path}: record batch at byte {msg_off} claims {rows} rows and a body of {body_length} bytes at "
            f"{body}, outside the file's {size} bytes (truncated or corrupt)"
        )
    if len(buffers) and (
        (buffers < 0).any() or (buffers[:, 0] + buffers[:, 1] > body_length).any()
    ):
        bad = int(np.flatnonzero((buffers < 0).any(axis=1) | (buffers[:, 0] + buffers[:, 1] > body_length))[0])
        raise DatasetError(
            f"{path}: record batch at byte {msg_off}: buffer {bad} (offset {int(buffers[bad, 0])}, length "
            f"{int(buffers[bad, 1])}) lies outside its {body_length}-byte body (corrupt)"
        )
    if len(nodes) and ((nodes < 0).any() or (nodes[:, 1] > nodes[:, 0]).any()):
        raise DatasetError(f"{path}: record batch at byte {msg_off}: corrupt field lengths or null counts")
    return BatchLayout(rows, body, body_length, nodes, buffers, compressed, msg_off, msg_len)


def _prefix(path: str, head: bytes, where: int) -> tuple[int, int]:
    """(metadata length, metadata start offset within `head`) of an encapsulated message."""
    if len(head) < 4:
        raise DatasetError(f"{path}: truncated Arrow IPC message at byte {where}")
    (first,) = struct.unpack_from("<I", head, 0)
    if first == _CONTINUATION:
        if len(head) < 8:
            raise DatasetError(f"{path}: truncated Arrow IPC message at byte {where}")
        return struct.unpack_from("<i", head, 4)[0], 8
    return struct.unpack_from("<i", head, 0)[0], 4  # the pre-1.0 format, without continuation


def _read_message(store: Store, path: str, size: int, where: int) -> tuple[int, bytes, int]:
    """(metadata length, metadata flatbuffer, prefix length) of the message at `where`; (0, b"", n) at EOS."""
    head = store.read_range(path, where, min(_MESSAGE_PEEK, size - where))
    meta_len, start = _prefix(path, head, where)
    if meta_len == 0:
        return 0, b"", start
    if meta_len < 0 or where + start + meta_len > size:
        raise DatasetError(f"{path}: Arrow IPC message at byte {where} has an impossible metadata length (corrupt or truncated)")
    meta = head[start : start + meta_len]
    if len(meta) < meta_len:
        meta = store.read_range(path, where + start, meta_len)
    return meta_len, meta, start


def _schema(path: str, store: Store, size: int, where: int) -> tuple[pa.Schema, int]:
    """The schema message at `where` and the offset just after it."""
    meta_len, meta, start = _read_message(store, path, size, where)
    kind, _, body_length = _parse_message(path, meta, where) if meta_len else (0, None, 0)
    if kind != _SCHEMA:
        raise DatasetError(f"{path}: not an Arrow IPC file or stream: no schema message at byte {where}")
    encapsulated = struct.pack("<Ii", _CONTINUATION, meta_len) + meta
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(encapsulated))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{path}: unreadable Arrow schema: {exc}") from exc
    return schema, where + start + meta_len + body_length


def _read_file_layout(store: Store, path: str, size: int) -> IPCLayout:
    tail = store.read_range(path, size - 10, 10)
    if len(tail) != 10 or tail[4:] != _MAGIC:
        raise DatasetError(f"{path}: not an Arrow IPC file (no ARROW1 at its end: truncated?)")
    (footer_len,) = struct.unpack_from("<i", tail, 0)
    if not 0 < footer_len <= size - 18:
        raise DatasetError(f"{path}: corrupt Arrow IPC footer length {footer_len} in a {size}-byte file")
    footer = store.read_range(path, size - 10 - footer_len, footer_len)
    try:
        root = _root(footer)
        dictionaries = root.struct_vector(2, 3)
        blocks = root.struct_vector(3, 3)
    except (struct.error, ValueError) as exc:
        raise DatasetError(f"{path}: corrupt Arrow IPC footer: {exc}") from None
    schema, _ = _schema(path, store, size, 8)

    def one(block: np.ndarray) -> BatchLayout:
        offset, meta_len_word, body_length = (int(v) for v in block)
        meta_total = meta_len_word & 0xFFFFFFFF  # int32 then 4 bytes of padding
        if offset < 8 or meta_total <= 0 or offset + meta_total + body_length > size - 10 - footer_len:
            raise DatasetError(f"{path}: the footer places a record batch at byte {offset} outside the file (corrupt)")
        head = store.read_range(path, offset, meta_total)
        meta_len, start = _prefix(path, head, offset)
        kind, header, body_len = _parse_message(path, head[start : start + meta_len], offset)
        if kind != _RECORD_BATCH or header is None:
            raise DatasetError(f"{path}: the footer's block at byte {offset} is not a record batch (corrupt)")
        return _batch(path, size, header, offset + meta_total, body_len, offset, meta_total + body_len)

    batches = _parallel(one, list(blocks))
    return IPCLayout(path, size, schema, "file", batches, has_dictionaries=len(dictionaries) > 0)


def _read_stream_layout(store: Store, path: str, size: int) -> IPCLayout:
    schema, where = _schema(path, store, size, 0)
    batches: list[BatchLayout] = []
    dictionaries = False
    while where + 4 <= size:  # each message costs one small read, in turn: the stream has no index
        meta_len, meta, start = _read_message(store, path, size, where)
        if meta_len == 0:
            break  # end-of-stream marker
        kind, header, body_length = _parse_message(path, meta, where)
        body = where + start + meta_len
        if kind == _RECORD_BATCH and header is not None:
            batches.append(_batch(path, size, header, body, body_length, where, start + meta_len + body_length))
        elif kind == _DICTIONARY_BATCH:
            dictionaries = True
        elif kind == _SCHEMA:
            raise DatasetError(f"{path}: a second schema message at byte {where} (corrupt stream)")
        if body + body_length > size:
            raise DatasetError(f"{path}: the message at byte {where} runs past the end of the file (truncated)")
        where = body + body_length
    return IPCLayout(path, size, schema, "stream", batches, has_dictionaries=dictionaries)


def _parallel(fn, items: list) -> list:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(OPEN_CONCURRENCY, len(items)), thread_name_prefix="croupier-open") as pool:
        return list(pool.map(fn, items))


def read_layout(store: Store, path: str) -> IPCLayout:
    """The layout of the IPC file (file or stream format) at `path` of `store` (blocking)."""
    url = store.url(path)
    try:
        size = store.size(path)
        if size < 8:
            raise DatasetError(f"{url}: {size} bytes is too short for an Arrow IPC file")
        head = store.read_range(path, 0, 8)
        if head[:6] == _MAGIC:
            return _read_file_layout(store, path, size)
        return _read_stream_layout(store, path, size)
    except DatasetError as exc:
        raise DatasetError(str(exc).replace(path, url, 1) if url != path else str(exc)) from None
    except OSError as exc:
        raise DatasetError(f"cannot read Arrow IPC file {url}: {exc}") from exc


#: Bumped when the cached layout format changes.
LAYOUT_CACHE_VERSION = 1


def _cache_path(store: Store, path: str, cache_dir: str | os.PathLike | None) -> tuple[Path, dict] | None:
    """Where the layout of a stream-format file is cached, and the stamp it must match."""
    url = store.url(path)
    try:
        if store.scheme == "file":
            st = os.stat(path)
            stamp = {"v": LAYOUT_CACHE_VERSION, "url": url, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        else:
            stamp = {"v": LAYOUT_CACHE_VERSION, "url": url, "size": store.size(path)}
    except OSError:
        return None
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "croupier" / "ipc-layout"
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    return base / f"{url.rsplit('/', 1)[-1]}.{digest}.layout.npz", stamp


def _load_cached(target: Path, stamp: dict, path: str) -> IPCLayout | None:
    try:
        with np.load(target, allow_pickle=False) as z:
            if json.loads(bytes(z["stamp"]).decode()) != stamp:
                return None
            schema = pa.ipc.read_schema(pa.py_buffer(bytes(z["schema"])))
            head, nodes, buffers = z["head"], z["nodes"], z["buffers"]
            n_nodes, n_bufs = int(z["shape"][0]), int(z["shape"][1])
            batches = [
                BatchLayout(int(h[0]), int(h[1]), int(h[2]), nodes[k * n_nodes : (k + 1) * n_nodes].copy(),
                            buffers[k * n_bufs : (k + 1) * n_bufs].copy(), bool(h[3]), int(h[4]), int(h[5]))
                for k, h in enumerate(head)
            ]
            return IPCLayout(path, stamp["size"], schema, "stream", batches, bool(z["dictionaries"]))
    except (OSError, ValueError, KeyError, pa.ArrowInvalid):
        return None  # missing, stale or unreadable: read the file's metadata again


def _save_cached(target: Path, stamp: dict, layout: IPCLayout) -> None:
    batches = layout.batches
    if not batches or any(len(b.nodes) != len(batches[0].nodes) or len(b.buffers) != len(batches[0].buffers) for b in batches):
        return
    head = np.array([[b.rows, b.body, b.body_length, b.compressed, b.message_offset, b.message_length] for b in batches],
                    dtype=np.int64)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp.npz")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, stamp=np.frombuffer(json.dumps(stamp).encode(), dtype=np.uint8),
                 schema=np.frombuffer(layout.schema.serialize().to_pybytes(), dtype=np.uint8), head=head,
                 nodes=np.concatenate([b.nodes for b in batches]), buffers=np.concatenate([b.buffers for b in batches]),
                 shape=np.array([len(batches[0].nodes), len(batches[0].buffers)]), dictionaries=layout.has_dictionaries)
        tmp.replace(target)
    except OSError:
        tmp.unlink(missing_ok=True)  # an unwritable cache only costs reading the metadata again


def read_layout_cached(store: Store, path: str, cache_dir: str | os.PathLike | None = None) -> IPCLayout:
    """`read_layout`, but a stream-format file's layout (one read per record batch, in
    turn) is kept in a cache file stamped with the file's URL, size (and mtime for local
    files), so a server restarted on slow storage opens it in one stat."""
    where = _cache_path(store, path, cache_dir)
    if where is not None:
        cached = _load_cached(*where, path)
        if cached is not None:
            return cached
    layout = read_layout(store, path)
    if where is not None and layout.format == "stream":
        _save_cached(*where, layout)
    return layout


def read_layouts(store: Store, paths: list[str], cache_dir: str | os.PathLike | None = None,
                 progress: FilesProgress | None = None) -> list[IPCLayout]:
    """The layouts of several files, read concurrently (each file's own reads may be too)."""
    def one(path: str) -> IPCLayout:
        layout = read_layout_cached(store, path, cache_dir)
        if progress is not None:
            progress.step()
        return layout

    layouts = _parallel(one, paths)
    if progress is not None:
        progress.finish()
    return layouts
