"""asyncoffload inside real vLLM (CPU platform): served from our tier, outputs unchanged.

Each test starts vLLM with ``AsyncOffloadSpec`` on the tiny random-weight Llama and runs
the baseline's rounds (conftest.py): A; two fillers that overwrite A's GPU blocks (vLLM's
own prefix cache is off); A again, which must come from our CPU tier; A with an early
token changed; three more fillers, which overflow a tier of ``TIER_CHUNKS`` chunks; A
once more. Every request must give the baseline's greedy tokens and logprobs (the
tests in test_harness.py show that a spec which copies nothing would not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import PRESSURE_ROUND, RunVLLM, baseline_rounds
from tests.vllm.harness import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    asyncoffload_kv_transfer_config,
    generation_diff,
    requests_of,
    summarize_events,
)

VLLM_TIMEOUT = 900
#: ``make test-vllm`` runs vLLM with the spec's default, lru; ``make test-long`` the
#: other four too (the differential tests compare every policy's decisions with vLLM's
#: in every run).
POLICIES = (
    "lru",
    pytest.param("kv", marks=pytest.mark.long),
    pytest.param("arc", marks=pytest.mark.long),
    pytest.param("s3fifo", marks=pytest.mark.long),
    pytest.param("sieve", marks=pytest.mark.long),
)
#: The tiny model's KV per 32-token block: 4 layers x (K, V) x 2 heads x 64 x 4 bytes.
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK_SIZE * 4
TIER_CHUNKS = 24
A_BLOCKS = 6


def _assert_same_outputs(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    ours = sorted(result["requests"], key=lambda r: (r["round"], int(r["index"])))
    ref = sorted(baseline["requests"], key=lambda r: (r["round"], int(r["index"])))
    assert [(r["round"], r["index"]) for r in ours] == [(r["round"], r["index"]) for r in ref]
    for mine, theirs in zip(ours, ref, strict=True):
        same, lp_diff = generation_diff(mine, theirs)
        where = f"round {mine['round']} request {mine['index']}"
        assert same, f"{where}: tokens differ from the baseline"
        assert lp_diff < LOGPROB_ATOL, f"{where}: logprobs differ by {lp_diff}"


@pytest.mark.timeout(VLLM_TIMEOUT)
@pytest.mark.parametrize("policy", POLICIES)
def test_repeated_prompt_is_served_from_our_tier_with_identical_outputs(
    policy: str, run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    config = asyncoffload_kv_transfer_config(
        policy=policy, cpu_bytes_to_use=TIER_CHUNKS * BLOCK_BYTES
    )
    result = run_vllm(baseline_rounds(), name=f"ours-{policy}", kv_transfer_config=config)

    _assert_same_outputs(result, reuse_baseline)
    # Nothing to load before A comes back; then all of A's full blocks come from the tier.
    for r in (0, 1):
        assert [q["num_cached_tokens"] for q in requests_of(result, r)] == [0] * len(
            requests_of(result, r)
        )
    (a_again,) = requests_of(result, 2)
    assert a_again["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE
    cached = sum(q["num_cached_tokens"] for q in result["requests"])
    assert result["metrics"]["vllm:external_prefix_cache_hits"] == cached

    # vLLM's KV events carry our tier's stores and evictions (medium CPU).
    events = summarize_events(result)
    stored, removed = events["stored"], events["removed"]
    assert set(events["counts"]) == {"BlockStored:CPU", "BlockRemoved:CPU"}
    assert removed <= stored
    assert len(stored) > TIER_CHUNKS  # the workload offers more than the tier holds
    assert len(stored - removed) <= TIER_CHUNKS
    # Every removal came after the tier filled, that is from round 3 on.
    removal_rounds = {
        batch["round"]
        for batch in result["kv_events"]
        for ev in batch["events"]
        if ev["type"] == "BlockRemoved"
    }
    assert removal_rounds and min(removal_rounds) >= PRESSURE_ROUND - 1
    assert result["kv_events_missing_seqs"] == []

    # Our counters reach vLLM's Prometheus registry, and agree with the events.
    metrics = result["metrics"]
    assert metrics["vllm:asyncoffload_blocks_stored"] == events["counts"]["BlockStored:CPU"]
    assert metrics["vllm:asyncoffload_blocks_evicted"] == events["counts"]["BlockRemoved:CPU"]
    assert metrics["vllm:asyncoffload_ready_blocks"] == TIER_CHUNKS
    assert metrics["vllm:kv_offload_load_bytes"] == cached // BLOCK_SIZE * BLOCK_BYTES


@pytest.mark.long  # a chunk size beside the default one: `make test-long`
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_chunks_of_two_blocks_serve_the_repeated_prompt(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any]
) -> None:
    """``block_size`` 64 in the extra config: one key and one host slot per two GPU
    blocks (blocks_per_chunk 2)."""
    config = asyncoffload_kv_transfer_config(
        policy="lru", block_size=2 * BLOCK_SIZE, cpu_bytes_to_use=64 << 20
    )
    result = run_vllm(baseline_rounds(), name="ours-bpc2", kv_transfer_config=config)
    _assert_same_outputs(result, reuse_baseline)
    (a_again,) = requests_of(result, 2)
    assert a_again["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE  # three chunks of two
    events = summarize_events(result)
    # One stored hash per chunk: A 3, fillers 6, A changed at token 0: 3, at token 100:
    # the 2 chunks after its first (a hit), fillers 9. Nothing evicted from 64 MiB.
    assert events["counts"] == {"BlockStored:CPU": 3 + 6 + 3 + 2 + 9}
    (changed_late,) = requests_of(result, 3)[1:]
    assert changed_late["num_cached_tokens"] == 2 * BLOCK_SIZE


# `make test-long` (the budget of `make test-vllm`): test_cost_vllm.py serves prompts from
# a disk tier through the workers' host pool, outputs compared and the pool files checked.
@pytest.mark.long
@pytest.mark.timeout(VLLM_TIMEOUT)
def test_a_prefix_evicted_from_the_cpu_tier_is_served_from_disk(
    run_vllm: RunVLLM, reuse_baseline: dict[str, Any], tmp_path: Path
) -> None:
    """A CPU tier of 8 chunks under a disk tier: the fillers of round 1 evict A's blocks
    from the CPU tier, so round 2's A is promoted from disk (through the worker's host
    pool in /dev/shm, which the scheduler maps) and must give the baseline's outputs."""
    shm_before = set(Path("/dev/shm").glob("asyncoffload-*.pool"))
    config = asyncoffload_kv_transfer_config(
        policy="lru",
        cpu_bytes_to_use=8 * BLOCK_BYTES,
        tiers=[{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB", "admission": None}],
    )
    result = run_vllm(baseline_rounds(), name="ours-disk", kv_transfer_config=config)

    _assert_same_outputs(result, reuse_baseline)
    (a_again,) = requests_of(result, 2)
    assert a_again["num_cached_tokens"] == A_BLOCKS * BLOCK_SIZE
    metrics = result["metrics"]
    assert metrics["vllm:asyncoffload_tier_blocks_read"] >= A_BLOCKS
    assert metrics["vllm:asyncoffload_tier_blocks_written"] >= 3 * A_BLOCKS
    assert metrics.get("vllm:asyncoffload_tier_read_failures", 0) == 0
    events = summarize_events(result)
    assert events["counts"]["BlockStored:STORAGE"] >= 3 * A_BLOCKS
    # The pool file was unlinked (once mapped by both sides, and at shutdown).
    assert set(Path("/dev/shm").glob("asyncoffload-*.pool")) <= shm_before
