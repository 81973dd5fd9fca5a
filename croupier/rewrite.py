"""`croupier rewrite SRC DST`: any dataset croupier serves, as the layout it reads fastest.

The server reads table rows by byte range: a row costs its own bytes plus the offsets
of its record batch (cached after the first row of that batch). That is cheapest with
Arrow IPC *file*-format files (the footer locates every batch) of small, uncompressed
record batches. Parquet decodes a whole page or row group per row, and
`Dataset.save_to_disk` writes the IPC *stream* format in batches of 1,000 rows.

What DST becomes:

* table sources (Arrow IPC file/stream format, file or folder; an HF `save_to_disk`
  folder; Parquet file or folder): `part-00000.arrow`, `part-00001.arrow`, ... in the IPC
  file format, uncompressed, in record batches of `rows_per_batch` rows (the last one may
  be shorter), with the same rows in the same global order (row i of the source is row i
  of the parts concatenated in name order) and the same schema, schema metadata included
  (HF `features`). An HF folder gives what croupier serves from it: the columns of a
  saved `set_format(columns=...)` only (its features trimmed to match); a DatasetDict or
  a folder with an indices mapping is refused, as the server refuses it.
* image sources (ImageFolder tree, WebDataset shards): rows `{"image": struct<bytes,
  path>, "label": int64}` with the HF `Image` / `ClassLabel` features in the schema
  metadata (key `huggingface`, as `datasets` writes it), in the sample order and with
  the labels croupier's readers give; the class names become the ClassLabel names.
* `croupier-rewrite.json`: where it came from (path, format), rows, rows_per_batch,
  the files and the croupier version. The server still detects DST as "arrow".

The source is streamed record batch by record batch (IPC readers, Parquet
`iter_batches`, one batch of images at a time), never loaded whole: memory stays at a
few batches whatever the dataset's size. The parts are written
into `DST.tmp-<pid>` and renamed to DST at the end, so an interrupted rewrite leaves no
half dataset under DST.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from croupier import __version__
from croupier.server.readers.arrow_ipc import ARROW_SUFFIXES
from croupier.server.readers.base import DatasetError
from croupier.server.readers.images import checked_format
from croupier.server.readers.registry import FORMATS, detect_format

__all__ = ["MANIFEST", "RewriteError", "RewriteResult", "rewrite"]

#: The file DST gets beside its parts.
MANIFEST = "croupier-rewrite.json"
PART_NAME = "part-{:05d}.arrow"
_FILE_MAGIC = b"ARROW1"
_IMAGE_FORMATS = ("imagefolder", "webdataset")
#: Rows per batch asked of Parquet's iter_batches (re-chunked to rows_per_batch after).
_PARQUET_READ_ROWS = 8192


class RewriteError(DatasetError):
    """The rewrite is refused or the source is unreadable; the message names the path."""


@dataclass
class RewriteResult:
    src: str
    dst: str
    source_format: str
    rows: int
    rows_per_batch: int
    #: The part files written, in row order (paths under DST).
    files: list[str] = field(default_factory=list)
    #: Bytes of the part files.
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        return (
            f"rewrote {self.rows:,} rows of {self.src} ({self.source_format}) into {self.dst}: "
            f"{len(self.files)} file(s), {self.bytes / 1e6:,.1f} MB, {self.rows_per_batch} rows per batch, "
            f"{self.seconds:.1f} s ({rate:,.0f} rows/s)"
        )


# --- sources ---------------------------------------------------------------------------


def _data_files(path: Path, suffixes: Sequence[str], what: str) -> list[Path]:
    """`path` itself, or the files of folder `path` with one of `suffixes`, sorted by name
    (the order in which the server concatenates them)."""
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in suffixes and f.is_file())
        if not files:
            raise RewriteError(f"{what} {path}: the folder holds no {'/'.join(suffixes)} files")
        return files
    if not path.is_file():
        raise RewriteError(f"{what} {path} does not exist")
    return [path]


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with dictionary-encoded columns as their value type: the server refuses
    dictionaries, and the IPC file format cannot hold a dictionary that changes per batch."""
    fields = [f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema]
    return pa.schema(fields, schema.metadata)


@dataclass
class _Source:
    format: str
    schema: pa.Schema
    num_rows: int
    #: Record batches of any size with `schema`'s columns, in global row order.
    batches: Callable[[], Iterator[pa.RecordBatch]]


def _open_ipc(path: Path, mapped: bool = True) -> tuple[Any, Any, bool]:
    """(source, reader, file format?) of one IPC file, memory-mapped or read into memory
    batch by batch (bounded RSS); errors name the file."""
    try:
        source = pa.memory_map(str(path), "r") if mapped else pa.OSFile(str(path), "rb")
    except (OSError, pa.ArrowInvalid) as exc:
        raise RewriteError(f"cannot open Arrow IPC file {path}: {exc}") from exc
    try:
        file_format = source.read(len(_FILE_MAGIC)) == _FILE_MAGIC
        source.seek(0)
    except OSError as exc:
        source.close()
        raise RewriteError(f"cannot read Arrow IPC file {path}: {exc}") from exc
    kind = "file" if file_format else "stream"
    try:
        reader = pa.ipc.open_file(source) if file_format else pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        source.close()
        raise RewriteError(f"{path}: not a readable Arrow IPC {kind} (corrupt or truncated?): {exc}") from exc
    return source, reader, file_format


def _ipc_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of one IPC file, each fully validated; errors name file and batch.

    Read, not memory-mapped: each batch is freed once written, so a rewrite of a large
    file does not grow the process by the file's size."""
    source, reader, file_format = _open_ipc(path, mapped=False)
    kind = "file" if file_format else "stream"
    with source:
        i = 0
        while True:
            try:
                if file_format:
                    if i >= reader.num_record_batches:
                        return
                    batch = reader.get_batch(i)
                else:
                    try:
                        batch = reader.read_next_batch()
                    except StopIteration:
                        return
                # Full validation: corrupt offsets must fail here, not read outside the file.
                batch.validate(full=True)
            except (pa.ArrowInvalid, OSError, ValueError) as exc:
                raise RewriteError(
                    f"{path}: record batch {i} of this Arrow IPC {kind} is unreadable (corrupt or truncated?): {exc}"
                ) from exc
            yield batch
            i += 1


def _ipc_rows(path: Path) -> tuple[pa.Schema, int]:
    """Schema and row count of one IPC file. The file format's footer locates every
    batch's header (small reads); the stream format is walked memory-mapped, which only
    touches the pages of the batch headers (the bodies are not read)."""
    try:
        with open(path, "rb") as f:
            mapped = f.read(len(_FILE_MAGIC)) != _FILE_MAGIC
    except OSError as exc:
        raise RewriteError(f"cannot open Arrow IPC file {path}: {exc}") from exc
    source, reader, file_format = _open_ipc(path, mapped=mapped)
    kind = "file" if file_format else "stream"
    with source:
        try:
            if file_format:
                return reader.schema, reader.count_rows()
            return reader.schema, sum(b.num_rows for b in reader)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise RewriteError(f"{path}: not a readable Arrow IPC {kind} (corrupt or truncated?): {exc}") from exc


def _check_schemas(what: str, files: Sequence[Path], schemas: Sequence[pa.Schema]) -> None:
    for f, s in zip(files, schemas):
        if not s.equals(schemas[0], check_metadata=False):
            raise RewriteError(
                f"{what}: {f} has schema {s.remove_metadata()}, unlike {files[0]}: {schemas[0].remove_metadata()}"
            )


def _trim_hf_features(metadata: dict[bytes, bytes] | None, columns: Sequence[str]) -> dict[bytes, bytes] | None:
    """Schema metadata whose HF features list only `columns` (so `datasets` still loads it)."""
    if not metadata or b"huggingface" not in metadata:
        return metadata
    try:
        hf = json.loads(metadata[b"huggingface"])
        features = hf["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return metadata
    if not isinstance(features, dict):
        return metadata
    hf["info"]["features"] = {k: v for k, v in features.items() if k in columns}
    return {**metadata, b"huggingface": json.dumps(hf).encode()}


def _ipc_source(fmt: str, what: str, files: Sequence[Path], columns: Sequence[str] | None = None) -> _Source:
    schemas, total = [], 0
    for f in files:
        schema, rows = _ipc_rows(f)
        schemas.append(schema)
        total += rows
    _check_schemas(what, files, schemas)
    schema = schemas[0]
    if columns:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise RewriteError(f"{what}: the saved format names column {missing[0]!r}; columns: {schema.names}")
        keep = [c for c in schema.names if c in columns]  # the files' order, as the server serves them
        schema = pa.schema([schema.field(c) for c in keep], _trim_hf_features(schema.metadata, keep))

    def batches() -> Iterator[pa.RecordBatch]:
        for f in files:
            for batch in _ipc_batches(f):
                yield batch.select(schema.names) if columns else batch

    return _Source(fmt, schema, total, batches)


def _hf_source(root: Path) -> _Source:
    """As server/readers/hf_disk.py serves it: state.json's files, its format's columns."""
    from croupier.server.readers.hf_disk import hf_data_files
    from croupier.server.storage import default_local_store

    try:
        files, columns = hf_data_files(default_local_store(), str(root))
    except DatasetError as exc:
        raise RewriteError(str(exc).replace("serve one split", "rewrite one split at a time")) from None
    return _ipc_source("hf", f"hf dataset {root}", [Path(f) for f in files], columns)


def _parquet_source(path: Path) -> _Source:
    files = _data_files(path, (".parquet",), "Parquet dataset")
    schemas, total = [], 0
    for f in files:
        try:
            with pq.ParquetFile(str(f)) as pf:
                schemas.append(pf.schema_arrow)
                total += pf.metadata.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise RewriteError(f"{f} is not a readable Parquet file (corrupt or truncated?): {exc}") from exc
    _check_schemas(f"Parquet dataset {path}", files, schemas)

    def batches() -> Iterator[pa.RecordBatch]:
        for f in files:
            try:
                # pre_buffer=False: with it, iter_batches keeps every row group it read
                # (the whole file) allocated until the end (pyarrow 26).
                with pq.ParquetFile(str(f), pre_buffer=False) as pf:
                    for batch in pf.iter_batches(batch_size=_PARQUET_READ_ROWS):
                        yield batch
            except (pa.ArrowInvalid, OSError) as exc:
                raise RewriteError(f"{f}: cannot read this Parquet file (corrupt or truncated?): {exc}") from exc

    return _Source("parquet", schemas[0], total, batches)


def image_schema(classes: Sequence[str] | None) -> pa.Schema:
    """`{"image": struct<bytes, path>, "label": int64}` with the HF features `datasets` writes:
    Image, and ClassLabel(names=classes) (a plain int64 Value when `classes` is None)."""
    label = {"dtype": "int64", "_type": "Value"} if classes is None else {"names": list(classes), "_type": "ClassLabel"}
    features = {"image": {"_type": "Image"}, "label": label}
    image_type = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])
    return pa.schema(
        [pa.field("image", image_type), pa.field("label", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": features}})},
    )


def _image_source(path: Path, fmt: str, rows_per_batch: int) -> _Source:
    """Samples in the reader's order; bytes read with plain file reads, checked to be images."""
    # (file, offset, size or -1 for the whole file, key, label, where) per sample
    samples: list[tuple[str, int, int, str, int, str]]
    if fmt == "imagefolder":
        from croupier.server.readers.imagefolder import ImageFolderReader

        folder = ImageFolderReader(path.name, str(path))
        samples = [
            (str(path / key), 0, -1, key, label, str(path / key)) for key, label in zip(folder.keys, folder.labels)
        ]
        classes: list[str] | None = list(folder.classes)
    else:
        from croupier.server.readers.webdataset import WebDatasetReader

        wds = WebDatasetReader(path.name, str(path))
        samples = [
            (str(wds.shards[sno]), offset, size, member, label, f"{wds.shards[sno]}:{member}")
            for sno, member, offset, size, label in wds.samples
        ]
        top = max(label for *_, label, _ in samples)
        classes = list(wds.classes) if wds.classes else None
        if classes is not None or top >= 0:  # labels past classes.txt get their number as name
            classes = (classes or []) + [str(i) for i in range(len(classes or []), top + 1)]
    schema = image_schema(classes)

    def read(file: str, offset: int, size: int, where: str, index: int, handles: dict[str, Any]) -> bytes:
        try:
            f = handles.get(file)
            if f is None:
                for old in handles.values():
                    old.close()
                handles.clear()
                f = handles[file] = open(file, "rb")
            f.seek(offset)
            data = f.read() if size < 0 else f.read(size)
        except OSError as exc:
            raise RewriteError(f"sample {index} ({where}): cannot read: {exc}") from exc
        if size >= 0 and len(data) != size:
            raise RewriteError(f"sample {index} ({where}): file is truncated ({len(data)} of {size} bytes)")
        try:
            checked_format(data, index, where, file)
        except DatasetError as exc:  # not an image: the message names the file
            raise RewriteError(str(exc)) from exc
        return data

    def batches() -> Iterator[pa.RecordBatch]:
        handles: dict[str, Any] = {}
        try:
            for start in range(0, len(samples), rows_per_batch):
                part = samples[start : start + rows_per_batch]
                data = [read(f, o, s, w, start + k, handles) for k, (f, o, s, _, _, w) in enumerate(part)]
                image = pa.StructArray.from_arrays(
                    [pa.array(data, pa.binary()), pa.array([key for _, _, _, key, _, _ in part], pa.string())],
                    fields=list(schema.field("image").type),
                )
                yield pa.RecordBatch.from_arrays(
                    [image, pa.array([label for *_, label, _ in part], pa.int64())], schema=schema
                )
        finally:
            for f in handles.values():
                f.close()

    return _Source(fmt, schema, len(samples), batches)


def _open_source(path: Path, fmt: str, rows_per_batch: int) -> _Source:
    if fmt == "arrow":
        return _ipc_source(fmt, f"Arrow dataset {path}", _data_files(path, ARROW_SUFFIXES, "Arrow dataset"))
    if fmt == "hf":
        return _hf_source(path)
    if fmt == "parquet":
        return _parquet_source(path)
    if fmt in _IMAGE_FORMATS:
        return _image_source(path, fmt, rows_per_batch)
    raise RewriteError(f"{path}: cannot rewrite format {fmt!r}; formats: {', '.join(FORMATS)}")


# --- writing ---------------------------------------------------------------------------


class _Parts:
    """Writes record batches of exactly `rows_per_batch` rows (the last may be shorter) into
    IPC file-format parts, uncompressed, starting a new part once one passes `max_file_bytes`."""

    def __init__(
        self, folder: Path, schema: pa.Schema, rows_per_batch: int, max_file_bytes: int, on_rows: Callable[[int], Any]
    ):
        self.folder = folder
        self.schema = schema
        self.rows_per_batch = rows_per_batch
        self.max_file_bytes = max_file_bytes
        self.on_rows = on_rows
        self.files: list[Path] = []
        #: Rows written so far.
        self.rows = 0
        self._options = pa.ipc.IpcWriteOptions(compression=None)
        self._sink: Any = None
        self._writer: Any = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        # The dataset's schema (files may differ in metadata only); zero-copy but for
        # dictionary-encoded columns, which are decoded.
        columns = [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in batch.columns]
        batch = pa.RecordBatch.from_arrays(columns, schema=self.schema)
        n, offset, rpb = batch.num_rows, 0, self.rows_per_batch
        if self._pending_rows:
            offset = min(rpb - self._pending_rows, n)
            self._pending.append(batch.slice(0, offset))
            self._pending_rows += offset
            if self._pending_rows == rpb:
                self._flush_pending()
        while n - offset >= rpb:
            self._write(batch.slice(offset, rpb))  # a slice: the writer copies only its rows
            offset += rpb
        if offset < n:
            self._pending.append(batch.slice(offset))
            self._pending_rows += n - offset

    def _flush_pending(self) -> None:
        pending = [b for b in self._pending if b.num_rows]
        self._pending, self._pending_rows = [], 0
        if pending:
            self._write(pending[0] if len(pending) == 1 else pa.concat_batches(pending))

    def _open_part(self) -> None:
        path = self.folder / PART_NAME.format(len(self.files))
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema, options=self._options)
        self.files.append(path)

    def _close_part(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def _write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            self._open_part()
        try:
            self._writer.write_batch(batch)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise RewriteError(f"cannot write {self.files[-1]}: {exc}") from exc
        self.rows += batch.num_rows
        self.on_rows(batch.num_rows)
        if self._sink.tell() >= self.max_file_bytes:
            self._close_part()

    def close(self) -> None:
        self._flush_pending()
        if not self.files:  # no rows: one part with the schema, so DST is still a dataset
            self._open_part()
        self._close_part()

    def abort(self) -> None:
        try:
            self._close_part()
        except Exception:  # the folder is removed anyway
            pass


# --- the command -----------------------------------------------------------------------


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    real_src, real_dst = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    if _inside(real_dst, real_src):
        raise RewriteError(f"destination {dst} is inside the source {src}: choose a folder outside it")
    if _inside(real_src, real_dst):
        raise RewriteError(f"the source {src} is inside the destination {dst}: choose another destination")
    if dst.exists() or dst.is_symlink():
        is_dir = dst.is_dir()
        if (not is_dir or any(dst.iterdir())) and not overwrite:
            what = "is a folder that is not empty" if is_dir else "is a file"
            raise RewriteError(f"destination {dst} {what}; pass overwrite=True (--overwrite) to replace it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _install(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished `tmp` to `dst` (replacing it when `overwrite`)."""
    if dst.exists() or dst.is_symlink():
        if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
            os.replace(tmp, dst)  # rename onto an empty folder
            return
        if not overwrite:
            raise RewriteError(f"destination {dst} was filled by someone else while rewriting; nothing written")
        old = dst.with_name(f"{dst.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(dst, old)
        os.replace(tmp, dst)
        _remove(old)
        return
    os.replace(tmp, dst)


def rewrite(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    rows_per_batch: int = 64,
    format: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    max_file_bytes: int = 2 << 30,
) -> RewriteResult:
    """Rewrite the dataset at `src` (any format croupier serves; `format` is detected when
    not given) into `dst`, a folder of uncompressed Arrow IPC file-format parts of
    `rows_per_batch`-row record batches (see the module docstring). Shows a tqdm bar of
    rows on stderr unless `progress` is False (none when stderr is not a terminal).

    Raises RewriteError (a DatasetError) naming the path when the source is unreadable or
    `dst` is refused: not empty (unless `overwrite`), or inside `src`.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    if rows_per_batch < 1:
        raise RewriteError(f"rows_per_batch must be at least 1, not {rows_per_batch}")
    if max_file_bytes < 1:
        raise RewriteError(f"max_file_bytes must be positive, not {max_file_bytes}")
    src_path, dst_path = Path(src), Path(dst)
    if not src_path.exists():
        raise RewriteError(f"source {src_path} does not exist")
    if format is not None and format not in FORMATS:
        raise RewriteError(f"{src_path}: unknown format {format!r}; formats: {', '.join(FORMATS)}")
    _check_destination(src_path, dst_path, overwrite)
    fmt = format or detect_format(src_path)
    source = _open_source(src_path, fmt, rows_per_batch)

    tmp = dst_path.with_name(f"{dst_path.name}.tmp-{os.getpid()}")
    _remove(tmp)  # left by an earlier run that had this pid and was killed
    tmp.mkdir(parents=True)
    bar = tqdm(total=source.num_rows, unit="rows", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
               desc=f"rewrite {src_path.name}", disable=None if progress else True)
    parts = _Parts(tmp, _plain_schema(source.schema), rows_per_batch, max_file_bytes, bar.update)
    try:
        with bar:
            for batch in source.batches():
                parts.add(batch)
            parts.close()
        if parts.rows != source.num_rows:  # e.g. a stream file appended to while rewriting
            raise RewriteError(f"{src_path}: read {parts.rows} rows, its metadata said {source.num_rows}")
        names = [f.name for f in parts.files]
        manifest = {
            "source": os.path.abspath(src_path),
            "source_format": fmt,
            "rows": source.num_rows,
            "rows_per_batch": rows_per_batch,
            "max_file_bytes": max_file_bytes,
            "files": names,
            "croupier_version": __version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        detected = detect_format(tmp)
        if detected != "arrow":  # the server must serve DST as a folder of Arrow files
            raise RewriteError(f"{tmp}: the rewritten folder is detected as {detected!r}, not 'arrow'")
        nbytes = sum(f.stat().st_size for f in parts.files)
        _install(tmp, dst_path, overwrite)
    except BaseException:
        parts.abort()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RewriteResult(
        src=str(src_path),
        dst=str(dst_path),
        source_format=fmt,
        rows=source.num_rows,
        rows_per_batch=rows_per_batch,
        files=[str(dst_path / n) for n in names],
        bytes=nbytes,
        seconds=time.perf_counter() - start,
    )
