"""How long an ImageFolder open takes through `rclone mount` of the loopback S3 server.

    python -m croupier.bench.open_listing --images 6000 --classes 10 --median-ms 20 [--stat-per-file]

Writes N tiny JPEGs into a bucket of bench/s3server.py (fixed latency per request),
mounts the bucket with `rclone mount` and its defaults, and opens the folder with
croupier's ImageFolder reader twice (the second open finds rclone's folder cache warm).
It prints the seconds and the S3 requests by method. `--stat-per-file` also times what
the open cost before (a listing with a stat per file: a HEAD per image through rclone).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import s3server
from .bucket_mount import rclone_mounted


def _tiny_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, format="JPEG")
    return buf.getvalue()


def _write(root: Path, images: int, classes: int) -> None:
    data = _tiny_jpeg()
    for c in range(classes):
        (root / f"class{c:04d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        (root / f"class{i % classes:04d}" / f"{i:08d}.jpg").write_bytes(data)


def _timed(s3, what: str, fn) -> None:
    s3.reset_stats()
    t = time.perf_counter()
    n = fn()
    dt = time.perf_counter() - t
    st = s3.stats()
    print(f"{what}: {n:,} images in {dt:.2f} s ({n / dt:,.0f} files/s); S3 requests {st['requests']:,} {st['by_method']}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m croupier.bench.open_listing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=6000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--median-ms", type=float, default=20.0, help="fixed latency per S3 request (ms)")
    p.add_argument("--stat-per-file", action="store_true", help="also time a listing with a stat per file")
    a = p.parse_args(argv)
    if shutil.which("rclone") is None:
        print("rclone is not installed (apt-get install -y rclone)", file=sys.stderr)
        return 2
    from croupier.server.readers.imagefolder import ImageFolderReader
    from croupier.server.storage.local import LocalStore

    work = Path(tempfile.mkdtemp(prefix="open-listing-"))
    try:
        _write(work / "root" / "data" / "imgs", a.images, a.classes)
        with s3server.running(work / "root", latency=a.median_ms, process=True) as s3:
            with rclone_mounted(s3.endpoint, "data", timeout=30) as mnt:
                store = LocalStore(io_threads=8, native_pool=False)
                for k in ("first", "second"):
                    _timed(s3, f"croupier open ({k})", lambda: len(ImageFolderReader("imgs", str(mnt / "imgs"), store=store)))
                if a.stat_per_file:
                    _timed(s3, "stat per file (the open before)", lambda: sum(
                        1 for d in os.scandir(mnt / "imgs") for e in os.scandir(d.path) if e.stat().st_size >= 0))
                store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
