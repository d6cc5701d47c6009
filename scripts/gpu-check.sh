#!/usr/bin/env bash
# The GPU checks in one device call: install the carried wheels (if any), run the GPU test
# suite, then the transfer and completion benchmarks. Logs and JSON go to $OUT.
#   bash scripts/gpu-check.sh            # everything
#   bash scripts/gpu-check.sh --quick    # smaller benchmark runs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/asyncoffload-gpu}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/asyncoffload-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/asyncoffload-site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name())'
python3 -c 'from asyncoffload._native import load_cuda_helpers as l; h = l(); print("native CUDA helpers:", "missing" if h is None else f"features={h[1]} (1=host-function wake-ups, 2=batched memcpy)")'

status=0
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" || status=1
if [ "$QUICK" = "--quick" ]; then
  python3 benchmarks/transfer.py --reps 3 --blocks 256,2048 2>&1 | tee "$OUT/transfer.log" || status=1
  python3 benchmarks/completion.py --quick 2>&1 | tee "$OUT/completion.log" || status=1
else
  python3 benchmarks/transfer.py 2>&1 | tee "$OUT/transfer.log" || status=1
  python3 benchmarks/completion.py 2>&1 | tee "$OUT/completion.log" || status=1
fi
exit $status
