"""The test suite's own output: what a user sees when running ``make test``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import _shard, shard_of
from tests.helpers import trace_path
from tests.processes import REPO


def test_without_a_gpu_the_gpu_suite_is_summarized_on_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    if torch.cuda.is_available():  # the GPU machine: the suite runs
        assert proc.returncode == 0, proc.stdout[-3000:]
        return
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(skipped) == 1, "\n".join(skipped[:5])
    assert skipped[0].startswith("SKIPPED [") and "tests/gpu" in skipped[0]


def test_the_trace_directory_can_be_given_by_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASYNCOFFLOAD_TRACE_DIR", str(tmp_path))
    assert trace_path() == tmp_path / "conversation_trace.jsonl"
    monkeypatch.delenv("ASYNCOFFLOAD_TRACE_DIR")
    assert trace_path().parent == REPO.parent / "shared" / "traces"


def test_the_skip_summary_fits_100_columns() -> None:
    """A fresh clone has no traces beside it: its skip lines stay within 100 columns."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/gpu",
            "tests/test_workloads.py",
            "-k",
            "gpu or real_conversation",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "ASYNCOFFLOAD_TRACE_DIR": "/nonexistent/" + "deeper/" * 12},
    )
    assert proc.returncode in (0, 5), proc.stdout[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped, proc.stdout[-2000:]
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100, proc.stdout[-3000:]


def test_the_shards_of_the_long_profiles_take_each_test_once() -> None:
    """CI runs one of four shares of `make test-long` per submission (.ci/run): over the
    four, each test runs exactly once, and the shares are even."""
    nodeids = [f"tests/test_{i % 7}.py::test_{i}" for i in range(30)]
    shares = [shard_of(nodeids, k, 4) for k in range(4)]
    assert sorted(x for share in shares for x in share) == sorted(nodeids)
    assert sorted(len(share) for share in shares) == [7, 7, 8, 8]
    assert shard_of(nodeids, 0, 1) == set(nodeids)


@pytest.mark.parametrize("value", ["4/4", "-1/4", "0/0", "1", "a/b"])
def test_a_bad_shard_is_refused_by_name(value: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"--shard '{value}'"):
        _shard(value)
