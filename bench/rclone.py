"""A real `rclone mount` of a bucket of the loopback S3 server, with rclone's defaults:
how users reach a bucket through a FUSE mount (tests and benchmarks alike).

`rclone_unusable()` says why not (None when usable): rclone is a Debian package
(`apt-get install -y rclone`; .ci/run tries), and FUSE needs /dev/fuse and fusermount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REMOTE = "bench"


def rclone_unusable() -> str | None:
    if shutil.which("rclone") is None:
        return "rclone is not installed (apt-get install -y rclone)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "no fusermount3/fusermount (apt-get install -y fuse3)"
    return None


def write_config(folder: Path, endpoint: str) -> Path:
    conf = folder / "rclone.conf"
    conf.write_text(
        f"[{REMOTE}]\ntype = s3\nprovider = Other\nendpoint = {endpoint}\naccess_key_id = test\nsecret_access_key = test\n"
    )
    return conf


@contextlib.contextmanager
def rclone_mounted(endpoint: str, bucket: str, timeout: float = 20.0) -> Iterator[Path]:
    """`rclone mount bench:BUCKET MNT` (defaults), the remote in a config file of its own;
    yields the mount point, unmounts and reaps the daemon on exit."""
    work = Path(tempfile.mkdtemp(prefix="rclone-"))
    conf = write_config(work, endpoint)
    mnt = work / "mnt"
    mnt.mkdir()
    # rclone 1.60 refuses to start when AWS_CA_BUNDLE is set ("HTTPClient's transport
    # unsupported type"); the loopback server speaks plain http anyway.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    log = open(work / "rclone.log", "wb")
    proc = subprocess.Popen(
        ["rclone", "mount", "--config", str(conf), f"{REMOTE}:{bucket}", str(mnt)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
    )
    try:
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone mount did not come up: {(work / 'rclone.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield mnt
    finally:
        for cmd in (["fusermount3", "-u", str(mnt)], ["fusermount", "-u", str(mnt)], ["umount", "-l", str(mnt)]):
            if not os.path.ismount(mnt):
                break
            if shutil.which(cmd[0]):
                subprocess.run(cmd, capture_output=True, timeout=30)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
