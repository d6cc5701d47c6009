"""benchmarks/soak.py, run for a few seconds: it samples, its figures are plausible, a
clean run passes its judge and a run that leaks an fd, a thread and memory per sample
fails it on each count. No timing is asserted (lag and stall bounds are off)."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest

import asyncoffload as ao

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="the soak reads /proc/self (Linux)"
)

# A few seconds, everything attached and exercised at least once after warm-up.
SHORT = [
    "--duration", "3", "--warmup", "1", "--sample-every", "0.1",
    "--rate", "300", "--concurrency", "8", "--cpu-blocks", "1024",
    "--replay-every", "0.5", "--scrape-every", "0.5", "--churn-every", "1",
    "--lag-p99-max-ms", "inf", "--lag-max-ms", "inf", "--stall-s", "inf",
    "--rss-min-growth", "8", "--quiet",
]  # fmt: skip


def test_clean_run_samples_plausibly_and_passes(tmp_path: Path) -> None:
    opts = soak.options(soak.parse_args(SHORT))
    result, verdict = ao.run(soak.run_and_judge(opts, progress=None), use_uvloop=None)
    samples = result.samples
    assert len(samples) >= 20
    assert all(a.t_s < b.t_s for a, b in itertools.pairwise(samples))
    for s in samples:
        assert 10 < s.rss_mib < 64 * 1024
        assert s.fds >= 3
        assert s.os_threads >= s.py_threads >= 1
        assert s.py_blocks > 0
        assert s.in_flight >= 0
        assert math.isnan(s.lag_p99_ms) or 0 <= s.lag_p50_ms <= s.lag_p99_ms <= s.lag_max_ms
    assert all(a.transfers <= b.transfers for a, b in itertools.pairwise(samples))
    assert samples[-1].transfers > 0 and samples[-1].requests > 0
    c = result.counters
    assert c.events > 0 and c.scrapes > 0 and c.churns > 0 and c.cancelled > 0
    assert result.reader["batches"] > 0 and result.reader["replays"] > 0
    assert result.lag.n > 0 and verdict.lag_p50_ms >= 0
    assert verdict.ok, verdict.failures
    assert verdict.fds[0] == verdict.fds[1] and verdict.os_threads[0] == verdict.os_threads[1]
    assert all(passed for passed, _ in result.checks.values()), result.checks
    text = soak.report(result, verdict)
    assert "PASS" in text and "| open fds" in text
    soak.plot(str(tmp_path / "soak.png"), result, verdict)
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_injected_leaks_are_detected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    argv = [*SHORT, "--loop", "asyncio", "--json", str(out)]
    argv += ["--inject-leak", "fd", "--inject-leak", "thread", "--inject-leak", "memory"]
    assert soak.main(argv) == 1
    assert "FAIL" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["verdict"]["ok"] is False
    failures = "\n".join(data["verdict"]["failures"])
    assert "open fds" in failures
    assert "OS threads" in failures and "Python threads" in failures
    assert "RSS grows" in failures
    fds = data["verdict"]["fds"]
    assert fds[1] - fds[0] >= 10  # one per sample after the first window
    # The leaks were given back at the end, so nothing outlives the test.
    assert "soak-leak" not in data["threads_after"]
    assert data["after"]["fds"] <= data["before"]["fds"] + 2
