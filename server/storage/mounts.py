"""Which mount a path lies on, and whether it is a FUSE client of an object store.

`mount_of(path)` reads /proc/self/mountinfo (the one parser of it in the product) and
returns the mount that holds `path`: its mount point, file-system type, source, options
and device. `object_store_mount(path)` says whether that mount is a FUSE client of a
bucket (rclone, s3fs, gcsfuse, mountpoint-s3, blobfuse, goofys/geesefs) and, where the
client's own configuration tells, the URL croupier could read the same data from
directly (s3://, gs://, az://), which skips the client: its per-file requests, its
kernel queue, its one-request-at-a-time page reads.

How each client shows in mountinfo (type, source), and where the bucket comes from:

| client | type | source | URL from |
|---|---|---|---|
| rclone mount | fuse.rclone | `remote:bucket/path` | the remote's section of rclone.conf (type, endpoint) |
| s3fs | fuse.s3fs | `s3fs` | the daemon's command line: `s3fs bucket[:/path] MNT -o url=...` |
| gcsfuse | fuse.gcsfuse | the bucket | the source (gs://bucket) |
| mountpoint-s3 | fuse (or fuse.mountpoint-s3) | `mountpoint-s3` | the daemon's command line: `mount-s3 BUCKET MNT [--prefix P] [--endpoint-url U]` |
| blobfuse2 | fuse (or fuse.blobfuse2) | `blobfuse2` | its config file: not derived |
| goofys, geesefs | fuse.goofys, fuse.geesefs | `bucket[:prefix]` | the source |

The rclone and s3fs rows were checked against real mounts here (bench/s3server.py behind
`rclone mount` and `s3fs`, tests/test_open_on_slow_storage.py); the others follow each
client's documentation and source.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"

#: The file-system type or source that names a FUSE client of an object store -> client.
_CLIENT_TYPES = {
    "fuse.rclone": "rclone",
    "fuse.s3fs": "s3fs",
    "fuse.gcsfuse": "gcsfuse",
    "fuse.mountpoint-s3": "mountpoint-s3",
    "fuse.blobfuse2": "blobfuse2",
    "fuse.blobfuse": "blobfuse",
    "fuse.goofys": "goofys",
    "fuse.geesefs": "geesefs",
}
_CLIENT_SOURCES = {"s3fs": "s3fs", "mountpoint-s3": "mountpoint-s3", "blobfuse2": "blobfuse2", "blobfuse": "blobfuse"}

#: rclone backend type -> URL scheme croupier reads.
_RCLONE_SCHEMES = {"s3": "s3", "google cloud storage": "gs", "gcs": "gs", "azureblob": "az"}

#: What a measurement says serving the URL gains over the mount, per client: only what
#: was measured (the real suite, bench/results/real.md at e7d31f0: a loopback store at 20 ms
#: a request, 2 ranks on 2 cores; docs/DESIGN.md section 5.9).
MEASURED_GAIN = {
    "rclone": "measured on a 20 ms store, croupier on s3:// served 8,988 images/s, against 259 through `rclone mount` "
    "with its defaults (a HEAD and a GET an image, 12 at once); text rows that fit croupier's cache are read into it "
    "whole and served from memory either way (45,627 and 42,414 rows/s)",
    "s3fs": "measured on a 20 ms store, croupier on s3:// served 8,988 images/s, against 61 through `s3fs` with its "
    "defaults (about 20 requests to the bucket an image); text rows that fit croupier's cache: 45,627 rows/s on s3:// "
    "against 25,618 through the mount",
}


#: What caps a client's requests to the store with its defaults, and what lifts it: only what
#: bench/results/mount-files.md measured (a loopback store at 20 ms a request, 64 threads
#: opening and reading 2,200-byte files whole). Neither limit is the kernel's max_background:
#: rclone stayed at 12 requests at once with it raised to 256.
CLIENT_LIMITS = {
    "rclone": "rclone itself sends at most --checkers + --transfers requests to the store at once (8 + 4 by "
    "default: 12), and HEADs each file it looks up for its modification time, one lookup at a time per folder: "
    "`--checkers 32` took small-file reads from 254 to 709 files/s (36 requests at once), `--use-server-modtime` "
    "drops the HEAD (42 to 504 files/s in one folder)",
    "s3fs": "s3fs HEADs every file as it lists a folder and again on each open, and with its defaults completed about "
    "65 small files a second however many threads read them (no option of its own measured here raises that)",
}


def client_limit(fs_type: str) -> str | None:
    """CLIENT_LIMITS' line for the client a file-system type names (e.g. fuse.rclone), if measured."""
    client = _CLIENT_TYPES.get(fs_type)
    return CLIENT_LIMITS.get(client) if client else None


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo."""

    mount_point: str
    fs_type: str  # e.g. ext4, nfs4, fuse.rclone
    source: str  # e.g. /dev/sda1, server:/export, remote:bucket
    options: str  # per-mount and super-block options, comma-separated
    device: str  # major:minor

    @property
    def is_fuse(self) -> bool:
        return self.fs_type == "fuse" or self.fs_type.startswith(("fuse.", "fuseblk"))


@dataclass(frozen=True)
class ObjectStoreMount:
    """A path on a FUSE mount of a bucket, and the URL to read instead (None: not derived)."""

    mount: MountInfo
    client: str
    url: str | None
    #: With the URL: the settings it needs (an endpoint); without: why it was not derived.
    note: str = ""

    def message(self, dataset: str, path: str) -> str:
        """The one log line an open writes about it."""
        head = (
            f"dataset {dataset} ({path}) lies on a FUSE mount of an object store: {self.mount.mount_point} "
            f"({self.mount.fs_type}, source {self.mount.source}, client {self.client}); every file read goes through "
            "the client's requests and the kernel's FUSE queue"
        )
        limit = CLIENT_LIMITS.get(self.client)
        keep = f"; to keep the mount: {limit}" if limit else ""
        if self.url is None:
            return f"{head}; could not derive the bucket URL to serve instead ({self.note}){keep}"
        gain = MEASURED_GAIN.get(self.client)
        return f"{head}; serve {self.url} instead{f' ({self.note})' if self.note else ''}{f': {gain}' if gain else ''}{keep}"


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """The mounts of a mountinfo text, in its order (later lines are mounted over earlier)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 6 or len(tail) < 3:
            continue
        mounts.append(
            MountInfo(
                mount_point=unescape(fields[4]),
                fs_type=tail[0],
                source=unescape(tail[1]),
                options=f"{fields[5]},{tail[2]}",
                device=fields[2],
            )
        )
    return mounts


def mount_of(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> MountInfo | None:
    """The mount holding `path` (links resolved): the last-mounted of those whose mount
    point is the longest prefix of it. None where mountinfo cannot be read (not Linux)."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo) as f:
            mounts = parse_mountinfo(f.read())
    except OSError:
        return None
    best: MountInfo | None = None
    for m in mounts:
        mp = m.mount_point
        if real == mp or real.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best.mount_point):
                best = m
    return best


def client_of(mount: MountInfo) -> str | None:
    """The object-store client serving `mount` (None: not one known here)."""
    return _CLIENT_TYPES.get(mount.fs_type) or (_CLIENT_SOURCES.get(mount.source) if mount.is_fuse else None)


def object_store_mount_client(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> str | None:
    """The object-store client whose FUSE mount holds `path` (None: none), cheaply:
    mountinfo only, no look at the client's configuration."""
    mount = mount_of(path, mountinfo)
    return client_of(mount) if mount is not None else None


def object_store_mount(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> ObjectStoreMount | None:
    """`path`'s mount, when it is a FUSE client of an object store, with the URL of
    `path` in the bucket where the client's configuration says it; else None."""
    mount = mount_of(path, mountinfo)
    client = client_of(mount) if mount is not None else None
    if mount is None or client is None:
        return None
    rel = os.path.relpath(os.path.realpath(path), mount.mount_point)
    rel = "" if rel == "." else rel.replace(os.sep, "/")
    derive = _DERIVE.get(client, _not_derived)
    base, note = derive(mount)
    url = None
    if base is not None:  # base may be a bare scheme (a whole account mounted): s3:// + bucket/...
        base = base if base.endswith("://") else base.rstrip("/")
        url = base + ("/" if rel and not base.endswith("://") else "") + rel
    return ObjectStoreMount(mount, client, url, note)


# ---- per client: the bucket URL of the mount point ---------------------------------


def _daemon_args(mount: MountInfo, names: tuple[str, ...]) -> list[str] | None:
    """The command line of the daemon named one of `names` that serves `mount` (it names
    the mount point), if this process may read it."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if args and os.path.basename(args[0]) in names and any(
            os.path.realpath(a) == mount.mount_point for a in args[1:] if a.startswith("/")
        ):
            return args
    return None


def _option(args: list[str], name: str) -> str | None:
    """`--name V`, `--name=V`, or `-o name=V` (s3fs's -o lists, comma-separated)."""
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == "-o" and i + 1 < len(args):
            for opt in args[i + 1].split(","):
                if opt.startswith(f"{name}="):
                    return opt.split("=", 1)[1]
    return None


def _rclone_config(args: list[str] | None) -> Path:
    explicit = _option(args, "config") if args else None
    if explicit:
        return Path(explicit)
    env = os.environ.get("RCLONE_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "rclone" / "rclone.conf"


def _rclone(mount: MountInfo) -> tuple[str | None, str]:
    remote, sep, where = mount.source.partition(":")
    if not sep or not remote:  # ":s3,endpoint=...:bucket": an on-the-fly backend
        return None, f"rclone source {mount.source!r} is not a named remote (an on-the-fly backend)"
    conf = _rclone_config(_daemon_args(mount, ("rclone",)))
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(conf.read_text())
    except (OSError, configparser.Error, UnicodeDecodeError) as exc:
        return None, f"rclone config {conf} is not readable here (encrypted or elsewhere?): {exc}"
    if not parser.has_section(remote):
        return None, f"remote {remote!r} is not in rclone config {conf}"
    section = parser[remote]
    kind = section.get("type", "")
    scheme = _RCLONE_SCHEMES.get(kind)
    if scheme is None:
        return None, f"rclone remote {remote!r} is of type {kind!r}, not s3, gcs or azureblob"
    if scheme == "az":
        account = section.get("account", "")
        if not account:
            return None, f"rclone remote {remote!r} names no storage account"
        return f"az://{account}/{where.strip('/')}", ""
    endpoint = section.get("endpoint", "")
    note = f"with AWS_ENDPOINT_URL={endpoint}" if endpoint and scheme == "s3" else ""
    return f"{scheme}://{where.strip('/')}", note


def _s3fs(mount: MountInfo) -> tuple[str | None, str]:
    args = _daemon_args(mount, ("s3fs",))
    if args is None:
        return None, "the s3fs daemon's command line is not readable from this process"
    positional = [a for i, a in enumerate(args[1:], 1) if not a.startswith("-") and args[i - 1] != "-o"]
    bucket = _option(args, "bucket") or (positional[0] if len(positional) >= 2 else "")
    if not bucket:
        return None, f"no bucket in the s3fs command line {' '.join(args)}"
    name, _, prefix = bucket.partition(":")
    endpoint = _option(args, "url")
    note = f"with AWS_ENDPOINT_URL={endpoint}" if endpoint else ""
    return f"s3://{name}/{prefix.strip('/')}", note


def _mountpoint_s3(mount: MountInfo) -> tuple[str | None, str]:
    args = _daemon_args(mount, ("mount-s3", "mountpoint-s3"))
    if args is None:
        return None, "the mount-s3 daemon's command line is not readable from this process"
    valued = {"--prefix", "--region", "--endpoint-url", "--profile", "--uid", "--gid", "--cache", "--log-directory"}
    positional = [a for i, a in enumerate(args[1:], 1) if not a.startswith("-") and args[i - 1] not in valued]
    if not positional:
        return None, f"no bucket in the mount-s3 command line {' '.join(args)}"
    endpoint = _option(args, "endpoint-url")
    note = f"with AWS_ENDPOINT_URL={endpoint}" if endpoint else ""
    return f"s3://{positional[0]}/{(_option(args, 'prefix') or '').strip('/')}", note


def _bucket_source(scheme: str):
    def derive(mount: MountInfo) -> tuple[str | None, str]:
        bucket, _, prefix = mount.source.partition(":")
        return f"{scheme}://{bucket}/{prefix.strip('/')}", ""

    return derive


def _not_derived(mount: MountInfo) -> tuple[str | None, str]:
    return None, f"{mount.fs_type} keeps its container in its own configuration file"


_DERIVE = {
    "rclone": _rclone,
    "s3fs": _s3fs,
    "mountpoint-s3": _mountpoint_s3,
    "gcsfuse": _bucket_source("gs"),
    "goofys": _bucket_source("s3"),
    "geesefs": _bucket_source("s3"),
}
