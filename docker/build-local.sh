#!/usr/bin/env bash
# Build and run croupier's images with no container registry: a Debian base made with
# debootstrap, imported into podman, both images built on it, the server image run until
# `croupier health` answers SERVING, then the compose demo.
#
#   docker/build-local.sh base      # the debootstrap base (cached, see CACHE below)
#   docker/build-local.sh server    # base + croupier-server, run on a generated dataset, health SERVING
#   docker/build-local.sh trainer   # base + croupier-trainer (torch CPU from TORCH_WHEELS)
#   docker/build-local.sh compose   # both images + compose.yaml's demo (podman-compose)
#   docker/build-local.sh all       # server, trainer, compose
#
# Needs root, podman (crun, or runc where crun refuses the cgroups), debootstrap, and a Debian
# mirror and PyPI reachable (the images' pip installs); podman-compose for `compose` (pip install
# podman-compose; Debian 12's podman 4.3 has no `podman compose`). Environment:
#   CACHE        where the base's tarball is kept (default ~/.cache/croupier/images); delete
#                it to rebuild the base. The images live in podman's own storage.
#   MIRROR       the Debian mirror (default http://deb.debian.org/debian)
#   TORCH_WHEELS a folder holding torch==2.13.0's CPU wheel, mounted into the trainer's build
#                as pip's find-links (default /opt/wheels, where this machine's pip finds it:
#                `pip config list` shows find-links=/opt/wheels). PyPI's torch is the CUDA
#                build (GBs) and download.pytorch.org, the Dockerfile's default index, is not
#                reachable here; with this folder pip takes 2.13.0+cpu from it.
#   PORT         the host port the server's test run listens on (default 50061)
#   HOST_CA      the CA bundle the base trusts (default the host's,
#                /etc/ssl/certs/ca-certificates.crt: pip then works behind a TLS-inspecting proxy)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${CACHE:-$HOME/.cache/croupier/images}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
PORT=${PORT:-50061}
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
# Debian 12 (bookworm) is what python:3.11-slim is built on, and its python3 is 3.11 (the
# Dockerfiles' PYTHON=3.11; pyproject.toml requires >=3.11).
SUITE=bookworm
BASE=localhost/croupier-base:python3.11-$SUITE

say() { printf '== %s\n' "$*" >&2; }

# podman's defaults that this kind of machine refuses (a VM without CAP_SYS_RESOURCE, hybrid
# cgroups): its containers start with nofile=1048576, which root cannot set without
# CAP_SYS_RESOURCE ("crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted"), so they get
# the host's own limits (nproc capped at 32768: this VM's hard limit, 96364, was refused all
# the same); and crun refuses a host whose cgroup v2 hierarchy holds controllers beside v1
# ones ("cgroups in hybrid mode not supported, drop all controllers from cgroupv2"), where
# runc works. Written to a file of this script's own (CONTAINERS_CONF), not /etc/containers.
podman_setup() {
    local conf=$CACHE/containers.conf runtime=crun nproc
    nproc=$(ulimit -Hu)
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    if [ -n "$(cat /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null)" ]; then runtime=runc; fi
    mkdir -p "$CACHE"
    cat >"$conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc:$nproc"]
[engine]
runtime = "$runtime"
EOF
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$conf}
    say "podman: runtime $runtime, limits nofile=$(ulimit -Hn) nproc=$nproc ($CONTAINERS_CONF)"
}

build_base() {
    if podman image exists "$BASE"; then
        say "base $BASE is there"
        return
    fi
    local tarball="$CACHE/$SUITE-python3.11.tar"
    if [ ! -f "$tarball" ]; then
        local root
        root=$(mktemp -d)
        say "debootstrap $SUITE from $MIRROR into $root (a few minutes)"
        # python3-dev: the headers the native read pool (server/storage/_preadpool.c) compiles
        # against, as the official image has them; python3-venv: pip without Debian's PEP 668 block.
        debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
            "$SUITE" "$root" "$MIRROR" >&2
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        mkdir -p "$CACHE"
        tar -C "$root" --numeric-owner -cf "$tarball.part" .
        mv "$tarball.part" "$tarball"
        rm -rf "$root"
    fi
    say "importing $tarball"
    podman import "$tarball" localhost/croupier-debootstrap:$SUITE >/dev/null
    # What the Dockerfiles expect of python:3.11-slim: `python` and `pip` on PATH, pip
    # installing as root, a UTF-8 locale. The base trusts the certificate authorities the
    # host trusts (HOST_CA): behind a TLS-inspecting proxy, as on this project's machines,
    # pip reaches PyPI only with the proxy's CA, which Debian's bundle lacks.
    local ctx
    ctx=$(mktemp -d)
    cp "$HOST_CA" "$ctx/ca-certificates.crt"
    podman build -t "$BASE" -f - "$ctx" >&2 <<EOF
FROM localhost/croupier-debootstrap:$SUITE
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/python && /opt/python/bin/python -m pip --version
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
EOF
    rm -rf "$ctx"
}

build_server() {
    build_base
    say "building croupier-server on $BASE"
    podman build --format docker --network host --build-arg BASE_IMAGE="$BASE" -t localhost/croupier-server \
        -f docker/Dockerfile . >&2
}

build_trainer() {
    build_base
    [ -f "$(ls "$TORCH_WHEELS"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1)" ] \
        || { echo "no torch-2.13.0+cpu wheel in TORCH_WHEELS=$TORCH_WHEELS" >&2; exit 2; }
    say "building croupier-trainer on $BASE (torch from $TORCH_WHEELS)"
    podman build --format docker --network host --build-arg BASE_IMAGE="$BASE" \
        --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg PIP_FIND_LINKS=/wheels \
        -v "$(realpath "$TORCH_WHEELS")":/wheels:ro -t localhost/croupier-trainer -f docker/Dockerfile.trainer . >&2
}

# Serve a generated dataset from the server image; wait for its HEALTHCHECK command to pass,
# then ask `croupier health` (in the container and, where croupier is installed, from the
# host through the published port) and read one epoch with the torch-free client.
SERVER_CONTAINER=croupier-build-local-server
run_server() {
    DATA=$(mktemp -d)
    trap 'podman rm -f "$SERVER_CONTAINER" >/dev/null 2>&1 || true; rm -rf "$DATA"' EXIT
    # Written by the image's own pyarrow: the host needs no Python packages.
    podman run --rm --user 0 --entrypoint python -v "$DATA:/data" localhost/croupier-server -c '
import pyarrow as pa
table = pa.table({"id": pa.array(range(1000), pa.int64()), "text": [f"row {i}" for i in range(1000)]})
with pa.OSFile("/data/rows.arrow", "wb") as f, pa.ipc.new_file(f, table.schema) as w:
    w.write_table(table)'
    chmod -R a+rX "$DATA"
    podman rm -f "$SERVER_CONTAINER" >/dev/null 2>&1 || true
    say "running croupier-server on 127.0.0.1:$PORT, serving rows=$DATA/rows.arrow (1,000 rows)"
    podman run -d --name "$SERVER_CONTAINER" -p "127.0.0.1:$PORT:50051" -v "$DATA:/data:ro" \
        -e CROUPIER_DATASETS="rows=/data/rows.arrow" -e CROUPIER_INSECURE=1 localhost/croupier-server >/dev/null
    local tries=0
    until podman exec "$SERVER_CONTAINER" python -m croupier.healthcheck 2>/dev/null; do
        tries=$((tries + 1))
        if [ "$tries" -ge 60 ]; then
            podman logs "$SERVER_CONTAINER" >&2
            echo "croupier-server: the image's health check did not pass in 60 s" >&2
            exit 1
        fi
        sleep 1
    done
    podman exec "$SERVER_CONTAINER" croupier health && echo "croupier health (in the container): SERVING"
    if command -v croupier >/dev/null; then
        croupier health "127.0.0.1:$PORT" && echo "croupier health 127.0.0.1:$PORT (from the host): SERVING"
    fi
    # One epoch through the server, with the image's torch-free client: every row once.
    podman exec "$SERVER_CONTAINER" python -c '
from croupier.client import Loader
ids = sorted(i for b in Loader("rows", servers="127.0.0.1:50051", batch_size=64, format="numpy") for i in b["id"].tolist())
assert ids == list(range(1000)), ids[:10]
print(f"one epoch read in the container: {len(ids)} rows, each once")'
    podman exec "$SERVER_CONTAINER" python -c \
        "import croupier.server.storage._preadpool; print('native read pool: built into the image')"
    podman logs "$SERVER_CONTAINER" 2>&1 | sed -n 1,3p >&2
    podman rm -f "$SERVER_CONTAINER" >/dev/null
    rm -rf "$DATA"
    trap - EXIT
}

# compose.yaml's demo with podman-compose, in the order its depends_on conditions ask for.
# podman-compose skips `service_healthy` on podman before 4.6 (Debian 12 has 4.3), and
# podman runs HEALTHCHECKs from systemd timers, which a machine without systemd lacks; so
# the server's health check is run here (`podman healthcheck run`, the image's HEALTHCHECK
# command) until it passes, and only then are the trainers started. `up` whole with
# --abort-on-container-exit would stop at once: podman-compose aborts when `prepare` exits.
COMPOSE=(podman-compose -f docker/compose.yaml)
run_compose() {
    command -v podman-compose >/dev/null || { echo "podman-compose is not installed (pip install podman-compose)" >&2; exit 2; }
    trap '"${COMPOSE[@]}" down -v >/dev/null 2>&1 || true' EXIT
    "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true
    say "compose: prepare the digits, then serve them (docker/compose.yaml)"
    "${COMPOSE[@]}" up -d prepare server >&2
    local server tries=0
    server=$(container_of server)
    until podman healthcheck run "$server" >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [ "$tries" -ge 120 ]; then
            podman logs "$(container_of prepare)" >&2
            podman logs "$server" >&2
            echo "compose: the server's health check did not pass in 120 s" >&2
            exit 1
        fi
        sleep 1
    done
    echo "compose: prepare exited $(podman inspect --format '{{.State.ExitCode}}' "$(container_of prepare)"), server healthy"
    say "compose: 2 trainer ranks"
    "${COMPOSE[@]}" up -d trainer0 trainer1 >&2
    local rank code failed=
    for rank in 0 1; do
        code=$(podman wait "$(container_of trainer$rank)")
        echo "compose: trainer$rank exited $code"
        [ "$code" = 0 ] || failed=1
    done
    podman logs "$(container_of trainer0)" 2>&1 | tail -n 8
    [ -z "$failed" ] || { podman logs "$(container_of trainer1)" >&2; exit 1; }
    "${COMPOSE[@]}" down -v >/dev/null 2>&1
    trap - EXIT
}

# The container podman-compose made for a service of the demo (project croupier-demo).
container_of() {
    podman ps -a --filter label=io.podman.compose.project=croupier-demo \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | sed -n 1p
}

podman_setup
case "${1:-all}" in
    base) build_base ;;
    server) build_server; run_server ;;
    trainer) build_trainer ;;
    compose) build_server; build_trainer; run_compose ;;
    all) build_server; run_server; build_trainer; run_compose ;;
    *) echo "usage: $0 [base|server|trainer|compose|all]" >&2; exit 2 ;;
esac
