"""benchmarks/vllm_secondary.py in a tiny configuration (16 blocks, one round), in this
process: both paths run, move every block out and back byte-exact, and are reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_secondary_tier_benchmark_runs_both_paths(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import vllm_secondary

    argv = ["vllm_secondary.py", "--blocks", "16", "--job", "4", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--row-bytes", "8192", "--dir", str(tmp_path)])
    vllm_secondary.main()  # each round checks its blocks came back byte-exact
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["driver", "direct"]
    assert lines[4].startswith("driver - direct: ")
