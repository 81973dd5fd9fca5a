#!/bin/sh
# Install what latencyfs needs to build and mount: fuse3 (fusermount3), libfuse3-dev
# (headers, libfuse3.so), pkg-config, and a C compiler.
#
# Idempotent, and never fails its caller: when everything is there it says so; when it
# cannot install (not root, no apt-get, no network) it says what to run and exits 0.
# Check the result with `python -m croupier.bench.latencyfs check`.

PACKAGES="fuse3 libfuse3-dev pkg-config"

missing=""
command -v fusermount3 >/dev/null 2>&1 || missing="$missing fuse3"
if command -v pkg-config >/dev/null 2>&1; then
    pkg-config --exists fuse3 2>/dev/null || missing="$missing libfuse3-dev"
else
    missing="$missing pkg-config libfuse3-dev"
fi
command -v cc >/dev/null 2>&1 || missing="$missing gcc"

if [ -z "$missing" ]; then
    echo "latencyfs: dependencies present (libfuse $(pkg-config --modversion fuse3))"
    [ -e /dev/fuse ] || echo "latencyfs: note: /dev/fuse is missing (modprobe fuse; in docker: --device /dev/fuse --cap-add SYS_ADMIN)"
    exit 0
fi
missing=${missing# }

if [ "$(id -u)" != "0" ]; then
    echo "latencyfs: missing: $missing -- run as root: apt-get install -y $PACKAGES gcc"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "latencyfs: missing: $missing -- no apt-get here; install the equivalents of: $PACKAGES gcc"
    exit 0
fi

echo "latencyfs: installing $missing"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends $missing >/dev/null 2>&1; then
    # the package lists may be absent or stale (fresh containers)
    apt-get update -qq >/dev/null 2>&1 || true
    if ! apt-get install -y --no-install-recommends $missing; then
        echo "latencyfs: apt-get install $missing failed; latencyfs benchmarks will be skipped"
        exit 0
    fi
fi
echo "latencyfs: installed $missing"
[ -e /dev/fuse ] || echo "latencyfs: note: /dev/fuse is missing (modprobe fuse; in docker: --device /dev/fuse --cap-add SYS_ADMIN)"
exit 0
