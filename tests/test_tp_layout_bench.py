"""benchmarks/tp_layout.py in a tiny configuration (2 ranks, 4 blocks, one repeat), on a
real Valkey server and both disk modes: both layouts round-trip every rank's slice, and
the counts that docs/benchmarks.md quotes hold: one object per block against N, and a
lost rank object is one failed read (nothing copied out) against N - 1 wasted reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tp_layout

from tests.servers import Server


def test_tiny_run_counts_objects_and_the_lost_rank(tmp_path: Path, valkey_server: Server) -> None:
    out = tmp_path / "tp.json"
    argv = [
        "--ranks", "2", "--seg-bytes", "8KiB", "--blocks", "4", "--repeat", "1",
        "--batch-blocks", "2", "--io-threads", "2", "--dir", str(tmp_path),
        "--url", valkey_server.url, "--json", str(out),
    ]  # fmt: skip
    assert tp_layout.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tier"] for r in rows] == ["slab", "files", "valkey"]
    for row in rows:
        rows_, per_rank = row["rows"], row["per-rank"]
        assert (rows_["objects_per_block"], per_rank["objects_per_block"]) == (1, 2)
        assert rows_["stored_bytes_per_block"] == 4096 + 2 * 8192
        assert per_rank["stored_bytes_per_block"] == 2 * (4096 + 8192)
        assert rows_["write_us"] > 0 and per_rank["read_us"] > 0
        # One rank's object lost: rows reads one value, refuses it, copies nothing out;
        # per-rank issues both reads, one of them good (wasted).
        assert (rows_["lost_good_reads"], rows_["lost_failed_reads"]) == (0, 1)
        assert rows_["lost_slices_written"] == 0
        assert (per_rank["lost_good_reads"], per_rank["lost_failed_reads"]) == (1, 1)
        assert per_rank["lost_slices_written"] >= 1
        if row["tier"] == "valkey":
            assert (rows_["write_cmds"], per_rank["write_cmds"]) == (1, 2)
            assert per_rank["lost_found_by_check"] == 1  # the EXISTS of each rank's key
        else:
            assert rows_["write_rw_syscalls"] < per_rank["write_rw_syscalls"]
        if row["tier"] == "files":
            assert per_rank["lost_found_by_check"] == 1  # a stat per rank's file
