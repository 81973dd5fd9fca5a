#!/usr/bin/env bash
# The GPU measurements, in one go, on a CUDA machine with torch already installed (the results
# in bench/results/gpu_pipeline.md and rtp_nccl.md came from this script):
#
#     bash bench/gpu_run.sh OUT_DIR [WHEEL_DIR]
#
# It runs croupier from this checkout without installing it (a package tree of links in
# /tmp/croupier-pkg, the layout pyproject.toml's package-dir gives; the native read pool is not
# built, so the server reads with the Python pool, as it does without a compiler). WHEEL_DIR,
# if given, holds wheels of croupier's server dependencies for that machine's Python,
# installed with --no-index into /tmp/croupier-site (a machine with no package index).
set -uo pipefail
out=${1:?usage: bench/gpu_run.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

site=/tmp/croupier-site pkg=/tmp/croupier-pkg
rm -rf "$pkg" && mkdir -p "$pkg/croupier"
for f in "$repo"/croupier/*; do ln -s "$f" "$pkg/croupier/"; done
ln -s "$repo/server" "$pkg/croupier/server"
ln -s "$repo/client" "$pkg/croupier/client"
ln -s "$repo/protos/croupier/v1" "$pkg/croupier/v1"
ln -s "$repo/bench" "$pkg/croupier/bench"
if [ -n "$wheels" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$site:$pkg"
else
    export PYTHONPATH="$pkg"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c "import sys, torch, grpc, google.protobuf, pyarrow, numpy; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('nccl', torch.cuda.nccl.version()); print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'pyarrow', pyarrow.__version__, 'numpy', numpy.__version__)"
    nproc
} 2>&1 | tee "$out/run.log"

# The native read pool, where a C compiler is (else the server reads with the Python pool).
inc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$py" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if gcc -O2 -shared -fPIC -I"$inc" "$repo/server/storage/_preadpool.c" -o "/tmp/_preadpool$suffix" -lpthread; then
    cp "/tmp/_preadpool$suffix" "$repo/server/storage/" && echo "native read pool built" | tee -a "$out/run.log"
fi

cd "$out" || exit 1
mkdir -p results
# 1. The Loader's copies to the GPU: image-sized rows (27 KB), then full-size ones (147 KB).
timeout 200 "$py" -m croupier.bench.gpu_pipeline --out results/gpu_pipeline.md 2>&1 | tee -a run.log
timeout 200 "$py" -m croupier.bench.gpu_pipeline --rows 4096 --row-bytes 150528 --compute-ratio 1.2 \
    --out results/gpu_pipeline_large.md 2>&1 | tee -a run.log
[ -n "${SKIP_RTP:-}" ] && exit 0
# 2. RTP over NCCL against DDP and FSDP2, one rank per GPU this machine has.
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
timeout 200 "$py" -m croupier.bench.rtp_memory --device cuda --ranks "$gpus" --seq 1024 --micro-batch 8 \
    --warmup 3 --steps 10 --timeout 150 --out results/rtp_nccl.md 2>&1 | tee -a run.log
# 3. Two ranks on one GPU: what NCCL says when a machine has a single GPU.
if [ "$gpus" = 1 ]; then
    timeout 90 "$py" -m croupier.bench.rtp_memory --device cuda --share-gpu --ranks 2 --engines ddp rtp \
        --seq 1024 --micro-batch 8 --warmup 3 --steps 10 --timeout 80 --out results/rtp_nccl_shared.md \
        > shared.log 2>&1
    echo "two ranks on one GPU: exit $?" >> shared.log
    tail -c 6000 shared.log | tee -a run.log
    rm -f shared.log
fi
exit 0
