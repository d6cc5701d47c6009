#!/usr/bin/env bash
# vLLM 0.34's worker API on the GPU machine (benchmarks/vllm_worker_034.py, and tests/gpu:
# the CUDA paths carry the expedited lane). Two halves:
#   scripts/gpu-vllm034.sh prepare   # here: fills .gpu/ (git-ignored; add "/.gpu/" to
#                                    # .git/info/exclude) with the wheels the GPU machine
#                                    # lacks and vLLM 0.34's Python modules, zipped
#   scripts/gpu-vllm034.sh run       # there, in one device call with carry [".gpu"];
#                                    # results under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    make .vllm-0.34/.complete || exit 1
    mkdir -p .gpu/whl
    rm -f .gpu/vllm034.zip
    (cd .vllm-0.34/site && zip -q -r ../../.gpu/vllm034.zip vllm -i '*.py' \
        && zip -q -r ../../.gpu/vllm034.zip vllm-0.34.0.dist-info) || exit 1
    # The GPU machine's python3 is 3.12 with torch, numpy and transformers, without
    # pydantic, msgspec or pytest (docs/install.md, device notes).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu/whl \
        pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
        typing-inspection==0.4.5 typing_extensions==4.16.0 annotated-types msgspec==0.23.0 \
        pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
    du -sh .gpu
    ;;
run)
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/asyncoffload-gpu}
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit 1
    mkdir -p /tmp/vllm034 && python3 -m zipfile -e .gpu/vllm034.zip /tmp/vllm034 || exit 1
    export PYTHONPATH=/tmp/site:/tmp/vllm034:$PWD
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    status=0
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -x tests/gpu \
        2>&1 | tail -15 | tee "$OUT/gpu-tests.log" || status=1
    timeout 240 python3 benchmarks/vllm_worker_034.py --json "$OUT/worker034.json" \
        > "$OUT/worker034.log" 2>&1 || status=1
    tail -60 "$OUT/worker034.log"
    exit $status
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
