"""WebDataset tar shards with an offset index, for random access to any sample.

Members `dir/key.ext` with the same key form one sample (key = path up to the first
dot of the file name). The image is the first member with an image extension; the
label comes from a `cls`, `label` or `txt` member holding an integer. The index (per
shard: key -> {ext: [offset, size]}) is built once by scanning the tar headers and
cached beside the shard as `<shard>.idx.json`, or under `cache_dir` when the data
folder is read-only; it is rebuilt when the shard's size or mtime changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import aiofiles

from .base import DatasetError, DatasetInfo, ImagePayload, Reader, SampleError
from .images import checked_format, image_payload

INDEX_VERSION = 1
LABEL_EXTENSIONS = ("cls", "label", "txt")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif")


def _split(name: str) -> tuple[str, str]:
    folder, base = os.path.split(name)
    key, _, ext = base.partition(".")
    return os.path.join(folder, key), ext.lower()


def scan_shard(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """Samples of one shard in tar order: (key, {ext: (data offset, size)})."""
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    size = path.stat().st_size
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise DatasetError(f"tar shard {path}: member {member.name} is truncated")
                key, ext = _split(member.name)
                samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DatasetError(f"tar shard {path} is corrupt or truncated: {exc}") from exc
    return list(samples.items())


def _index_path(shard: Path, cache_dir: str | None) -> Path:
    beside = shard.with_name(shard.name + ".idx.json")
    if cache_dir is None and os.access(shard.parent, os.W_OK):
        return beside
    base = Path(cache_dir or Path.home() / ".cache" / "croupier" / "tar-index")
    digest = hashlib.sha1(str(shard.resolve()).encode()).hexdigest()[:16]
    return base / f"{shard.name}.{digest}.idx.json"


def load_index(shard: Path, cache_dir: str | None = None) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """The shard's offset index, from the cache when it still matches the shard."""
    st = shard.stat()
    stamp = {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    idx_path = _index_path(shard, cache_dir)
    try:
        cached = json.loads(idx_path.read_text())
        if cached.get("stamp") == stamp:
            return [(k, {e: tuple(v) for e, v in m.items()}) for k, m in cached["samples"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    samples = scan_shard(shard)
    try:
        idx_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = idx_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "samples": samples}))
        tmp.replace(idx_path)
    except OSError:
        pass  # a read-only cache only costs a rescan next time
    return samples


class WebDatasetReader(Reader):
    format = "webdataset"

    def __init__(self, name: str, path: str, cache_dir: str | None = None):
        super().__init__(name, path)
        p = Path(path)
        shards = sorted(p.glob("*.tar")) if p.is_dir() else [p]
        if not shards or not all(s.is_file() for s in shards):
            raise DatasetError(f"WebDataset {path}: no .tar shards found")
        self.shards = shards
        # Per sample: (shard number, key, image ext, (offset, size), label)
        self.samples: list[tuple[int, str, str, tuple[int, int], int]] = []
        for sno, shard in enumerate(shards):
            for key, members in load_index(shard, cache_dir):
                image_ext = next((e for e in IMAGE_EXTS if e in members), None)
                if image_ext is None:
                    continue
                label = -1
                for ext in LABEL_EXTENSIONS:
                    if ext in members:
                        label = self._read_label(shard, key, ext, members[ext])
                        break
                self.samples.append((sno, key, image_ext, members[image_ext], label))
        if not self.samples:
            raise DatasetError(f"WebDataset {path}: no samples with an image member")

    @staticmethod
    def _read_label(shard: Path, key: str, ext: str, where: tuple[int, int]) -> int:
        with open(shard, "rb") as f:
            f.seek(where[0])
            raw = f.read(where[1])
        try:
            return int(raw.decode().strip())
        except ValueError:
            raise DatasetError(f"tar shard {shard}: {key}.{ext} holds {raw[:20]!r}, not an integer label") from None

    def __len__(self) -> int:
        return len(self.samples)

    def info(self) -> DatasetInfo:
        return DatasetInfo(name=self.name, num_rows=len(self), kind="image", format=self.format, path=self.path)

    async def read(self, index: int) -> tuple[int, bytes, int, str, str]:
        self.check_index(index)
        sno, key, ext, (offset, size), label = self.samples[index]
        shard = self.shards[sno]
        where = f"{shard.name}:{key}.{ext}"
        try:
            async with aiofiles.open(shard, "rb") as f:
                await f.seek(offset)
                data = await f.read(size)
        except OSError as exc:
            raise SampleError(f"sample {index} ({where}): cannot read: {exc}", index=index, path=str(shard)) from exc
        if len(data) != size:
            raise SampleError(f"sample {index} ({where}): shard is truncated", index=index, path=str(shard))
        return index, data, label, checked_format(data, index, where), f"{key}.{ext}"

    def encode(self, items: Sequence, columns: Sequence[str] = (), decode_images: bool = False) -> ImagePayload:
        return image_payload(items, decode_images)
