"""The demo with a shared tier (``--remote redis://...``) on a real Valkey server: two
demo runs, one after the other with the same seed, share it; the second loads what the
first stored (remote hits), checked bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncoffload import cli
from asyncoffload.demo import DemoConfig, DemoConfigError, run_demo
from tests.servers import ValkeyServer

pytest.importorskip("redis", reason="the remote tier needs redis-py")

SMALL: dict[str, Any] = dict(
    requests=60,
    system_prompts=2,
    system_prompt_blocks=4,
    turns=3,
    blocks_per_turn=2.0,
    output_tokens=24.0,
    arrival_rate=400.0,
    think_time_s=0.02,
    cpu_blocks=80,
    layers=2,
    kv_heads=1,
    head_dim=16,
    concurrency=2,
    time_scale=0.0,
)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    """A Valkey server of our own for each test (no persistence, 127.0.0.1)."""
    srv = ValkeyServer(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


def small(**overrides: Any) -> DemoConfig:
    return DemoConfig(**{**SMALL, **overrides})


async def test_blocks_a_full_cpu_tier_held_back_are_counted_and_the_rest_shared(
    server: Any,
) -> None:
    """With 8 CPU slots for 186 blocks, stores are refused while writes to the server
    pin slots: the server then holds exactly what was written, and the shortfall shows
    as refused stores."""
    first = await run_demo(small(remote_url=server.url, cpu_blocks=8), progress=False)
    second = await run_demo(small(remote_url=server.url, cpu_blocks=8), progress=False)
    assert first.ok and second.ok
    (r1,) = first.stats.tiers
    assert r1.write_failures == 0
    asked, found, _ = second.remote_prelookup or (0, 0, 0)
    assert asked == first.unique_blocks
    assert 0 < found == r1.blocks_written < first.unique_blocks, (found, r1)
    assert first.stores_rejected > 0
    assert second.remote_hit_blocks > 0 and second.verified_blocks == second.hit_blocks


async def test_two_demo_runs_share_the_remote_tier(server: Any) -> None:
    # One request at a time, each after the writes before it ended (--settle): what
    # reaches the server is the workload's alone, not the machine's speed (flooded, a
    # busy machine's writes lag and pin CPU slots, and stores are refused: the test
    # above).
    settled = {"remote_url": server.url, "concurrency": 1, "settle": True}
    first = await run_demo(small(**settled), progress=False)
    second = await run_demo(small(**settled), progress=False)
    for report in (first, second):
        assert report.ok, (report.failed_requests, report.mismatches, report.stats.tiers)
    (r1,) = first.stats.tiers
    (r2,) = second.stats.tiers
    assert r1.medium == "REMOTE" and r1.blocks_written > 0 and r1.write_failures == 0
    # The first found nothing on the empty server; the second found what the first wrote.
    assert first.remote_prelookup is not None and first.remote_prelookup[1] == 0
    assert second.remote_prelookup is not None
    asked, found, _ = second.remote_prelookup
    assert asked == first.unique_blocks
    # Each block the first computed was written there, once (a put-if-absent counts
    # only real writes), with no store refused.
    assert found == r1.blocks_written == first.unique_blocks, (found, r1)
    assert first.stores_rejected == 0 and r1.failures == {}, (first.stats, r1)
    # The first has remote hits too: its own blocks, evicted from its CPU tier (80 slots
    # for 186 blocks). The second finds every block on the server from the start.
    assert second.remote_hit_blocks > first.remote_hit_blocks
    assert r2.blocks_read > 0 and r2.read_failures == 0
    assert second.hit_rate > first.hit_rate
    assert second.verified_blocks == second.hit_blocks
    assert second.cpu_hit_blocks + second.remote_hit_blocks == second.lookup_hit_blocks
    rows = dict(second.rows())
    assert rows["hits by tier (blocks)"] == (
        f"CPU {second.cpu_hit_blocks:,} / remote {second.remote_hit_blocks:,}"
    )
    assert f"read {r2.blocks_read:,}" in rows["remote tier"]
    assert "remote lookup (before the run)" in rows


async def test_remote_below_disk(server: Any, tmp_path: Path) -> None:
    await run_demo(small(remote_url=server.url), progress=False)
    report = await run_demo(
        small(remote_url=server.url, disk_path=tmp_path / "tier", disk_bytes="4MiB"),
        progress=False,
    )
    assert report.ok
    disk, remote = report.stats.tiers
    assert (disk.medium, remote.medium) == ("DISK", "REMOTE")
    assert report.remote_hit_blocks > 0
    rows = dict(report.rows())
    assert rows["hits by tier (blocks)"] == (
        f"CPU {report.cpu_hit_blocks:,} / disk {report.disk_hit_blocks:,} "
        f"/ remote {report.remote_hit_blocks:,}"
    )
    assert "disk tier" in rows and "remote tier" in rows


async def test_a_server_that_does_not_answer_is_a_config_error(server: Any) -> None:
    url = server.url
    server.stop()
    with pytest.raises(DemoConfigError, match="does not answer"):
        await run_demo(small(remote_url=url), progress=False)


def test_a_bad_url_is_refused() -> None:
    with pytest.raises(ValueError, match="remote_url"):
        small(remote_url="http://127.0.0.1:1/")


def _demo_argv(*extra: str) -> list[str]:
    argv = ["demo", "--requests", "60", "--cpu-blocks", "80", "--layers", "2"]
    argv += ["--time-scale", "0", "--system-prompt-blocks", "4", "--concurrency", "2"]
    argv += ["--turns", "3", "--blocks-per-turn", "2", "--system-prompts", "2", "--seed", "7"]
    return argv + list(extra)


def _remote_hits(out: str) -> int:
    line = next(line for line in out.splitlines() if "hits by tier" in line)
    return int(line.split("remote")[1].split()[0].replace(",", ""))


def test_two_demo_processes_share_a_server(server: Any, tmp_path: Path) -> None:
    """``asyncoffload demo --remote URL`` twice, as two processes, as the README shows."""
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "asyncoffload", *_demo_argv("--remote", server.url)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(proc.stdout)
    first, second = outs
    assert "remote tier" in first
    assert _remote_hits(second) > _remote_hits(first)
    assert "OK: verified" in second


def test_cli_demo_with_remote(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_demo_argv("--remote", server.url)) == 0
    out = capsys.readouterr().out
    assert "remote tier" in out and "remote lookup (before the run)" in out


def test_cli_remote_option_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--remote", "http://x"])
    assert info.value.code == 2
    assert "--remote" in capsys.readouterr().err
