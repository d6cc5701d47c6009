#!/usr/bin/env bash
# vLLM's own offloading tests (laid out by scripts/vllm_overlay.py in OVERLAY) against
# asyncoffload's classes (tests/vllm_upstream/upstream_plugin.py), or with `--vllm-own`
# against vLLM's own (the baseline). Runs in OVERLAY, under its pytest.ini, offline.
#   scripts/vllm_upstream.sh PYTHON OVERLAY [--vllm-own] [pytest args...]
set -euo pipefail
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); overlay=$(realpath "$2"); shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$overlay"
export HF_HOME="$overlay/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$overlay/site:$overlay:$here/tests/vllm_upstream:$here"
exec "$python" -m pytest -p no:cacheprovider -p upstream_plugin --confcutdir=tests/v1 \
    tests/v1/kv_offload/cpu/test_manager.py tests/v1/kv_connector/unit/offloading_connector \
    "$@"
