#!/usr/bin/env bash
# vLLM's own offloading tests (laid out by scripts/vllm_overlay.py in OVERLAY) against
# asyncoffload's classes (tests/vllm_upstream/upstream_plugin.py), or with `--vllm-own`
# against vLLM's own (the baseline). Runs in OVERLAY, under its pytest.ini, offline.
# `--tiering`: vLLM 0.34's tiering tests that take a tier of vLLM's, with our secondary
# tier in its place (tests/vllm_upstream/tiering_plugin.py).
#   scripts/vllm_upstream.sh PYTHON OVERLAY [--tiering] [--vllm-own] [pytest args...]
set -euo pipefail
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); overlay=$(realpath "$2"); shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
plugin=upstream_plugin
tests=(tests/v1/kv_offload/cpu/test_manager.py tests/v1/kv_connector/unit/offloading_connector)
if [ "${1:-}" = --tiering ]; then
    shift
    plugin=tiering_plugin
    tests=(tests/v1/kv_offload/tiering/test_tiering_offloading.py
        tests/v1/kv_offload/tiering/test_factory.py tests/v1/kv_offload/tiering/test_fs_tier.py)
fi
cd "$overlay"
export HF_HOME="$overlay/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$overlay/site:$overlay:$here/tests/vllm_upstream:$here"
exec "$python" -m pytest -p no:cacheprovider -p "$plugin" --confcutdir=tests/v1 "${tests[@]}" "$@"
