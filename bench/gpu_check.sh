#!/usr/bin/env bash
# The GPU check in one command, for a machine with an NVIDIA GPU and this repository:
#   1. generate the kernels' CUDA C with TVM (bench/gpu_export.py) where tvm_ext is installed;
#      elsewhere use bench/gpu_kernels/ as generated on another machine and brought along;
#   2. compile, check against PyTorch and time against cuDNN (bench/gpu_check.py, < 8 minutes).
# Environment: PYTHON (the python with CUDA PyTorch and CuPy; default python3), KERNELS (the
# kernels' folder), EXPORT_ARGS (more arguments for gpu_export.py, e.g. "--sets alexnet"),
# OUT (where gpu_check.md/.json go; default bench/gpu_report).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KERNELS=${KERNELS:-bench/gpu_kernels}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import tvm_ext" 2>/dev/null; then
    .venv/bin/python bench/gpu_export.py --out "$KERNELS" ${EXPORT_ARGS:-}
elif "$PY" -c "import tvm_ext" 2>/dev/null; then
    "$PY" bench/gpu_export.py --out "$KERNELS" ${EXPORT_ARGS:-}
elif [ ! -f "$KERNELS/manifest.json" ]; then
    echo "gpu_check: no tvm_ext here and no $KERNELS/manifest.json;" \
         "run bench/gpu_export.py where tvm_ext is installed and bring $KERNELS along" >&2
    exit 2
fi
exec timeout 480 "$PY" bench/gpu_check.py --kernels "$KERNELS" --report "${OUT:-bench/gpu_report}" "$@"
