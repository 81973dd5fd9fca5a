"""Arrow IPC files (file or stream format) and folders of them, read row by row by range.

Opening reads metadata only (ipc_layout): the schema, and where each buffer of each
record batch lies. Reading row i then costs the row's own bytes, one range read per
column whose values are not cached (ipc_rows), plus, once per record batch, its small
structural buffers (offsets, validity, short fixed-width values), kept in a bounded
page cache. No record batch is read, mapped or validated as a whole; what was read is
checked (offsets in bounds and monotone, lengths, UTF-8) and a corrupt row raises
SampleError naming the file, the row and the column.

Files with compressed buffers, dictionary-free layouts this reader cannot walk (unions,
view types, run-end encoding) are served by whole record batches instead (decoded,
fully validated, and kept in a bounded LRU), which costs a batch per row: `croupier
rewrite` turns them into the fast layout. Dictionary-encoded columns are refused.

The files of a folder, in sorted order, form one table: global index i is row i of
their concatenation.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..storage import Store
from ..storage.mounts import mount_of
from ..storage.readpath import LOCAL_FILE_SYSTEMS
from .base import DatasetError, DatasetInfo, Reader, SampleError, TablePayload, dataset_files, item_nbytes
from .ipc_layout import IPCLayout, read_layouts
from .listing import FilesProgress
from . import flat_rows
from .ipc_rows import DEFAULT_PAGE_CACHE_BYTES, PAGE_BYTES, Codec, CorruptRow, Node, PageCache, Unsupported, Walk
from .ipc_rows import buffer_count, make_codecs, node_count
from .tables import checked_columns, select_columns, table_info, to_ipc_payload

__all__ = ["ARROW_SUFFIXES", "ArrowIPCReader", "TableReader", "dataset_files", "select_columns", "to_ipc_payload"]

#: ".arrows" is the registered suffix of the stream format.
ARROW_SUFFIXES = (".arrow", ".arrows", ".feather", ".ipc")
#: Decoded record batches kept by the whole-batch fallback.
WHOLE_BATCH_CACHE_BYTES = 256 << 20
#: Rounds of structural page loads one row may need (one per level of list nesting).
_MAX_ROUNDS = 16
#: Chunks of table rows up to this size are encoded on the event loop. Encoding 64 rows of
#: 1 KB costs about 120 us and 256 of them about 250 us, less than the hop to the CPU pool
#: and back (about 170 us of CPU); 1,024 (1 MiB) cost 3 ms, which would hold the loop.
ENCODE_ON_LOOP_BYTES = 256 << 10


class _Merged:
    """The completions of one group's files, which land at once, handed on as one call
    once the last is in (rows needing no read with them)."""

    __slots__ = ("done", "left", "results")

    def __init__(self, done: Callable[[list], None]):
        self.done = done
        self.left = 1  # held until every file is submitted (`release`)
        self.results: list = []

    def __call__(self, results: list) -> None:
        self.results += results
        self.left -= 1
        if self.left == 0 and self.results:
            self.done(self.results)

    def release(self, known: list) -> None:
        self(known)


@dataclass
class RowItem:
    """What `read` hands to `encode`: one row's nodes, one per column read (`names`)."""

    index: int
    nodes: list[Node]
    nbytes: int
    names: tuple[str, ...]


_names_of = operator.attrgetter("names")
_values_of = operator.attrgetter("values")


def _on_local_file_system(path: str) -> bool:
    """On a block or memory file system (storage/readpath.py's LOCAL_FILE_SYSTEMS), whose
    reads land within microseconds: there groups of reads pay (server/stream/read_groups.py)."""
    mount = mount_of(path)
    return mount is not None and mount.fs_type in LOCAL_FILE_SYSTEMS


def _item_bytes(item: RowItem | pa.RecordBatch) -> int:
    """A row's bytes as its read counted them (base.item_nbytes asks its type three times
    first, once per sample on the event loop); a whole batch's by Arrow."""
    return item.nbytes if type(item) is RowItem or type(item) is flat_rows.FlatRow else item_nbytes(item)


class TableReader(Reader):
    """Random access by range reads into one table made of one or more Arrow IPC files.

    `columns`, when given, keeps only those columns (in the files' order).
    `page_cache_bytes` bounds the cache of structural buffers (offsets, validity bits,
    small values): about 4 bytes per row of each string or list column.
    """

    format = "arrow"

    def __init__(
        self,
        name: str,
        path: str,
        files: Sequence[str],
        columns: Sequence[str] | None = None,
        store: Store | None = None,
        page_cache_bytes: int = DEFAULT_PAGE_CACHE_BYTES,
        cache_dir: str | None = None,
    ):
        super().__init__(name, path, store=store)
        if not files:
            raise DatasetError(f"{self.format} dataset {path}: no Arrow files found")
        self.files = list(files)
        for f in self.files:
            self.store.pin(f)  # read row by row for the dataset's life: keep it open
        self._local = self.store.scheme == "file" and all(_on_local_file_system(f) for f in self.files)
        self._held, self._held_asked = False, -math.inf
        #: The store hands a group's rows over as they land (Store.submit_rows): groups pay
        #: even where reads land at different times. Until a store says it cannot.
        self._rows_stream = True
        progress = FilesProgress(f"dataset {name} ({self.store.url(path)})", len(self.files), "file layouts")
        self.layouts: list[IPCLayout] = read_layouts(self.store, self.files, cache_dir, progress)
        first = self.layouts[0].schema
        for layout in self.layouts[1:]:
            if not layout.schema.equals(first, check_metadata=False):
                raise DatasetError(
                    f"{self.format} dataset {path}: {self.store.url(layout.path)} has schema "
                    f"{layout.schema.remove_metadata()}, unlike {self.store.url(self.layouts[0].path)}: {first.remove_metadata()}"
                )
        self.file_schema = first
        names = first.names
        if columns:
            checked_columns(names, columns, f"{self.format} dataset {path}")
            names = [c for c in names if c in columns]
        self.schema = pa.schema([first.field(n) for n in names], first.metadata)
        # Global row -> (file, batch): the first row of every non-empty batch, in order.
        self._starts: list[int] = []
        self._where: list[tuple[int, int]] = []
        self._file_starts: list[int] = []
        total = 0
        for f, layout in enumerate(self.layouts):
            self._file_starts.append(total)
            for b, batch in enumerate(layout.batches):
                if batch.rows:
                    self._starts.append(total)
                    self._where.append((f, b))
                    total += batch.rows
        self.num_rows = total
        self.pages = PageCache(page_cache_bytes)
        self._loading: dict[tuple[int, int, int, int], asyncio.Future[None]] = {}
        self._column_index = {n: i for i, n in enumerate(first.names)}
        self._selections: dict[tuple[str, ...], tuple[tuple[str, ...], list[Codec]]] = {}
        self._flat_plans: dict[tuple[str, ...], flat_rows.Plan | None] = {}  # per selection (flat_rows.py)
        self._flat_columns: dict[int, flat_rows.Column | None] = {}  # per codec, for encode
        self._batch_layouts = [layout.batches for layout in self.layouts]
        self._codecs: list[Codec] = []
        self.whole_batches_reason = self._whole_batches_reason()  # sets _codecs when rows can be read by range
        self._whole: collections.OrderedDict[int, pa.RecordBatch] = collections.OrderedDict()
        self._whole_bytes = 0
        self._decoding: dict[int, asyncio.Future[pa.RecordBatch]] = {}
        self._row_bytes = self._estimate_row_bytes()

    # ---- opening --------------------------------------------------------------------
    def _whole_batches_reason(self) -> str:
        """Why rows cannot be read by range here ('' when they can)."""
        for layout in self.layouts:
            if layout.has_dictionaries or any(pa.types.is_dictionary(f.type) for f in layout.schema):
                raise DatasetError(
                    f"{self.format} dataset {self.path}: {self.store.url(layout.path)} has dictionary-encoded "
                    "columns, which croupier does not serve; cast them to their value type (e.g. "
                    "table.cast(...) or dictionary_decode) and write the file again"
                )
        try:
            codecs = make_codecs(self.file_schema)
        except Unsupported as exc:
            return str(exc)
        nbuf, nnode = buffer_count(codecs), node_count(codecs)
        for layout in self.layouts:
            for b, batch in enumerate(layout.batches):
                if batch.compressed:
                    return f"{self.store.url(layout.path)} has compressed buffers"
                if len(batch.buffers) != nbuf or len(batch.nodes) != nnode:
                    raise DatasetError(
                        f"{self.store.url(layout.path)}: record batch {b} has {len(batch.nodes)} fields and "
                        f"{len(batch.buffers)} buffers, its schema needs {nnode} and {nbuf} (corrupt)"
                    )
                if codecs and (batch.nodes[[c.node for c in codecs], 0] != batch.rows).any():
                    raise DatasetError(
                        f"{self.store.url(layout.path)}: record batch {b} has columns of other lengths "
                        f"than its {batch.rows} rows (corrupt)"
                    )
        self._codecs = codecs
        return ""

    def _estimate_row_bytes(self) -> dict[str, int]:
        """Bytes per row of each column, from buffer lengths in the metadata."""
        rows = max(self.num_rows, 1)
        if not self._codecs:
            total = sum(b.body_length for layout in self.layouts for b in layout.batches)
            return {n: -(-total // rows // max(len(self.schema), 1)) for n in self.schema.names}
        out = {}
        for c in self._codecs:
            nbytes = sum(
                int(batch.buffers[c.buffer : c.end_buffer(), 1].sum()) for layout in self.layouts for batch in layout.batches
            )
            out[c.field.name] = -(-nbytes // rows)
        return out

    def __len__(self) -> int:
        return self.num_rows

    @property
    def reads_in_groups(self) -> bool:  # type: ignore[override]
        """Groups, landing at once where reads do: files on a local file system (known at
        open), or all held whole in the server's memory cache (asked again at most once a
        second, by the issuer at each batch: a fill that ends mid-epoch turns that on for
        the rest); elsewhere landing row by row as they complete (`Store.submit_rows`),
        where the store can."""
        return self._lands_at_once() or self._rows_stream

    def _lands_at_once(self) -> bool:
        if self._local:
            return True
        now = time.monotonic()
        if now - self._held_asked >= 1.0:
            self._held_asked = now
            self._held = all(self.store.held_in_memory(f) for f in self.files)
        return self._held

    def info(self) -> DatasetInfo:
        return table_info(self, self.schema)

    def row_nbytes(self, columns: Sequence[str] = ()) -> int:
        return sum(self._row_bytes.get(c, 0) for c in (columns or self.schema.names))

    def _codecs_of(self, columns: Sequence[str]) -> tuple[tuple[str, ...], list[Codec]]:
        key = tuple(columns)
        cached = self._selections.get(key)
        if cached is None:
            names = tuple(checked_columns(self.schema.names, columns, f"{self.format} dataset {self.name!r} ({self.path})"))
            cached = self._selections[key] = (names, [self._codecs[self._column_index[n]] for n in names])
        return cached

    def _locate(self, index: int) -> tuple[int, int, int]:
        """(file, batch, row in batch) of global row `index`."""
        k = bisect.bisect_right(self._starts, index) - 1
        f, b = self._where[k]
        return f, b, index - self._starts[k]

    def _row_name(self, index: int, f: int, b: int, r: int) -> str:
        in_file = index - self._file_starts[f]
        return f"{self.store.url(self.files[f])}: row {in_file} of that file (record batch {b}, row {r}; dataset row {index})"

    # ---- reading by range -------------------------------------------------------------
    async def read(self, index: int, columns: Sequence[str] = ()) -> RowItem | pa.RecordBatch:
        self.check_index(index)
        if not self._codecs:
            return await self._read_whole(index)
        f, b, r = self._locate(index)
        names, codecs = self._codecs_of(columns)
        for _ in range(_MAX_ROUNDS):
            try:
                w, nodes = self._walk_row(f, b, r, codecs)
            except CorruptRow as exc:
                raise SampleError(f"{self._row_name(index, f, b, r)}, column {exc.column!r}: {exc}", index, self.path) from None
            if not w.missing:
                break
            await self._load_pages(f, b, set(w.missing))
        else:  # pragma: no cover - nesting deeper than _MAX_ROUNDS levels
            raise SampleError(f"{self._row_name(index, f, b, r)}: nested deeper than {_MAX_ROUNDS} levels", index, self.path)
        item = RowItem(index, nodes, 16 * len(codecs), names)  # type: ignore[arg-type]
        if w.fetch:
            try:
                parts = await self.store.read_ranges(self.files[f], [(o, s) for o, s, _ in w.fetch])
            except OSError as exc:
                raise SampleError(f"{self._row_name(index, f, b, r)}: cannot read: {exc}", index, self.path) from exc
            error = self._fill(item, w.fetch, parts, f, b, r)
            if error is not None:
                raise error
        return item

    def _walk_row(self, f: int, b: int, r: int, codecs: Sequence[Codec]) -> tuple[Walk, list]:
        """Row `r` of record batch `b` of file `f` walked by the cached pages: the walk (its
        missing pages, its range reads) and a node per column. `start_reads` walks the same
        way inline, its loop's lookups hoisted."""
        w = Walk(f, b, self.layouts[f].batches[b], self.pages)
        return w, [c.walk(w, r, r + 1) for c in codecs]

    @property
    def warms(self) -> bool:  # type: ignore[override]
        return bool(self._codecs)

    async def warm(self, indices: Sequence[int], columns: Sequence[str]) -> None:
        """The structural pages the rows `indices` lack, every batch's at once (as `read`
        loads one row's): `start_reads` can then take them as a group. A row that fails
        to walk, or pages that fail to load, are left to that row's `read` to name."""
        _, codecs = self._codecs_of(columns)
        for _ in range(_MAX_ROUNDS):
            missing: dict[tuple[int, int], set] = {}
            for index in indices:
                if not 0 <= index < self.num_rows:
                    continue
                f, b, r = self._locate(index)
                try:
                    w, _ = self._walk_row(f, b, r, codecs)
                except CorruptRow:
                    continue
                if w.missing:
                    missing.setdefault((f, b), set()).update(w.missing)
            if not missing:
                return
            loads = await asyncio.gather(*(self._load_pages(f, b, m) for (f, b), m in missing.items()),
                                         return_exceptions=True)
            if any(isinstance(x, BaseException) for x in loads):
                return  # the rows' own reads retry and name the failure

    def _fill(self, item: RowItem | flat_rows.FlatRow, fetch: list, parts: Sequence[bytes], f: int, b: int,
              r: int) -> SampleError | None:
        """Hand each fetched range to its node (a FlatRow: its value); the error of a short
        read (truncated file)."""
        if type(item) is flat_rows.FlatRow:
            if len(parts) == 1 and len(parts[0]) == fetch[0][1]:  # one range, whole: the common case, inline
                item.values[fetch[0][2]] = parts[0]
                item.nbytes += len(parts[0])
                return None
            short = flat_rows.fill(item, fetch, parts)
            if short is None:
                return None
            o, s, got = short
            return SampleError(f"{self._row_name(item.index, f, b, r)}: file is truncated ({got} of {s} bytes at byte {o})",
                               item.index, self.path)
        for (o, s, node), part in zip(fetch, parts):
            if len(part) != s:
                return SampleError(
                    f"{self._row_name(item.index, f, b, r)}: file is truncated ({len(part)} of {s} bytes at byte {o})",
                    item.index,
                    self.path,
                )
            node.data = part
            item.nbytes += s
        return None

    def item_sizer(self, columns: Sequence[str] = ()):
        return _item_bytes

    def start_read(self, index: int, columns: Sequence[str], done) -> bool:
        """A warm row (its batch's structural pages cached) without a coroutine: a group
        of one (`start_reads`). Cold rows await `read`."""
        return not self.start_reads((index,), columns, lambda results: done(results[0][1], results[0][2]))

    def _flat_plan(self, columns: Sequence[str]) -> flat_rows.Plan | None:
        key = tuple(columns)
        if key not in self._flat_plans:
            names, codecs = self._codecs_of(columns)
            self._flat_plans[key] = flat_rows.plan(codecs, names)
        return self._flat_plans[key]

    def _flat_column(self, codec: Codec) -> flat_rows.Column | None:
        key = id(codec)
        if key not in self._flat_columns:
            got = flat_rows.plan([codec], (codec.path,))
            self._flat_columns[key] = got.columns[0] if got is not None else None
        return self._flat_columns[key]

    def start_reads(self, indices: Sequence[int], columns: Sequence[str], done) -> Sequence[int]:
        """Warm rows of `indices` with one store call per file: every row's value ranges
        from the server's memory at once where it holds the files (`held_ranges`: `done`
        is called before this returns), in one `submit_ranges` (one callback) where reads
        land at once, else handed over row by row as they land (`submit_rows`: `done` is
        then called more than once, each row in one call); cold rows (pages missing) are
        left to `read`."""
        if not self._codecs:
            return range(len(indices))
        names, codecs = self._codecs_of(columns)
        per_row, pages, layouts, num_rows = 16 * len(codecs), self.pages, self.layouts, self.num_rows
        cold: list[int] = []
        known: list[tuple[int, Any, BaseException | None]] = []  # rows that need no read
        by_rows = self._rows_stream and not (self._local or self._held)  # else they land at once
        # file -> (its ranges: flat, or a list per row when by_rows; its rows)
        groups: dict[int, tuple[list, list[tuple[int, Any, list, int, int]]]] = {}
        plan = self._flat_plan(columns)
        general: Sequence[int] = range(len(indices))
        if plan is not None and indices and min(indices) >= 0 and max(indices) < num_rows:
            per_file, general, ready = flat_rows.walk_rows(plan, pages._pages, self._batch_layouts, self._starts,
                                                           self._where, indices)
            known += [(pos, item, None) for pos, item in ready]
            for f, rows in per_file.items():
                groups[f] = ([[(o, s) for o, s, _ in row[2]] for row in rows] if by_rows else
                             [(o, s) for row in rows for o, s, _ in row[2]], rows)
        for pos in general:
            index = indices[pos]
            if not 0 <= index < num_rows:
                cold.append(pos)  # `read` raises the error naming it
                continue
            f, b, r = self._locate(index)
            w = Walk(f, b, layouts[f].batches[b], pages)
            try:
                nodes = [c.walk(w, r, r + 1) for c in codecs]
            except CorruptRow as exc:
                known.append((pos, None, SampleError(
                    f"{self._row_name(index, f, b, r)}, column {exc.column!r}: {exc}", index, self.path)))
                continue
            if w.missing:
                cold.append(pos)
                continue
            item = RowItem(index, nodes, per_row, names)  # type: ignore[arg-type]
            if not w.fetch:
                known.append((pos, item, None))
                continue
            group = groups.get(f)
            if group is None:
                group = groups[f] = ([], [])
            if by_rows:
                group[0].append([(o, s) for o, s, _ in w.fetch])
            else:
                group[0].extend([(o, s) for o, s, _ in w.fetch])
            group[1].append((pos, item, w.fetch, b, r))
        self._submit_groups(groups, known, by_rows, done, cold)
        return cold

    def _submit_groups(self, groups: dict[int, tuple[list, list]], known: list, by_rows: bool, done,
                       cold: list[int]) -> None:
        """Each file's warm rows of a group in one store call (see `start_reads`); the rows
        of a file the store would not take, left in `cold`."""
        held = self._held
        merged = None
        if not by_rows and len(groups) + bool(known) > 1:
            # The group's files land at once (the same turn of the loop): one completion for
            # them all, not one per file (a batch of 64 rows spans most of a dataset's files).
            done = merged = _Merged(done)
        for f, (ranges, rows) in groups.items():
            if merged is not None:
                merged.left += 1  # this file's completion to come
            if held:  # every byte in the server's memory: the rows now, no completion to wait for
                parts = self.store.held_ranges(self.files[f], ranges)
                if parts is not None:
                    self._landed(f, rows, done, parts, None)
                    continue
            if by_rows:
                if self.store.submit_rows(self.files[f], ranges, functools.partial(self._rows_landed, f, rows, done)):
                    continue
                self._rows_stream = False  # this store cannot: groups only where reads land at once
                ranges = [rng for row in ranges for rng in row]
            if not self.store.submit_ranges(self.files[f], ranges, functools.partial(self._landed, f, rows, done)):
                cold.extend(row[0] for row in rows)
                if merged is not None:
                    merged.left -= 1  # none will come
        if merged is not None:
            merged.release(known)
        elif known:
            done(known)

    def _rows_landed(self, f: int, rows: list, done, landed: list) -> None:
        """Some of a group's rows are in (`Store.submit_rows`): each one's item, or the error naming it."""
        results: list[tuple[int, Any, BaseException | None]] = []
        for k, parts, err in landed:
            pos, item, fetch, b, r = rows[k]
            if err is not None:
                results.append((pos, None, SampleError(f"{self._row_name(item.index, f, b, r)}: cannot read: {err}",
                                                       item.index, self.path)))
                continue
            error = self._fill(item, fetch, parts, f, b, r)
            results.append((pos, None, error) if error is not None else (pos, item, None))
        done(results)

    def _landed(self, f: int, rows: list, done, parts: list[bytes] | None, err: BaseException | None) -> None:
        """A group's ranges are in: each row's item, or the error naming its row."""
        if err is not None:
            done([(pos, None, SampleError(f"{self._row_name(item.index, f, b, r)}: cannot read: {err}", item.index,
                                          self.path)) for pos, item, _, b, r in rows])
            return
        if type(parts) is list:
            results = flat_rows.fill_landed(rows, parts)  # the common case, one call for the file's rows
            if results is not None:
                done(results)
                return
        results = []
        at = 0
        for pos, item, fetch, b, r in rows:
            n = len(fetch)
            error = self._fill(item, fetch, parts[at:at + n] if n > 1 else (parts[at],), f, b, r)  # type: ignore[index]
            at += n
            results.append((pos, None, error) if error is not None else (pos, item, None))
        done(results)

    def batch_layout(self, f: int, b: int):
        return self.layouts[f].batches[b]

    async def _load_pages(self, f: int, b: int, missing: set[tuple[int, int]]) -> None:
        """Read the missing structural pages of batch `b` of file `f`, concurrently; reads
        already under way for another row are waited for, not repeated."""
        batch = self.layouts[f].batches[b]
        keys = [(f, b, buf, p) for buf, p in sorted(missing)]
        mine = [k for k in keys if k not in self._loading]
        theirs = {self._loading[k] for k in keys if k in self._loading}
        if mine:
            done = asyncio.get_running_loop().create_future()
            for k in mine:
                self._loading[k] = done
            try:
                ranges = []
                for _, _, buf, p in mine:
                    lo = p * PAGE_BYTES
                    ranges.append((batch.body + int(batch.buffers[buf, 0]) + lo, min(PAGE_BYTES, int(batch.buffers[buf, 1]) - lo)))
                try:
                    parts = await self.store.read_ranges(self.files[f], ranges)
                except OSError as exc:
                    raise SampleError(f"{self.store.url(self.files[f])}: cannot read record batch {b}'s offsets: {exc}") from exc
                for k, (o, s), part in zip(mine, ranges, parts):
                    if len(part) != s:
                        raise SampleError(
                            f"{self.store.url(self.files[f])}: file is truncated ({len(part)} of {s} bytes at byte {o})"
                        )
                    self.pages.put(k, part)
            finally:
                for k in mine:
                    self._loading.pop(k, None)
                done.set_result(None)  # waiters walk again: a failed load is retried by them
        if theirs:
            await asyncio.wait(theirs)

    def encodes_on_loop(self, decode_images: bool, nbytes: int) -> bool:
        return nbytes <= ENCODE_ON_LOOP_BYTES

    def encode(self, items: Sequence[RowItem | pa.RecordBatch], columns: Sequence[str] = (), decode_images: bool = False) -> TablePayload:
        what = f"{self.format} dataset {self.name!r} ({self.path})"
        names = checked_columns(self.schema.names, columns, what)
        schema = pa.schema([self.schema.field(n) for n in names], self.schema.metadata)
        if not items:
            return to_ipc_payload(pa.RecordBatch.from_pylist([], schema=schema))
        if not self._codecs:
            rows = pa.concat_batches(items)  # type: ignore[arg-type]
            return to_ipc_payload(rows.select(names).replace_schema_metadata(schema.metadata))
        arrays = []
        _, codecs = self._codecs_of(columns)
        # Items read with other columns (all of them, say) hold these among theirs. The walks
        # over a chunk's items are map()s, not a generator per column and item (64 flat rows
        # of 1 KB: 110 us an encode against 118).
        where: dict[tuple[str, ...], list[int]] = {}
        for held in set(map(_names_of, items)):
            missing = [n for n in names if n not in held]
            if missing:
                raise ValueError(f"a row was read without column {missing[0]!r}: read and encode the same columns")
            where[held] = [held.index(n) for n in names]
        (_, at), *others = where.items()
        flat = set(map(type, items)) == {flat_rows.FlatRow}
        for k, codec in enumerate(codecs):
            try:
                if not others:  # read with one set of columns, the usual case: one index for all
                    array = self._build(codec, items, at[k], flat)
                else:
                    array = self._build(codec, items, [where[it.names][k] for it in items], flat)  # type: ignore[union-attr]
                array.validate(full=True)
            except (CorruptRow, pa.ArrowInvalid, ValueError) as exc:
                raise self._bad_value(items, codec, exc) from None
            arrays.append(array)
        return to_ipc_payload(pa.RecordBatch.from_arrays(arrays, schema=schema))

    def _build(self, codec: Codec, items: Sequence[Any], at: int | list[int], flat: bool) -> pa.Array:
        """The column of `codec` over `items` (each its value at index `at`, or `at[i]`):
        from the FlatRows' values directly when all are (`flat`), else through Nodes (the
        general walk's)."""
        column = self._flat_column(codec)
        if column is not None and flat:
            if isinstance(at, int):
                return flat_rows.build(column, list(map(operator.itemgetter(at), map(_values_of, items))))
            return flat_rows.build(column, [it.values[i] for it, i in zip(items, at)])
        if isinstance(at, int):
            at = [at] * len(items)
        return codec.build([flat_rows.node(column, it.values[i]) if type(it) is flat_rows.FlatRow  # type: ignore[arg-type]
                            else it.nodes[i] for it, i in zip(items, at)])

    def _bad_value(self, items: Sequence, codec: Codec, exc: Exception) -> SampleError:
        """The first row of a chunk whose column of `codec` is invalid (e.g. bad UTF-8), named."""
        for it in items:
            try:
                self._build(codec, [it], it.names.index(codec.path), type(it) is flat_rows.FlatRow).validate(full=True)
            except (CorruptRow, pa.ArrowInvalid, ValueError) as row_exc:
                f, b, r = self._locate(it.index)
                return SampleError(
                    f"{self._row_name(it.index, f, b, r)}, column {codec.path!r}, is corrupt: {row_exc}", it.index, self.path
                )
        return SampleError(f"{self.format} dataset {self.path}, column {codec.path!r}: {exc}")

    # ---- the whole-batch fallback -------------------------------------------------------
    async def _read_whole(self, index: int) -> pa.RecordBatch:
        f, b, r = self._locate(index)
        key = bisect.bisect_right(self._starts, index) - 1
        batch = self._whole.get(key)
        if batch is None:
            fut = self._decoding.get(key)
            if fut is None:
                fut = self._decoding[key] = asyncio.ensure_future(self._decode_whole(f, b, key))
                fut.add_done_callback(lambda _f, key=key: self._decoding.pop(key, None))
            batch = await asyncio.shield(fut)
        else:
            self._whole.move_to_end(key)
        return batch.slice(r, 1)

    async def _decode_whole(self, f: int, b: int, key: int) -> pa.RecordBatch:
        layout = self.layouts[f].batches[b]
        url = self.store.url(self.files[f])
        try:
            raw = await self.store.read(self.files[f], layout.message_offset, layout.message_length)
        except OSError as exc:
            raise SampleError(f"{url}: cannot read record batch {b}: {exc}") from exc
        if len(raw) != layout.message_length:
            raise SampleError(f"{url}: file is truncated in record batch {b}")
        batch = await self.run_blocking(self._decode_message, raw, url, b)
        self._whole[key] = batch
        self._whole_bytes += batch.nbytes
        while self._whole_bytes > WHOLE_BATCH_CACHE_BYTES and len(self._whole) > 1:
            _, old = self._whole.popitem(last=False)
            self._whole_bytes -= old.nbytes
        return batch

    def _decode_message(self, raw: bytes, url: str, b: int) -> pa.RecordBatch:
        try:
            message = pa.ipc.read_message(pa.py_buffer(raw))
            batch = pa.ipc.read_record_batch(message, self.file_schema)
            batch.validate(full=True)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise SampleError(f"{url}: record batch {b} is corrupt: {exc}") from exc
        return batch.select(self.schema.names).replace_schema_metadata(self.schema.metadata)

    # ---- tools --------------------------------------------------------------------------
    def read_table(self) -> pa.Table:
        """The whole dataset in memory, read through the store (tools and baselines only)."""
        tables = []
        for path in self.files:
            data = self.store.read_file(path)
            source = pa.BufferReader(data)
            reader = pa.ipc.open_file(source) if data[:6] == b"ARROW1" else pa.ipc.open_stream(source)
            tables.append(reader.read_all().select(self.schema.names))
        return pa.concat_tables(tables).replace_schema_metadata(self.schema.metadata)

    def mapped_table(self) -> pa.Table:
        """The dataset as one zero-copy table over memory-mapped local files, the way
        `datasets` and most Arrow tools read it (baselines and tools, never the server:
        its page faults would wait on storage wherever they happen)."""
        if self.store.scheme != "file":
            raise DatasetError(f"{self.path}: only local files can be memory-mapped")
        tables = []
        for path in self.files:
            source = pa.memory_map(path, "r")
            magic = source.read(6)
            source.seek(0)
            reader = pa.ipc.open_file(source) if magic == b"ARROW1" else pa.ipc.open_stream(source)
            tables.append(reader.read_all().select(self.schema.names))
        return pa.concat_tables(tables).replace_schema_metadata(self.schema.metadata)

    def close(self) -> None:
        for f in self.files:
            self.store.unpin(f)
        self.pages.clear()
        self._whole.clear()
        self._whole_bytes = 0


class ArrowIPCReader(TableReader):
    format = "arrow"

    def __init__(self, name: str, path: str, store: Store | None = None, **kwargs):
        from ..storage import default_local_store

        store = store if store is not None else default_local_store()
        super().__init__(name, path, dataset_files(store, path, ARROW_SUFFIXES, "Arrow dataset"), store=store, **kwargs)

