"""vLLM 0.34's tiering over our Mooncake tier on a real ``mooncake_master``: a round trip
through vLLM's primary region, byte-exact, and a second engine served from the store
(tests/vllm034/mooncake_secondary.py, run in a private network namespace: the master and
the clients listen on every interface). Without the package (or its Debian libraries),
or without ``unshare`` and root, the module skips with one line, as the Mooncake tier's
own tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_mooncake_store import WHY_NOT

if WHY_NOT is not None:
    pytest.skip(f"Mooncake Store: {WHY_NOT}", allow_module_level=True)

SCRIPT = Path(__file__).with_name("mooncake_secondary.py")
TIMEOUT_S = 180
PORT = 50371


def test_chunks_round_trip_through_mooncake_and_a_second_engine_finds_them() -> None:
    cmd = ["unshare", "--net", sys.executable, str(SCRIPT), str(PORT)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{SCRIPT.name} did not finish within {TIMEOUT_S} s")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert seen["written"] == 3
    assert seen["a_answers"] == ["HIT"] * 3 and seen["a_exact"]
    # Unknown to engine B: the store is asked first (RETRY), then each chunk is promoted.
    assert seen["b_first"] == "RETRY"
    assert seen["b_answers"] == ["HIT"] * 3 and seen["b_exact"]
