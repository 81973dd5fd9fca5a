"""WebDataset tar shards with an offset index, for random access to any sample.

Members `dir/key.ext` with the same key form one sample (key = the member path up to
the first dot of its file name). Extensions match ignoring case, by their last part
when no exact one is present (`seg.png` is a png). The image is the member with the
first extension of IMAGE_EXTS; the label is the integer held by a `cls` or `label`
member (or by a `txt` member when it holds one: captions are not labels), -1 when
none; a sample without an image is skipped. Shards are the `.tar` files of a folder in
sorted order, or one `.tar` file; class names, if any, come from `classes.txt` (one
per line) beside the shards. A shard must end with the tar end-of-archive blocks, so a
cut at a member boundary is caught as truncation too.

The offset index (per shard: samples in tar order as key, {ext: [data offset, size]},
label) is built once by scanning the tar headers and cached as JSON, stamped with the
shard's size and mtime and rebuilt when either changes. It is looked up beside the
shard (`<shard>.idx.json`, which lets a read-only dataset ship its index) and then in
the cache folder; it is written to `cache_dir` when one is given, else beside the shard
when that folder is writable and on a local file system, else under
~/.cache/croupier/tar-index. Never beside shards on a FUSE or network mount: through a
bucket mount (rclone, s3fs) each index written there was two PUTs and a DELETE into the
user's bucket.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..storage import Store, default_local_store
from ..storage.fileobj import open_store_file
from ..storage.readpath import LOCAL_FILE_SYSTEMS, mount_of
from .base import DatasetError, DatasetInfo, ImagePayload, Reader, dataset_files
from .images import ImageItem, checked_format, image_payload, read_bytes
from .listing import FilesProgress
from .tree_cache import write_json_atomic

INDEX_VERSION = 2
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif")
LABEL_EXTS = ("cls", "label")  # must hold an integer
OPTIONAL_LABEL_EXTS = ("txt",)  # a label when it holds an integer
CLASSES_FILE = "classes.txt"
_MAX_LABEL_BYTES = 32
_TAR_BLOCK = 512
_MAX_TAIL = 1 << 20  # end-of-archive blocks plus padding to the record size

#: One shard's samples in tar order: (key, {ext: (data offset, size)}, label).
ShardIndex = list[tuple[str, dict[str, tuple[int, int]], int]]


def split_member_name(name: str) -> tuple[str, str]:
    """`dir/key.ext.more` -> ("dir/key", "ext.more")."""
    folder, base = os.path.split(name)
    key, _, ext = base.partition(".")
    return os.path.join(folder, key), ext


def pick_extension(exts: Iterable[str], wanted: Sequence[str]) -> str | None:
    """The extension of the member to use: the first of `wanted` present, else the first
    whose last part is wanted (`seg.png` counts as png), ignoring case."""
    exts = list(exts)
    lowered = {e.lower(): e for e in reversed(exts)}
    for w in wanted:
        if w in lowered:
            return lowered[w]
    return next((e for e in exts if e.rpartition(".")[2].lower() in wanted), None)


def _parse_label(tar: tarfile.TarFile, shard: str, key: str, members: dict[str, tarfile.TarInfo]) -> int:
    for wanted, required in ((LABEL_EXTS, True), (OPTIONAL_LABEL_EXTS, False)):
        ext = pick_extension(members, wanted)
        if ext is None or (not required and members[ext].size > _MAX_LABEL_BYTES):
            continue
        f = tar.extractfile(members[ext])
        raw = f.read() if f is not None else b""
        try:
            return int(raw.decode().strip())
        except (UnicodeDecodeError, ValueError):
            if required:
                raise DatasetError(
                    f"tar shard {shard}: member {key}.{ext} holds {raw[:20]!r}, not an integer label"
                ) from None
    return -1


def _check_end_of_archive(store: Store, shard: str, offset: int, size: int, last: str | None) -> None:
    """tarfile stops quietly at a cut or garbled header; a whole shard ends in zero blocks."""
    tail_len = size - offset
    tail = b""
    if _TAR_BLOCK <= tail_len <= _MAX_TAIL:
        tail = store.read_range(shard, offset, tail_len)
    if not tail or tail.strip(b"\0"):
        after = f"after member {last}" if last else "at its start"
        raise DatasetError(
            f"tar shard {store.url(shard)} is truncated or corrupt {after}: expected the end-of-archive zero blocks at byte "
            f"{offset} of {size}"
        )


def scan_shard(shard: str, store: Store | None = None) -> ShardIndex:
    """Read the tar headers (and label members) of one shard; errors name shard and member.

    Through `store`, sequential reads of 1 MiB: on an object store this reads most of
    the shard once, which is why the index is cached."""
    store = store if store is not None else default_local_store()
    url = store.url(str(shard))
    shard = str(shard)
    size = store.size(shard)
    grouped: dict[str, dict[str, tarfile.TarInfo]] = {}
    last = None
    try:
        with open_store_file(store, shard) as fileobj, tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for member in tar:
                if member.offset_data + member.size > size:
                    raise DatasetError(
                        f"tar shard {url} is truncated: member {member.name} needs bytes up to "
                        f"{member.offset_data + member.size}, the file has {size}"
                    )
                last = member.name
                if member.isfile():
                    key, ext = split_member_name(member.name)
                    grouped.setdefault(key, {})[ext] = member
            _check_end_of_archive(store, shard, tar.offset, size, last)
            return [
                (key, {ext: (m.offset_data, m.size) for ext, m in members.items()}, _parse_label(tar, url, key, members))
                for key, members in grouped.items()
            ]
    except (tarfile.TarError, EOFError, OSError) as exc:
        after = f" after member {last}" if last else ""
        raise DatasetError(f"tar shard {url} is corrupt or truncated{after}: {exc}") from exc


def _cache_folder(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "croupier" / "tar-index"


def index_locations(shard: Path, cache_dir: str | os.PathLike | None) -> tuple[Path, Path]:
    """Where the shard's index may be read from, in order: beside the shard, in the cache folder."""
    digest = hashlib.sha1(str(shard.resolve()).encode()).hexdigest()[:16]
    return shard.with_name(shard.name + ".idx.json"), _cache_folder(cache_dir) / f"{shard.name}.{digest}.idx.json"


def _writes_beside(shard: Path, cache_dir: str | os.PathLike | None) -> bool:
    """Whether a scanned index goes beside the shard (else to the cache folder). Asked only
    when one is written: an open that finds its indexes reads no mount table per shard."""
    return cache_dir is None and os.access(shard.parent, os.W_OK) and _on_local_fs(shard.parent)


def _on_local_fs(folder: Path) -> bool:
    """Whether `folder` lies on a local file system (readpath.LOCAL_FILE_SYSTEMS), where
    an index beside the shards costs a local write, not a request to remote storage."""
    try:
        return mount_of(os.stat(folder).st_dev, str(folder)).fs_type in LOCAL_FILE_SYSTEMS
    except OSError:
        return False


def _read_index(path: Path, stamp: dict[str, int]) -> ShardIndex | None:
    try:
        cached = json.loads(path.read_text())
        if cached.get("stamp") != stamp:
            return None
        return [(k, {e: (o, s) for e, (o, s) in m.items()}, int(label)) for k, m, label in cached["samples"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, stale or unreadable: rescan


def _write_index(path: Path, stamp: dict[str, int], samples: ShardIndex) -> None:
    write_json_atomic(path, {"stamp": stamp, "samples": samples})


def load_index(shard: str | Path, cache_dir: str | os.PathLike | None = None, store: Store | None = None) -> ShardIndex:
    """The shard's offset index, from a cache file that still matches the shard, else scanned.

    On an object store the stamp is the object's size and URL, and the index is cached
    under `cache_dir` (or ~/.cache/croupier/tar-index) only."""
    store = store if store is not None else default_local_store()
    if store.scheme != "file":
        url = store.url(str(shard))
        stamp: dict[str, int | str] = {"version": INDEX_VERSION, "size": store.size(str(shard)), "url": url}
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        beside, cached = None, _cache_folder(cache_dir) / f"{url.rsplit('/', 1)[-1]}.{digest}.idx.json"
    else:
        shard = Path(shard)
        st = shard.stat()
        stamp = {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        beside, cached = index_locations(shard, cache_dir)
    for path in (beside, cached):
        samples = _read_index(path, stamp) if path is not None else None  # type: ignore[arg-type]
        if samples is not None:
            return samples
    samples = scan_shard(str(shard), store)
    target = beside if beside is not None and _writes_beside(Path(shard), cache_dir) else cached
    _write_index(target, stamp, samples)  # type: ignore[arg-type]
    return samples


class WebDatasetReader(Reader):
    format = "webdataset"
    #: Decode every image in `encode` before sending it (--verify-images).
    verify_images = False

    def __init__(self, name: str, path: str, cache_dir: str | os.PathLike | None = None, store: Store | None = None):
        super().__init__(name, path, store=store)
        self.shards = dataset_files(self.store, path, (".tar",), "WebDataset")
        for shard in self.shards:
            self.store.pin(shard)  # read at member offsets for the dataset's life: keep it open
        # Per sample: (shard number, member name, data offset, size, label)
        self.samples: list[tuple[int, str, int, int, int]] = []
        progress = FilesProgress(f"dataset {name} ({self.store.url(path)})", len(self.shards), "shard indexes")
        for sno, shard in enumerate(self.shards):
            for key, members, label in load_index(shard, cache_dir, self.store):
                ext = pick_extension(members, IMAGE_EXTS)
                if ext is not None:
                    self.samples.append((sno, f"{key}.{ext}", *members[ext], label))
            progress.step()
        progress.finish()
        if not self.samples:
            raise DatasetError(f"WebDataset {path}: no sample has an image member ({', '.join(IMAGE_EXTS)})")
        folder = self.shards[0].rsplit("/", 1)[0] if "/" in self.shards[0] else ""
        classes_file = self.store.join(folder, CLASSES_FILE) if folder else CLASSES_FILE
        self.classes: tuple[str, ...] = ()
        if self.store.is_file(classes_file):
            text = self.store.read_file(classes_file).decode("utf-8", errors="replace")
            self.classes = tuple(line.strip() for line in text.splitlines() if line.strip())

    def __len__(self) -> int:
        return len(self.samples)

    def info(self) -> DatasetInfo:
        return DatasetInfo(
            name=self.name, num_rows=len(self), kind="image", format=self.format, path=self.path, classes=self.classes
        )

    async def read(self, index: int, columns: Sequence[str] = ()) -> ImageItem:
        self.check_index(index)
        sno, member, offset, size, label = self.samples[index]
        shard = self.shards[sno]
        url = self.store.url(shard)
        where = f"{url}:{member}"
        data = await read_bytes(self.store, shard, index, where, offset, size)
        return ImageItem(index, data, label, checked_format(data, index, where, url), member, where)

    def encode(self, items: Sequence[ImageItem], columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images, self.verify_images)

    def encodes_on_loop(self, decode_images: bool, nbytes: int) -> bool:
        return not decode_images and not self.verify_images  # records of the bytes as read

    def close(self) -> None:
        for f in self.shards:
            self.store.unpin(f)
