"""vLLM 0.34's tiering over a Mooncake tier of ours, on a real ``mooncake_master``: run by
tests/vllm034/test_secondary.py inside a private network namespace (``unshare --net``;
the master and the clients listen on every interface).

Engine A (vLLM's primary region, our tier beneath it) stores chunks, empties its primary
tier and promotes them back; while A runs (its segment holds them), engine B, another
engine id with nothing in its index, finds them in the store and loads them. Prints one
JSON object of what it saw; the test asserts.

Run: ``unshare --net python tests/vllm034/mooncake_secondary.py PORT`` (root), with vLLM
0.34's modules on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from tests.mooncake_probe import loopback_up, start_master
from tests.vllm034.helpers import Engine, keys_of, random_rows, tier_entry

ROW = 4096


def scenario(port: int) -> dict[str, Any]:
    tier = {
        "kind": "mooncake",
        "master": f"127.0.0.1:{port}",
        "segment_bytes": 64 << 20,
        "timeout_s": 5.0,
        "admission": None,
    }
    out: dict[str, Any] = {}
    keys = keys_of("m0", "m1", "m2")
    rows = random_rows(3, ROW, seed=11)
    a = Engine([tier_entry(tier)])
    try:
        a.store(keys, rows)
        (stats,) = a.tier.tier_stats()
        out["written"] = stats.blocks_written
        a.forget_primary()
        answers, ctx = a.promote(keys)
        out["a_answers"] = [r.name for r in answers]
        out["a_exact"] = bool(np.array_equal(a.rows_of(keys, ctx), rows))
        b = Engine([tier_entry({**tier, "segment_bytes": 0})])  # a client only
        try:
            ctx = b.request()
            out["b_first"] = b.manager.lookup(keys[0], ctx).name
            answers, ctx = b.promote(keys)
            out["b_answers"] = [r.name for r in answers]
            out["b_exact"] = bool(np.array_equal(b.rows_of(keys, ctx), rows))
        finally:
            b.close()
    finally:
        a.close()
    return out


def main() -> int:
    port = int(sys.argv[1])
    loopback_up()
    master = start_master(port, None)  # the master's own lease (tests/mooncake_probe.py)
    try:
        out = scenario(port)
    finally:
        master.kill()
        master.wait(10)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
