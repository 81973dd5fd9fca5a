"""A bucket of the loopback S3 server mounted by a real FUSE client with its defaults, as
users reach a bucket through a mount: `rclone mount` and `s3fs` (tests and benchmarks).

`rclone_unusable()` / `s3fs_unusable()` say why not (None when usable): both are Debian
packages (`apt-get install -y rclone s3fs`; .ci/run tries rclone), and FUSE needs /dev/fuse
and fusermount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REMOTE = "bench"


def _fuse_unusable(binary: str) -> str | None:
    if shutil.which(binary) is None:
        return f"{binary} is not installed (apt-get install -y {binary})"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "no fusermount3/fusermount (apt-get install -y fuse3)"
    return None


def rclone_unusable() -> str | None:
    return _fuse_unusable("rclone")


def s3fs_unusable() -> str | None:
    return _fuse_unusable("s3fs")


def write_config(folder: Path, endpoint: str) -> Path:
    conf = folder / "rclone.conf"
    conf.write_text(
        f"[{REMOTE}]\ntype = s3\nprovider = Other\nendpoint = {endpoint}\naccess_key_id = test\nsecret_access_key = test\n"
    )
    return conf


@contextlib.contextmanager
def _mounted(name: str, argv: Sequence[str], work: Path, mnt: Path, timeout: float) -> Iterator[Path]:
    """Run the FUSE client `argv` (in the foreground) until `mnt` is a mount; yield it, then
    unmount and reap the client, and remove `work`."""
    # rclone 1.60 refuses to start when AWS_CA_BUNDLE is set ("HTTPClient's transport
    # unsupported type"); the loopback server speaks plain http anyway.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    log_path = work / f"{name}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} mount did not come up: {log_path.read_text()[-2000:]}")
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


@contextlib.contextmanager
def rclone_mounted(endpoint: str, bucket: str, timeout: float = 20.0, options: Sequence[str] = ()) -> Iterator[Path]:
    """`rclone mount bench:BUCKET MNT` (defaults, plus `options`), the remote in a config file
    of its own; yields the mount point, unmounts and reaps the daemon on exit."""
    work = Path(tempfile.mkdtemp(prefix="rclone-"))
    conf = write_config(work, endpoint)
    mnt = work / "mnt"
    mnt.mkdir()
    argv = ["rclone", "mount", "--config", str(conf), f"{REMOTE}:{bucket}", str(mnt), *options]
    with _mounted("rclone", argv, work, mnt, timeout) as m:
        yield m


@contextlib.contextmanager
def s3fs_mounted(endpoint: str, bucket: str, timeout: float = 20.0, options: Sequence[str] = ()) -> Iterator[Path]:
    """`s3fs BUCKET MNT` in the foreground with its defaults, but for what a non-AWS endpoint
    needs (url=, use_path_request_style, a password file of its own); yields the mount
    point, unmounts and reaps the daemon on exit."""
    work = Path(tempfile.mkdtemp(prefix="s3fs-"))
    passwd = work / "passwd"
    passwd.write_text("test:test\n")
    passwd.chmod(0o600)
    mnt = work / "mnt"
    mnt.mkdir()
    argv = ["s3fs", bucket, str(mnt), "-f", "-o", f"url={endpoint}", "-o", "use_path_request_style",
            "-o", f"passwd_file={passwd}", *options]
    with _mounted("s3fs", argv, work, mnt, timeout) as m:
        yield m


#: Each client: how to mount a bucket with it, and why it cannot here (None: it can).
CLIENTS = {"rclone": (rclone_mounted, rclone_unusable), "s3fs": (s3fs_mounted, s3fs_unusable)}
