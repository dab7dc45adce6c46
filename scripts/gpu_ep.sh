#!/usr/bin/env bash
# Expert parallelism on 2 GPUs over NCCL: every rank's EP output must equal the single-process
# layer's output (bitwise for implementations declaring "deterministic", within one bf16
# rounding otherwise). Runs the NCCL cases of tests/test_parallel.py: 2 processes spawned on one
# host, FileStore rendezvous, production widths (H=12 and H=3 with a padded head), a rank with
# no tokens.
#
# Usage: scripts/gpu_ep.sh [extra pytest arguments]     (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

# No NVLink multicast / NVLS: the lent H200 machines must not use it (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
PYTHON=${PYTHON:-python3}
"$PYTHON" scripts/wheel_view.py  # the suite as magi_moe.audit/.fuzz/.tests: nothing is installed here

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -lt 2 ]; then
    echo "gpu_ep.sh: needs 2 CUDA GPUs, found $gpus" >&2
    exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
"$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "triton", triton.__version__)'

# -rA: every case and its outcome in the log; a skip here means the GPU run did not happen.
exec "$PYTHON" -m pytest -p no:cacheprovider -v -rA tests/test_parallel.py -k nccl "$@"
